// Shareable GPU memory through the CUDA VMM API (built with
// SHMCAST_WITH_CUDA); see cuda_vmm.hpp.
#include "engine/cuda_vmm.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <utility>

#include "base/text.hpp"
#include "engine/cuda_driver.hpp"
#include "engine/engine.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail::vmm {

namespace {

constexpr const char* kHostSlots = "use a host-slot region instead (slot_memory = kHost: the slots in pinned host "
                                   "memory, which any process can map)";

// The driver, with the VMM API; throws kCudaUnavailable saying why not.
const cu::Api& api() {
  std::string why;
  if (!cuda_present(&why)) throw Error(Errc::kCudaUnavailable, why + "; device slots need a GPU: " + kHostSlots);
  const cu::Api* a = cu::load(nullptr);
  if (!a->vmm_missing.empty())
    throw Error(Errc::kCudaUnavailable, "device slots need the CUDA virtual memory API, which the NVIDIA driver (CUDA " +
                                            cu::version_text(a->driver_version) + ", " + a->library + ") lacks (" +
                                            a->vmm_missing + "): update the driver to CUDA 11.4 or newer, or " +
                                            kHostSlots);
  return *a;
}

int device_count(const cu::Api& d) {
  int n = 0;
  cu::check(d, d.cuDeviceGetCount(&n), "cuDeviceGetCount");
  return n;
}

CUdevice device_handle(const cu::Api& d, int device) {
  const int n = device_count(d);
  if (device < 0 || device >= n)
    throw Error(Errc::kInvalidArgument, "no CUDA device " + std::to_string(device) + " in this process (it sees " +
                                            std::to_string(n) + "; check CUDA_VISIBLE_DEVICES)");
  CUdevice h = 0;
  cu::check(d, d.cuDeviceGet(&h, device), "cuDeviceGet(" + std::to_string(device) + ")");
  return h;
}

Uuid uuid_of(const cu::Api& d, CUdevice h) {
  CUuuid u{};
  cu::check(d, d.cuDeviceGetUuid(&u, h), "cuDeviceGetUuid");
  Uuid out;
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::uint8_t>(u.bytes[i]);
  return out;
}

std::string describe(const cu::Api& d, int device) {
  std::string s = "GPU " + std::to_string(device);
  try {
    s += " (" + uuid_text(uuid_of(d, device_handle(d, device))) + ")";
  } catch (const Error&) {
  }
  return s;
}

// Pinned device memory on `device`, exportable as a POSIX fd.
CUmemAllocationProp allocation_prop(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

// Refuses a device that cannot share VMM memory as POSIX fds.
void require_vmm(const cu::Api& d, int device, CUdevice h) {
  int vmm = 0, fd = 0;
  cu::check(d, d.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, h),
            "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
  cu::check(d, d.cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, h),
            "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)");
  if (vmm == 0 || fd == 0)
    throw Error(Errc::kUnsupported, describe(d, device) + " cannot share memory as file descriptors (" +
                                        (vmm == 0 ? "no virtual memory management" : "no POSIX fd handles") +
                                        ", for instance under vGPU or WSL): device slots are unavailable here; " +
                                        kHostSlots);
}

std::uint64_t granularity_of(const cu::Api& d, int device) {
  const CUmemAllocationProp p = allocation_prop(device);
  std::size_t g = 0;
  cu::check(d, d.cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity (device " + std::to_string(device) + ")");
  if (g == 0) g = 2u << 20;
  return g;
}

CUmemAccessDesc access_for(int device) {
  CUmemAccessDesc a{};
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = device;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

}  // namespace

std::string uuid_text(const Uuid& u) { return gpu_uuid_text(u); }

Uuid device_uuid(int device) {
  const cu::Api& d = api();
  return uuid_of(d, device_handle(d, device));
}

int device_with_uuid(const Uuid& uuid) {
  const cu::Api& d = api();
  const int n = device_count(d);
  for (int i = 0; i < n; ++i) {
    CUdevice h = 0;
    if (d.cuDeviceGet(&h, i) == CUDA_SUCCESS && uuid_of(d, h) == uuid) return i;
  }
  return -1;
}

int current_device() {
  const cu::Api& d = api();
  CUcontext c = nullptr;
  if (d.cuCtxGetCurrent(&c) == CUDA_SUCCESS && c != nullptr) {
    CUdevice dev = 0;  // a CUdevice is the device's ordinal
    if (d.cuCtxGetDevice(&dev) == CUDA_SUCCESS) return static_cast<int>(dev);
  }
  return 0;
}

std::uint64_t granularity(int device) {
  const cu::Api& d = api();
  (void)device_handle(d, device);
  cu::CtxScope scope(d, cu::primary_context(d, device));
  return granularity_of(d, device);
}

MemInfo mem_info(int device) {
  const cu::Api& d = api();
  (void)device_handle(d, device);
  cu::CtxScope scope(d, cu::primary_context(d, device));
  std::size_t free = 0, total = 0;
  cu::check(d, d.cuMemGetInfo(&free, &total), "cuMemGetInfo");
  return {free, total};
}

Mapping::Mapping(Mapping&& o) noexcept { *this = std::move(o); }

Mapping& Mapping::operator=(Mapping&& o) noexcept {
  if (this != &o) {
    release();
    handle_ = std::exchange(o.handle_, 0);
    va_ = std::exchange(o.va_, 0);
    bytes_ = std::exchange(o.bytes_, 0);
    device_ = std::exchange(o.device_, -1);
    owner_ = std::exchange(o.owner_, -1);
    reserved_ = std::exchange(o.reserved_, false);
    mapped_ = std::exchange(o.mapped_, false);
    imported_ = std::exchange(o.imported_, false);
    pid_ = std::exchange(o.pid_, 0);
  }
  return *this;
}

Mapping Mapping::allocate(int device, std::uint64_t bytes) {
  const cu::Api& d = api();
  const CUdevice h = device_handle(d, device);
  if (bytes == 0) throw Error(Errc::kInvalidArgument, "device slots of 0 bytes");
  require_vmm(d, device, h);
  cu::CtxScope scope(d, cu::primary_context(d, device));
  const std::uint64_t g = granularity_of(d, device);
  if (bytes > ~0ull - g) throw Error(Errc::kInvalidArgument, "device slots of " + std::to_string(bytes) + " bytes");
  const std::uint64_t size = (bytes + g - 1) / g * g;
  Mapping m;  // from here on, a throw releases whatever was made
  m.pid_ = ::getpid();
  m.device_ = m.owner_ = device;
  m.bytes_ = size;
  const CUmemAllocationProp p = allocation_prop(device);
  CUmemGenericAllocationHandle mh = 0;
  const CUresult r = d.cuMemCreate(&mh, size, &p, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY)
    cu::check(d, r, "cuMemCreate of " + std::to_string(size) + " bytes on " + describe(d, device),
              "not enough free GPU memory for the device slots: use fewer or smaller slots, or host slots");
  cu::check(d, r, "cuMemCreate of " + std::to_string(size) + " bytes on " + describe(d, device));
  m.handle_ = mh;
  CUdeviceptr va = 0;
  cu::check(d, d.cuMemAddressReserve(&va, size, g, 0, 0), "cuMemAddressReserve of " + std::to_string(size) + " bytes");
  m.va_ = static_cast<std::uintptr_t>(va);
  m.reserved_ = true;
  cu::check(d, d.cuMemMap(va, size, 0, mh, 0), "cuMemMap");
  m.mapped_ = true;
  const CUmemAccessDesc a = access_for(device);
  cu::check(d, d.cuMemSetAccess(va, size, &a, 1), "cuMemSetAccess (" + describe(d, device) + ")");
  return m;
}

Mapping Mapping::import(int fd, std::uint64_t bytes, const Uuid& owner_uuid, int device) {
  const cu::Api& d = api();
  const CUdevice h = device_handle(d, device);
  // Everything that can be refused is refused before the fd is touched.
  const int owner = device_with_uuid(owner_uuid);
  if (owner < 0)
    throw Error(Errc::kUnsupported, "the GPU that holds the device slots (" + uuid_text(owner_uuid) +
                                        ") is not visible to this process (it sees " +
                                        std::to_string(device_count(d)) + " GPUs: CUDA_VISIBLE_DEVICES, or a "
                                        "container started without that GPU), so their memory cannot be mapped "
                                        "here; " + kHostSlots + ", or give this process that GPU");
  require_vmm(d, device, h);
  if (owner != device) {
    const CUdevice oh = device_handle(d, owner);
    int can = 0;
    cu::check(d, d.cuDeviceCanAccessPeer(&can, h, oh), "cuDeviceCanAccessPeer");
    if (can == 0)
      throw Error(Errc::kUnsupported, "this consumer's " + describe(d, device) + " cannot access " +
                                          describe(d, owner) + ", which holds the device slots (no NVLink or PCIe "
                                          "peer-to-peer between them): " + kHostSlots +
                                          ", or run this consumer on the producer's GPU");
  }
  cu::CtxScope scope(d, cu::primary_context(d, device));
  const std::uint64_t g = granularity_of(d, owner);
  if (bytes == 0 || bytes % g != 0)
    throw Error(Errc::kCorrupt, "device slots of " + std::to_string(bytes) + " bytes: not a multiple of the GPU's "
                                "allocation granularity (" + std::to_string(g) + "), so not an allocation of its "
                                "producer; refused");
  Mapping m;
  m.pid_ = ::getpid();
  m.device_ = device;
  m.owner_ = owner;
  m.bytes_ = bytes;
  m.imported_ = true;
  CUmemGenericAllocationHandle mh = 0;
  cu::check(d,
            d.cuMemImportFromShareableHandle(&mh, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle", "the descriptor is not a CUDA allocation exported on this machine");
  m.handle_ = mh;
  CUdeviceptr va = 0;
  cu::check(d, d.cuMemAddressReserve(&va, bytes, g, 0, 0), "cuMemAddressReserve of " + std::to_string(bytes) + " bytes");
  m.va_ = static_cast<std::uintptr_t>(va);
  m.reserved_ = true;
  cu::check(d, d.cuMemMap(va, bytes, 0, mh, 0), "cuMemMap of the imported device slots (" + std::to_string(bytes) + " bytes)",
            "the size the producer announced is not its allocation's");
  m.mapped_ = true;
  // Access for this process's device and, when the memory lives on another
  // GPU, for that one too: a copy works whichever of the two runs it.
  const CUmemAccessDesc a[2] = {access_for(device), access_for(owner)};
  cu::check(d, d.cuMemSetAccess(va, bytes, a, owner == device ? 1 : 2),
            "cuMemSetAccess (" + describe(d, device) + (owner == device ? "" : " and " + describe(d, owner)) + ")",
            owner == device ? "" : "peer access was reported possible; is the GPUs' peer link disabled?");
  return m;
}

int Mapping::export_fd() const {
  if (handle_ == 0) throw Error(Errc::kInvalidArgument, "export_fd of an empty Mapping");
  const cu::Api& d = api();
  cu::CtxScope scope(d, cu::primary_context(d, device_));
  int fd = -1;
  cu::check(d, d.cuMemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
  if (fd < 0) throw Error(Errc::kCuda, "cuMemExportToShareableHandle returned no descriptor");
  (void)::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return fd;
}

void Mapping::release() noexcept {
  if (handle_ == 0 && !reserved_) return;
  if (pid_ != ::getpid()) {
    // Inherited through fork: CUDA is not usable here, and the parent's
    // mapping is the parent's. Forget it.
    handle_ = 0;
    reserved_ = mapped_ = false;
    return;
  }
  const cu::Api* d = cu::load(nullptr);
  if (d != nullptr) {
    std::optional<cu::CtxScope> scope;
    try {
      scope.emplace(*d, cu::primary_context(*d, device_));
    } catch (...) {  // release what we can without it
    }
    const CUdeviceptr va = static_cast<CUdeviceptr>(va_);
    if (mapped_) (void)d->cuMemUnmap(va, bytes_);
    if (reserved_) (void)d->cuMemAddressFree(va, bytes_);
    if (handle_ != 0) (void)d->cuMemRelease(handle_);
  }
  handle_ = 0;
  va_ = 0;
  reserved_ = mapped_ = false;
}

}  // namespace shmcast::detail::vmm
