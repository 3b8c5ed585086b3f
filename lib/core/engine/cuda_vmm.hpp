// GPU memory that other processes can map, through the CUDA virtual memory
// management (VMM) API: the device slots' memory. No CUDA IPC handle
// (cudaIpc*) and no pidfd_getfd: the producer allocates with cuMemCreate
// asking for the POSIX-fd handle type, exports a file descriptor
// (cuMemExportToShareableHandle), and hands it to consumers over the fd
// channel (fd_channel.hpp, SCM_RIGHTS); a consumer imports it
// (cuMemImportFromShareableHandle) and maps it for its own device.
//
//   producer: Mapping m = Mapping::allocate(dev, bytes);   // mapped for dev
//             int fd = m.export_fd();                      // serve it, then close it
//   consumer: Mapping m = Mapping::import(fd, bytes, owner_uuid, dev);
//             ... device-to-device copies out of m.data() ...
//
// Lifetime: the memory goes back to the GPU once every process has
// released it: the allocating handle, every exported fd still open (in any
// process, or in flight in a socket), and every import's mapping. release()
// (and the destructor) unmaps, frees the address range, then releases the
// handle. A consumer that dies loses its mapping with its process.
//
// Devices are this process's ordinals (CUDA_VISIBLE_DEVICES applies); a GPU
// is named across processes by its UUID. A consumer on another GPU than the
// memory's maps it with peer access (NVLink or PCIe P2P) when
// cuDeviceCanAccessPeer allows it (access is set for both GPUs in this
// process's mapping); otherwise import() throws kUnsupported naming the
// reason and the alternative (a host-slot region).
//
// Every call runs in the device's primary context (the runtime's, torch's),
// pushed for the call. Without CUDA (no toolkit at build time: the stub in
// cuda_vmm_none.cpp; no driver or GPU at run time; a driver without the VMM
// API) everything throws kCudaUnavailable with the reason. A Mapping
// inherited through fork does nothing in the child.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <string>

namespace shmcast::detail::vmm {

using Uuid = std::array<std::uint8_t, 16>;

// "GPU-2f6a7e4c-...", as nvidia-smi -L prints it (base/text.hpp: gpu_uuid_text).
std::string uuid_text(const Uuid& uuid);

// The UUID of device `device` (for the region header and the fd
// descriptor).
Uuid device_uuid(int device);
// This process's ordinal of the GPU with `uuid`, or -1 when it sees none.
int device_with_uuid(const Uuid& uuid);
// The current device: the device of the context current on this thread
// (cudaSetDevice, torch.cuda.device), else 0, as cudaGetDevice reports.
int current_device();
// Allocation granularity of `device` for memory shared as POSIX fds: sizes
// are rounded up to a multiple of it (2 MiB on current GPUs).
std::uint64_t granularity(int device);

struct MemInfo {
  std::uint64_t free = 0, total = 0;  // cuMemGetInfo, the whole GPU
};
MemInfo mem_info(int device);

class Mapping {
 public:
  // Allocates `bytes`, rounded up to granularity(device), on `device` and
  // maps it there read-write. Throws kInvalidArgument (0 bytes, no such
  // device), kUnsupported (the GPU cannot share VMM memory as POSIX fds),
  // kCuda (out of GPU memory, ...), kCudaUnavailable.
  static Mapping allocate(int device, std::uint64_t bytes);
  // Imports `fd` (from export_fd() in another process; the caller keeps and
  // closes it), an allocation of exactly `bytes` on the GPU `owner`, and
  // maps it read-write for `device` of this process. Throws kUnsupported
  // when `owner` is not visible here or `device` cannot reach it, kCorrupt
  // for a size that is no multiple of the granularity, kCuda when the
  // driver refuses the fd or the size, kCudaUnavailable.
  static Mapping import(int fd, std::uint64_t bytes, const Uuid& owner, int device);

  Mapping() = default;
  Mapping(Mapping&& o) noexcept;
  Mapping& operator=(Mapping&& o) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { release(); }

  // A new descriptor for the allocation (close-on-exec; the caller owns it).
  int export_fd() const;

  void* data() const { return reinterpret_cast<void*>(va_); }  // device address
  std::uintptr_t address() const { return va_; }
  std::uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }        // mapped for
  int owner_device() const { return owner_; }   // holds the memory (this process's ordinal)
  bool imported() const { return imported_; }
  bool empty() const { return handle_ == 0; }

  // Unmaps, frees the address range, releases the handle (in that order);
  // errors are ignored (there is nothing left to do about them). Idempotent.
  void release() noexcept;

 private:
  std::uint64_t handle_ = 0;  // CUmemGenericAllocationHandle
  std::uintptr_t va_ = 0;     // CUdeviceptr
  std::uint64_t bytes_ = 0;
  int device_ = -1, owner_ = -1;
  bool reserved_ = false, mapped_ = false, imported_ = false;
  pid_t pid_ = 0;  // the process that made it
};

}  // namespace shmcast::detail::vmm
