// The binding's private header: what its translation units share.
//
//   module.cpp    PYBIND11_MODULE: constants, free functions, the classes below
//   errors.cpp    shmcast::Error -> one Python exception class per Errc
//   args.cpp      Python arguments -> C++ values, checked (InvalidArgument / TypeError)
//   producer.cpp  Producer (and SentSync)
//   consumer.cpp  Consumer (and SyncInfo)
//   tensors.cpp   the batched checks of a sync's torch tensors (PlainTensors)
//
// Deliberately torch-free: tensors cross this boundary as raw pointers (int),
// specs as (name, dtype-name, shape) tuples. The torch-facing API lives in
// python/shmcast/ (_torch.py re-exports it). Every call that waits or copies
// releases the GIL; a per-object mutex (taken after the GIL is released) keeps
// two Python threads from entering the same C++ object at once.
//
// Batched entry points (Producer.send_batch / write_batch) move a whole
// sync in ONE Python->C++ call, so per-tensor Python overhead is only the
// argument conversion.
#pragma once

#include <unistd.h>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace py = pybind11;

namespace shmcast::python {

// ------------------------------------------------------------------ text (errors.cpp)

// A Python str from bytes that need not be UTF-8 (see errors.cpp).
py::str text(std::string_view s, const char* errors = "backslashreplace");

// ------------------------------------------------------------------ errors (errors.cpp)

// "shmcast Timeout: no sync ..." -> "no sync ..." (the class names the code).
std::string strip_prefix(const Error& e);
// shmcast.Error and one subclass per Errc, and the translator that raises them.
void register_exceptions(py::module_& m);

// ------------------------------------------------------------------ arguments (args.cpp)
//
// Every argument is converted with the GIL held, so that a bad one is a
// shmcast.InvalidArgument naming it and its range (or a TypeError naming it
// when it is not a number / not a str) rather than pybind11's "incompatible
// function arguments".

std::string ascii_repr(py::handle h);

// An integer argument in lo..hi (Python ints of any size, or anything with
// __index__; not floats).
template <class T>
T int_arg(py::handle h, const char* what, T lo, T hi) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= 8);
  PyObject* o = h.ptr();
  py::object index;
  if (!PyLong_Check(o)) {
    if (PyFloat_Check(o) || !PyIndex_Check(o))
      throw py::type_error(std::string(what) + " must be an int, not " + Py_TYPE(o)->tp_name);
    index = py::reinterpret_steal<py::object>(PyNumber_Index(o));
    if (!index) throw py::error_already_set();
    o = index.ptr();
  }
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  bool ok = false;
  T v{};
  if (overflow == 0) {
    if constexpr (std::is_signed_v<T>) {
      ok = x >= static_cast<long long>(lo) && x <= static_cast<long long>(hi);
    } else {
      ok = x >= 0 && static_cast<unsigned long long>(x) >= lo && static_cast<unsigned long long>(x) <= hi;
    }
    v = static_cast<T>(x);
  } else if constexpr (std::is_unsigned_v<T>) {
    if (overflow > 0) {
      const unsigned long long u = PyLong_AsUnsignedLongLong(o);
      if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();  // beyond 64 bits
      } else {
        ok = u >= lo && u <= hi;
        v = static_cast<T>(u);
      }
    }
  }
  if (!ok)
    throw Error(Errc::kInvalidArgument, std::string(what) + " is " + py::str(o).cast<std::string>() +
                                            "; it must be an int in " + std::to_string(lo) + ".." + std::to_string(hi));
  return v;
}

constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();

Duration seconds_arg(py::handle h, const char* what, bool allow_none);
// A ratio in (0, 1] (a float or an int).
double ratio_arg(py::handle h, const char* what);
std::string utf8_arg(py::handle h, const char* what, Errc code);
std::string region_name_arg(py::handle h);
std::string message_arg(py::handle h);
std::size_t index_arg(py::handle h, const char* what = "index");
Strided2D layout_args(py::handle rows, py::handle row_bytes, py::handle pitch_bytes);
Pin parse_pin(py::handle o);
CopyEngine parse_engine(py::handle h);
RegionMode parse_mode(py::handle h);
const char* mode_name(RegionMode m);
// 'host' | 'device' (InvalidArgument, a ValueError, otherwise).
SlotMemory parse_slot_memory(py::handle h);
const char* slot_memory_name(SlotMemory m);
// quantize_filter: a Python callable f(name, shape tuple, dtype name) -> bool,
// called with the GIL (the library calls it from begin_sync()).
QuantizeFilter quantize_filter_arg(py::handle f);
// A CUDA device ordinal: None or -1 -> -1 (the current device), else 0...
int device_arg(py::handle h, const char* what);
StallPolicy parse_stall(py::handle h);
DType parse_dtype(py::handle h);
std::uintptr_t as_ptr(py::handle h, const char* what = "pointer");
std::vector<TensorSpec> to_specs(py::handle specs);
Selection to_selection(py::handle item);
std::vector<Selection> to_selections(py::handle h);
TensorInfo to_tensor_info(py::handle h);
std::vector<void*> to_ptrs(py::handle ptrs);
std::optional<Strided2D> to_layout(py::handle h);

// One source of a batched write, converted while the GIL is held.
struct Source {
  void* ptr = nullptr;
  bool device = false;
  std::optional<Strided2D> layout;
  void* stream = nullptr;
};

std::vector<Source> to_sources(py::handle ptrs, py::handle devices, py::handle layouts, py::handle streams);
py::tuple shape_tuple(const std::vector<std::int64_t>& shape);
// {'version', 'kind' ('full' | 'delta'; None before the first sync),
// 'logical_bytes', 'payload_bytes'}: Producer.last_sync and Consumer.last_sync.
py::dict sync_report(const SyncReport& r);

// ------------------------------------------------------------------ sync info (consumer.cpp)

// What Consumer.wait_sync returns: a snapshot, converted once. Its tensors
// wait here as flat arrays, shared by the copies, and become Python objects
// on first use: `tensors` (receive_into() of plain destinations never needs
// them: plain_destinations reads the arrays) and `pieces` (few callers).
struct PySync {
  std::uint64_t version = 0, stream_bytes = 0, payload_bytes = 0, first_seq = 0, chunks = 0;
  std::uint64_t base_version = 0, wire_bytes = 0;  // delta syncs (SyncInfo::base_version, wire_bytes)
  std::uint32_t world_size = 1;

  struct Flat {
    std::string names;                      // every name (valid UTF-8), back to back
    std::vector<std::size_t> name_end;      // name i is names[name_end[i - 1], name_end[i])
    std::vector<DType> dtypes;
    std::vector<std::uint64_t> nbytes, offsets;
    std::vector<std::int64_t> dims;         // every shape, back to back
    std::vector<std::size_t> dims_end;      // shape i is dims[dims_end[i - 1], dims_end[i])
    py::object list;                        // once made: a tuple ((name, dtype, shape, nbytes, stream_offset), ...)

    std::size_t size() const { return dtypes.size(); }
    std::string_view name(std::size_t i) const {
      const std::size_t b = i ? name_end[i - 1] : 0;
      return std::string_view(names).substr(b, name_end[i] - b);
    }
    std::span<const std::int64_t> shape(std::size_t i) const {
      const std::size_t b = i ? dims_end[i - 1] : 0;
      return std::span<const std::int64_t>(dims).subspan(b, dims_end[i] - b);
    }
  };
  std::shared_ptr<Flat> flat = std::make_shared<Flat>();
  // ((name, dtype, shape, nbytes, stream_offset), ...), made on first use.
  py::object tensors() const;

  struct Pieces {
    std::vector<ShardInfo> shards;     // every tensor's, in order
    std::vector<std::size_t> starts;   // tensor i's are shards[starts[i], starts[i + 1])
    py::object list;                   // once made: per tensor [(rank, dim, start, length, nbytes)]
  };
  std::shared_ptr<Pieces> pieces_data = std::make_shared<Pieces>();
  // Per tensor: [(rank, dim, start, length, nbytes)], dim -1 = whole.
  py::object pieces() const;

  static PySync from(const SyncInfo& s);
};

// ------------------------------------------------------------------ the GC

// Python's cyclic GC paused while a sync's objects are made or walked (the
// GIL held throughout, so no other thread sees it paused): each 700 new
// objects would start a collection that walks every tracked object of the
// process (a model's tensors), most of the cost of a sync of 100,000 tensors.
class GcPaused {
 public:
#if PY_VERSION_HEX >= 0x030A0000
  GcPaused() : was_(PyGC_Disable()) {}
  ~GcPaused() {
    if (was_ == 1) PyGC_Enable();
  }
  GcPaused(const GcPaused&) = delete;
  GcPaused& operator=(const GcPaused&) = delete;

 private:
  int was_;
#endif
};

// ------------------------------------------------------------------ plain tensors (tensors.cpp)

// A PlainTensors (plain_sources): its specs, moved out (Producer.send_plain).
std::vector<TensorSpec> take_specs(py::handle plain);
// A PlainTensors' pointers and device (-1: CPU) (Consumer.read_plain, Producer.send_plain).
const std::vector<void*>& plain_ptrs(py::handle plain, int* device);

// ------------------------------------------------------------------ fork

// A forked child inherits these objects (their mapping, file descriptors,
// seat and locks) but they are the parent's: in the child, close() and the
// destructor do nothing, so the child's exit neither unlinks the parent's
// region nor frees its seat, and every other call raises InvalidArgument
// (checked before the object's mutex, which a parent thread may have held at
// the fork).
class Owned {
 protected:
  bool forked() const { return ::getpid() != pid_; }
  void check_owner(const char* what) const {
    if (forked())
      throw Error(Errc::kInvalidArgument, std::string("this ") + what + " belongs to process " + std::to_string(pid_) +
                                              "; a forked child (pid " + std::to_string(::getpid()) +
                                              ") cannot use it: create a new " + what + " in the child");
  }

 private:
  const pid_t pid_ = ::getpid();
};

// ------------------------------------------------------------------ the classes

void bind_sync_info(py::module_& m);  // SyncInfo (consumer.cpp)
void bind_producer(py::module_& m);   // SentSync, Producer (producer.cpp)
void bind_consumer(py::module_& m);   // Consumer (consumer.cpp)
void bind_tensors(py::module_& m);    // PlainTensors, use_torch, plain_sources, plain_destinations (tensors.cpp)

}  // namespace shmcast::python
