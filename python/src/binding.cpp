// shmcast._shmcast: the pybind11 binding of shmcast.hpp.
//
// Deliberately torch-free: tensors cross this boundary as raw pointers (int),
// specs as (name, dtype-name, shape) tuples. The torch-facing API lives in
// python/shmcast/ (_torch.py). Every call that waits or copies releases the
// GIL; a per-object mutex (taken after the GIL is released) keeps two Python
// threads from entering the same C++ object at once.
//
// Batched entry points (Producer.send_batch / write_batch) move a whole
// sync in ONE Python->C++ call, so per-tensor Python overhead is only the
// argument conversion.
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
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "shmcast/shmcast.hpp"

namespace py = pybind11;
using namespace shmcast;

namespace {

// ------------------------------------------------------------------ text

// A Python str from bytes that need not be UTF-8: error texts come from the
// region (another process wrote them, and the library cuts them at 255
// bytes, possibly inside a character), so decoding must never raise.
// errors: "backslashreplace" for messages, "surrogateescape" for paths
// (what os.fsdecode does).
py::str text(std::string_view s, const char* errors = "backslashreplace") {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), errors);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// ------------------------------------------------------------------ errors

constexpr int kMaxErrc = static_cast<int>(Errc::kUnsupported);
std::array<PyObject*, kMaxErrc + 1> g_exc_by_code{};  // index: Errc value
PyObject* g_exc_base = nullptr;

// "shmcast Timeout: no sync ..." -> "no sync ..." (the class names the code).
std::string strip_prefix(const Error& e) {
  std::string what = e.what();
  const std::string prefix = std::string("shmcast ") + errc_name(e.code()) + ": ";
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  return what;
}

void raise_shmcast_error(const Error& e) {
  const int c = static_cast<int>(e.code());
  PyObject* type = (c >= 0 && c <= kMaxErrc && g_exc_by_code[c]) ? g_exc_by_code[c] : g_exc_base;
  py::gil_scoped_acquire gil;  // translators run with the GIL; harmless
  try {
    py::object inst = py::reinterpret_borrow<py::object>(type)(text(strip_prefix(e)));
    inst.attr("code") = py::str(errc_name(e.code()));
    inst.attr("sys_errno") = py::int_(e.sys_errno());
    PyErr_SetObject(type, inst.ptr());
  } catch (py::error_already_set& pe) {
    pe.restore();
  }
}

py::object make_exception(py::module_& m, const char* name, const char* code, std::initializer_list<PyObject*> bases,
                          const char* doc) {
  py::tuple b(bases.size());
  std::size_t i = 0;
  for (PyObject* base : bases) b[i++] = py::reinterpret_borrow<py::object>(base);
  const std::string qual = std::string("shmcast.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(qual.c_str(), doc, b.ptr(), nullptr);
  if (!t) throw py::error_already_set();
  py::object type = py::reinterpret_steal<py::object>(t);
  type.attr("code") = py::str(code);
  m.attr(name) = type;
  return type;
}

void register_exceptions(py::module_& m) {
  py::object base = make_exception(m, "Error", "Error", {PyExc_RuntimeError},
                                   "Base class of every shmcast error. `.code` names the shmcast::Errc "
                                   "(e.g. 'Timeout'); `.sys_errno` is the failing system call's errno or 0.");
  base.attr("sys_errno") = 0;  // instances raised by the binding carry their own
  g_exc_base = base.ptr();
  base.inc_ref();  // lives as long as the interpreter
  struct Row {
    Errc code;
    const char* name;
    PyObject* extra;  // a builtin base to add, or nullptr
    const char* doc;
  };
  const Row rows[] = {
      {Errc::kInvalidArgument, "InvalidArgument", PyExc_ValueError, "Bad call: wrong index, order or option."},
      {Errc::kBadName, "BadName", PyExc_ValueError, "The region name fails validation."},
      {Errc::kExists, "Exists", PyExc_FileExistsError, "A region of that name exists and its producer is alive."},
      {Errc::kNotFound, "NotFound", PyExc_FileNotFoundError, "No region of that name (yet)."},
      {Errc::kRegionFull, "RegionFull", nullptr, "Not enough free space in the region directory."},
      {Errc::kPermission, "Permission", PyExc_PermissionError, "The OS refused (file mode, owner, seccomp)."},
      {Errc::kCorrupt, "Corrupt", nullptr, "Region bytes fail validation."},
      {Errc::kVersionMismatch, "VersionMismatch", nullptr, "The region was made by an incompatible shmcast."},
      {Errc::kTimeout, "Timeout", PyExc_TimeoutError, "A deadline passed while the peer was still alive."},
      {Errc::kPeerDied, "PeerDied", nullptr, "The producer (or a needed consumer) died."},
      {Errc::kClosed, "Closed", nullptr, "The producer closed the region, or this object is closed."},
      {Errc::kNoSeat, "NoSeat", nullptr, "All consumer seats are taken."},
      {Errc::kEvicted, "Evicted", nullptr, "The producer evicted this consumer (it stalled)."},
      {Errc::kAborted, "Aborted", nullptr, "The producer aborted the sync in progress."},
      {Errc::kChecksum, "Checksum", nullptr, "Slot checksum mismatch: bytes changed in flight."},
      {Errc::kCuda, "CudaError", nullptr, "A CUDA call failed."},
      {Errc::kCudaUnavailable, "CudaUnavailable", nullptr, "Built without CUDA, or no GPU present."},
      {Errc::kSystem, "SystemFailure", PyExc_OSError, "Unexpected OS error (see .sys_errno)."},
      {Errc::kUnsupported, "Unsupported", nullptr,
       "This setup cannot do it (e.g. device slots on a GPU the consumer cannot reach); the message says why and "
       "what to use instead."},
  };
  for (const Row& r : rows) {
    py::object t = r.extra ? make_exception(m, r.name, errc_name(r.code), {base.ptr(), r.extra}, r.doc)
                           : make_exception(m, r.name, errc_name(r.code), {base.ptr()}, r.doc);
    t.inc_ref();
    g_exc_by_code[static_cast<int>(r.code)] = t.ptr();
  }
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise_shmcast_error(e);
    }
  });
}

// ------------------------------------------------------------------ arguments
//
// Every argument is converted here, with the GIL held, so that a bad one is
// a shmcast.InvalidArgument naming it and its range (or a TypeError naming it
// when it is not a number / not a str) rather than pybind11's "incompatible
// function arguments".

std::string ascii_repr(py::handle h) {
  PyObject* r = PyObject_ASCII(h.ptr());
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(r).cast<std::string>();
}

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

// A duration in seconds: a number >= 0; inf (and None where allow_none)
// means no limit.
Duration seconds_arg(py::handle h, const char* what, bool allow_none) {
  const double forever = 3.0e8;  // ~10 years: "forever" without overflowing a deadline
  double s;
  if (h.is_none()) {
    if (!allow_none) throw py::type_error(std::string(what) + " must be a number of seconds, not None");
    s = forever;
  } else if (PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()) || PyIndex_Check(h.ptr())) {
    s = PyFloat_AsDouble(h.ptr());
    if (s == -1.0 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
      PyErr_Clear();  // an int beyond a double: a very long time (or a very negative one)
      s = PyObject_RichCompareBool(h.ptr(), py::int_(0).ptr(), Py_LT) == 1 ? -1.0 : forever;
    }
  } else {
    throw py::type_error(std::string(what) + " must be a number of seconds, not " + Py_TYPE(h.ptr())->tp_name);
  }
  if (std::isnan(s) || s < 0)
    throw Error(Errc::kInvalidArgument, std::string(what) + " is " + ascii_repr(h) +
                                            "; it must be a number of seconds >= 0 (inf" +
                                            (allow_none ? " or None" : "") + ": no limit)");
  if (s > forever) s = forever;
  return Duration(static_cast<std::int64_t>(std::llround(s * 1e9)));
}

// A str argument as UTF-8 (bytes pass as they are). A str that has no UTF-8
// form (a lone surrogate, e.g. from os.fsdecode of a non-UTF-8 name) is
// `code`, not a UnicodeEncodeError.
std::string utf8_arg(py::handle h, const char* what, Errc code) {
  PyObject* o = h.ptr();
  if (PyUnicode_Check(o)) {
    Py_ssize_t n = 0;
    const char* p = PyUnicode_AsUTF8AndSize(o, &n);
    if (!p) {
      PyErr_Clear();
      throw Error(code, std::string(what) + " " + ascii_repr(h) +
                            " is not valid Unicode (a lone surrogate?): it has no UTF-8 form");
    }
    return std::string(p, static_cast<std::size_t>(n));
  }
  if (PyBytes_Check(o)) return std::string(PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o)));
  throw py::type_error(std::string(what) + " must be a str, not " + Py_TYPE(o)->tp_name);
}

std::string region_name_arg(py::handle h) { return utf8_arg(h, "region name", Errc::kBadName); }

// Free text (an abort reason): never refused; what has no UTF-8 form is escaped.
std::string message_arg(py::handle h) {
  py::str s(h);
  PyObject* b = PyUnicode_AsEncodedString(s.ptr(), "utf-8", "backslashreplace");
  if (!b) throw py::error_already_set();
  py::bytes bytes = py::reinterpret_steal<py::bytes>(b);
  return std::string(PyBytes_AS_STRING(b), static_cast<std::size_t>(PyBytes_GET_SIZE(b)));
}

std::size_t index_arg(py::handle h, const char* what = "index") {
  return int_arg<std::size_t>(h, what, 0, std::numeric_limits<std::size_t>::max());
}

Strided2D layout_args(py::handle rows, py::handle row_bytes, py::handle pitch_bytes) {
  return Strided2D{int_arg<std::uint64_t>(rows, "rows", 0, kU64Max),
                   int_arg<std::uint64_t>(row_bytes, "row_bytes", 0, kU64Max),
                   int_arg<std::uint64_t>(pitch_bytes, "pitch_bytes", 0, kU64Max)};
}

Pin parse_pin(py::handle o) {
  if (py::isinstance<py::bool_>(o)) return o.cast<bool>() ? Pin::kYes : Pin::kNo;
  const std::string s = utf8_arg(py::str(o), "pin", Errc::kInvalidArgument);
  if (s == "auto") return Pin::kAuto;
  if (s == "yes" || s == "on" || s == "true") return Pin::kYes;
  if (s == "no" || s == "off" || s == "false") return Pin::kNo;
  throw Error(Errc::kInvalidArgument, "pin must be 'auto', True/'yes' or False/'no', not '" + s + "'");
}

CopyEngine parse_engine(py::handle h) {
  const std::string s = utf8_arg(h, "engine", Errc::kInvalidArgument);
  if (s == "auto") return CopyEngine::kAuto;
  if (s == "host") return CopyEngine::kHost;
  if (s == "cuda") return CopyEngine::kCuda;
  throw Error(Errc::kInvalidArgument, "engine must be 'auto', 'host' or 'cuda', not '" + s + "'");
}

RegionMode parse_mode(py::handle h) {
  const std::string s = utf8_arg(h, "mode", Errc::kInvalidArgument);
  if (s == "ring") return RegionMode::kRing;
  if (s == "store") return RegionMode::kStore;
  throw Error(Errc::kInvalidArgument, "mode must be 'ring' or 'store', not '" + s + "'");
}

const char* mode_name(RegionMode m) { return m == RegionMode::kStore ? "store" : "ring"; }

StallPolicy parse_stall(py::handle h) {
  const std::string s = utf8_arg(h, "stall_policy", Errc::kInvalidArgument);
  if (s == "fail") return StallPolicy::kFail;
  if (s == "evict") return StallPolicy::kEvict;
  throw Error(Errc::kInvalidArgument, "stall_policy must be 'fail' or 'evict', not '" + s + "'");
}

DType parse_dtype(py::handle h) {
  const std::string s = utf8_arg(h, "dtype", Errc::kInvalidArgument);
  DType d;
  if (!dtype_from_name(s, &d)) throw Error(Errc::kInvalidArgument, "unknown shmcast dtype '" + s + "'");
  return d;
}

// A pointer or stream: an int (the hot path: one per tensor) or None (0).
std::uintptr_t as_ptr(py::handle h, const char* what = "pointer") {
  if (h.is_none()) return 0;
  if (PyLong_Check(h.ptr())) {
    const unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
    if (!(v == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return static_cast<std::uintptr_t>(v);
    PyErr_Clear();
  }
  return int_arg<std::uintptr_t>(h, what, 0, std::numeric_limits<std::uintptr_t>::max());
}

// specs: sequence of (name, dtype, shape).
std::vector<TensorSpec> to_specs(py::handle specs) {
  py::sequence seq = py::reinterpret_borrow<py::sequence>(specs);
  std::vector<TensorSpec> out;
  out.reserve(seq.size());
  for (py::handle item : seq) {
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 3 && t.size() != 6)
      throw Error(Errc::kInvalidArgument,
                  "a tensor spec is (name, dtype, shape) or, for a shard, (name, dtype, full shape, dim, start, length)");
    TensorSpec s;
    s.name = utf8_arg(t[0], "tensor name", Errc::kInvalidArgument);
    s.dtype = parse_dtype(t[1]);
    py::sequence shape = py::reinterpret_borrow<py::sequence>(t[2]);
    s.shape.reserve(shape.size());
    for (py::handle d : shape)
      s.shape.push_back(int_arg<std::int64_t>(d, "shape dimension", 0, std::numeric_limits<std::int64_t>::max()));
    if (t.size() == 6) {
      s.shard_dim = int_arg<int>(t[3], "shard dim", 0, kMaxDims - 1);
      s.shard_start = int_arg<std::int64_t>(t[4], "shard start", 0, std::numeric_limits<std::int64_t>::max());
      s.shard_length = int_arg<std::int64_t>(t[5], "shard length", 0, std::numeric_limits<std::int64_t>::max());
    }
    out.push_back(std::move(s));
  }
  return out;
}

// A selection: None (the whole tensor) or (dim, start, length).
Selection to_selection(py::handle item) {
  Selection sel;
  if (!item.is_none()) {
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (t.size() != 3) throw Error(Errc::kInvalidArgument, "a selection is None or (dim, start, length)");
    sel.dim = int_arg<int>(t[0], "selection dim", 0, kMaxDims - 1);
    sel.start = int_arg<std::int64_t>(t[1], "selection start", 0, std::numeric_limits<std::int64_t>::max());
    sel.length = int_arg<std::int64_t>(t[2], "selection length", 0, std::numeric_limits<std::int64_t>::max());
  }
  return sel;
}

// selections: None (whole tensors) or a sequence with None or (dim, start,
// length) per tensor of the sync.
std::vector<Selection> to_selections(py::handle h) {
  std::vector<Selection> out;
  if (h.is_none()) return out;
  py::sequence seq = py::reinterpret_borrow<py::sequence>(h);
  out.reserve(seq.size());
  for (py::handle item : seq) out.push_back(to_selection(item));
  return out;
}

// A tensor of a SyncInfo (name, dtype, shape, nbytes, stream_offset), as far
// as a selection check needs it: its name, shape and nbytes.
TensorInfo to_tensor_info(py::handle h) {
  py::sequence t = py::reinterpret_borrow<py::sequence>(h);
  if (t.size() != 5) throw Error(Errc::kInvalidArgument, "a tensor is (name, dtype, shape, nbytes, stream_offset)");
  TensorInfo ti{};
  ti.name = utf8_arg(t[0], "tensor name", Errc::kInvalidArgument);
  ti.dtype = parse_dtype(t[1]);
  for (py::handle d : py::reinterpret_borrow<py::sequence>(t[2]))
    ti.shape.push_back(int_arg<std::int64_t>(d, "shape dimension", 0, std::numeric_limits<std::int64_t>::max()));
  ti.nbytes = int_arg<std::uint64_t>(t[3], "nbytes", 0, kU64Max);
  ti.stream_offset = int_arg<std::uint64_t>(t[4], "stream_offset", 0, kU64Max);
  return ti;
}

std::vector<void*> to_ptrs(py::handle ptrs) {
  py::sequence seq = py::reinterpret_borrow<py::sequence>(ptrs);
  std::vector<void*> out;
  out.reserve(seq.size());
  for (py::handle p : seq) out.push_back(reinterpret_cast<void*>(as_ptr(p)));
  return out;
}

std::optional<Strided2D> to_layout(py::handle h) {
  if (h.is_none()) return std::nullopt;
  py::sequence t = py::reinterpret_borrow<py::sequence>(h);
  if (t.size() != 3) throw Error(Errc::kInvalidArgument, "a strided layout is (rows, row_bytes, pitch_bytes)");
  return layout_args(t[0], t[1], t[2]);
}

// One source of a batched write, converted while the GIL is held.
struct Source {
  void* ptr = nullptr;
  bool device = false;
  std::optional<Strided2D> layout;
  void* stream = nullptr;
};

// ptrs: ints; devices: None | bool | sequence of bool; layouts: None |
// sequence of (None | (rows, row_bytes, pitch)); streams: int | sequence.
std::vector<Source> to_sources(py::handle ptrs, py::handle devices, py::handle layouts, py::handle streams) {
  py::sequence p = py::reinterpret_borrow<py::sequence>(ptrs);
  const std::size_t n = p.size();
  std::vector<Source> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i].ptr = reinterpret_cast<void*>(as_ptr(p[i]));
  if (!devices.is_none()) {
    if (py::isinstance<py::bool_>(devices)) {
      const bool d = devices.cast<bool>();
      for (auto& s : out) s.device = d;
    } else {
      py::sequence d = py::reinterpret_borrow<py::sequence>(devices);
      if (d.size() != n) throw Error(Errc::kInvalidArgument, "devices has a different length than ptrs");
      for (std::size_t i = 0; i < n; ++i) out[i].device = py::bool_(d[i]);
    }
  }
  if (!layouts.is_none()) {
    py::sequence l = py::reinterpret_borrow<py::sequence>(layouts);
    if (l.size() != n) throw Error(Errc::kInvalidArgument, "layouts has a different length than ptrs");
    for (std::size_t i = 0; i < n; ++i) out[i].layout = to_layout(l[i]);
  }
  if (!streams.is_none()) {
    if (PyLong_Check(streams.ptr())) {
      void* s = reinterpret_cast<void*>(as_ptr(streams, "stream"));
      for (auto& src : out) src.stream = s;
    } else {
      py::sequence st = py::reinterpret_borrow<py::sequence>(streams);
      if (st.size() != n) throw Error(Errc::kInvalidArgument, "streams has a different length than ptrs");
      for (std::size_t i = 0; i < n; ++i) out[i].stream = reinterpret_cast<void*>(as_ptr(st[i], "stream"));
    }
  }
  return out;
}

py::tuple shape_tuple(const std::vector<std::int64_t>& shape) {
  py::tuple t(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

// ------------------------------------------------------------------ sync info

// What Consumer.wait_sync returns: a snapshot, converted once.
struct PySync {
  std::uint64_t version = 0, stream_bytes = 0, payload_bytes = 0, first_seq = 0, chunks = 0;
  std::uint32_t world_size = 1;
  py::list tensors;  // (name, dtype, shape, nbytes, stream_offset)
  py::list pieces;   // per tensor: [(rank, dim, start, length, nbytes)], dim -1 = whole

  static PySync from(const SyncInfo& s) {
    PySync p;
    p.version = s.version;
    p.stream_bytes = s.stream_bytes;
    p.payload_bytes = s.payload_bytes;
    p.first_seq = s.first_seq;
    p.chunks = s.chunks;
    p.world_size = s.world_size;
    p.tensors = py::list(s.tensors.size());
    p.pieces = py::list(s.tensors.size());
    for (std::size_t i = 0; i < s.tensors.size(); ++i) {
      const TensorInfo& t = s.tensors[i];
      // Names reach Python only as valid UTF-8 (a producer rejects others;
      // a region written by something else may still hold any bytes).
      PyObject* name = PyUnicode_DecodeUTF8(t.name.data(), static_cast<Py_ssize_t>(t.name.size()), nullptr);
      if (!name) {
        PyErr_Clear();
        throw Error(Errc::kCorrupt, "sync " + std::to_string(s.version) + ": the name of tensor " + std::to_string(i) +
                                        " ('" + text(t.name).cast<std::string>() +
                                        "') is not valid UTF-8; whatever wrote the region is broken");
      }
      p.tensors[i] = py::make_tuple(py::reinterpret_steal<py::str>(name), py::str(std::string(dtype_name(t.dtype))),
                                    shape_tuple(t.shape), py::int_(t.nbytes), py::int_(t.stream_offset));
      py::list ps(t.shards.size());
      for (std::size_t k = 0; k < t.shards.size(); ++k) {
        const ShardInfo& sh = t.shards[k];
        ps[k] = py::make_tuple(sh.rank, sh.dim, sh.start, sh.length, sh.nbytes);
      }
      p.pieces[i] = ps;
    }
    return p;
  }
};

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

// ------------------------------------------------------------------ producer

class PyProducer : Owned {
  // (First: the methods below deduce their return types from it.)
  // Runs f(producer) with the GIL released and this object locked.
  template <class F>
  decltype(auto) locked(F&& f) {
    check_owner("Producer");
    py::gil_scoped_release nogil;
    std::lock_guard lk(mu_);
    return f(get());
  }

  Producer& get() {
    if (closed_) throw Error(Errc::kClosed, "this producer is closed");
    return *p_;
  }

 public:
  PyProducer(py::handle name, py::handle slot_bytes, py::handle slots, py::handle max_consumers,
             py::handle manifest_bytes, bool group_access, bool replace_stale, bool unlink_on_close, bool checksums,
             py::handle stall_policy, py::handle consumer_timeout, py::handle pin, py::handle engine, py::handle rank,
             py::handle world_size, py::handle rank_timeout, py::handle mode, py::handle store_bytes) {
    const std::string n = region_name_arg(name);
    ProducerOptions o;
    o.mode = parse_mode(mode);
    o.store_bytes = int_arg<std::uint64_t>(store_bytes, "store_bytes", 0, limits::kMaxSlotBytes);
    o.world_size = int_arg<std::uint32_t>(world_size, "world_size", 1, limits::kMaxRanks);
    o.rank = int_arg<std::uint32_t>(rank, "rank", 0, o.world_size - 1);
    o.rank_timeout = seconds_arg(rank_timeout, "rank_timeout", false);
    o.slot_bytes = int_arg<std::uint64_t>(slot_bytes, "slot_bytes", 1, limits::kMaxSlotBytes);
    o.slots = int_arg<std::uint32_t>(slots, "slots", 2, limits::kMaxSlots);
    o.max_consumers = int_arg<std::uint32_t>(max_consumers, "max_consumers", 1, limits::kMaxConsumers);
    o.manifest_bytes =
        int_arg<std::uint64_t>(manifest_bytes, "manifest_bytes", limits::kMinManifestBytes, limits::kMaxManifestBytes);
    o.group_access = group_access;
    o.replace_stale = replace_stale;
    o.unlink_on_close = unlink_on_close;
    o.checksums = checksums;
    o.stall_policy = parse_stall(stall_policy);
    o.consumer_timeout = seconds_arg(consumer_timeout, "consumer_timeout", false);
    o.pin = parse_pin(pin);
    o.engine = parse_engine(engine);
    py::gil_scoped_release nogil;  // fallocate + cudaHostRegister can take a while
    p_ = std::make_unique<Producer>(Producer::create(n, o));
  }

  // What every other call raises first: InvalidArgument in a forked child,
  // Closed once closed.
  void check() {
    check_owner("Producer");
    (void)get();
  }

  ~PyProducer() {
    if (forked()) (void)p_.release();  // the parent's producer: leave it be (the child's exit frees the memory)
  }

  std::uint64_t begin_sync(py::handle specs, py::handle version) {
    const std::uint64_t v = int_arg<std::uint64_t>(version, "version", 0, kU64Max);
    std::vector<TensorSpec> s = to_specs(specs);
    return locked([&](Producer&) { return begin_locked(std::move(s), v); });
  }

  // Sharded producers: takes this rank's next round and fails it on every
  // rank (the caller could not begin the sync), so the ranks stay in step.
  void skip_sync(py::handle why, py::handle version) {
    const std::string w = message_arg(why);
    const std::uint64_t v = int_arg<std::uint64_t>(version, "version", 0, kU64Max);
    locked([&](Producer& p) { p.skip_sync(w, v); });
  }

  void write(py::handle i, py::handle ptr, py::handle nbytes) {
    const std::size_t index = index_arg(i);
    void* p = reinterpret_cast<void*>(as_ptr(ptr));
    std::optional<std::uint64_t> n;
    if (!nbytes.is_none()) n = int_arg<std::uint64_t>(nbytes, "nbytes", 0, kU64Max);
    locked([&](Producer& pr) {
      check_nbytes(index, n);
      pr.write(index, p);
    });
  }

  void write_strided(py::handle i, py::handle ptr, py::handle rows, py::handle row_bytes, py::handle pitch_bytes) {
    const std::size_t index = index_arg(i);
    void* p = reinterpret_cast<void*>(as_ptr(ptr));
    const Strided2D l = layout_args(rows, row_bytes, pitch_bytes);
    locked([&](Producer& pr) { pr.write_strided(index, p, l); });
  }

  void write_device(py::handle i, py::handle ptr, py::handle stream) {
    const std::size_t index = index_arg(i);
    void* p = reinterpret_cast<void*>(as_ptr(ptr));
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    locked([&](Producer& pr) { pr.write_device(index, p, s); });
  }

  void write_device_strided(py::handle i, py::handle ptr, py::handle rows, py::handle row_bytes,
                            py::handle pitch_bytes, py::handle stream) {
    const std::size_t index = index_arg(i);
    void* p = reinterpret_cast<void*>(as_ptr(ptr));
    const Strided2D l = layout_args(rows, row_bytes, pitch_bytes);
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    locked([&](Producer& pr) { pr.write_device_strided(index, p, l, s); });
  }

  // Writes tensors first, first+1, ... from one batch of sources.
  void write_batch(py::handle first, py::handle ptrs, py::handle devices, py::handle layouts, py::handle streams) {
    const std::size_t f = index_arg(first, "first");
    std::vector<Source> srcs = to_sources(ptrs, devices, layouts, streams);
    locked([&](Producer&) { write_locked(f, srcs); });
  }

  void end_sync() {
    locked([](Producer& p) { p.end_sync(); });
  }

  void abort_sync(py::handle why) {
    const std::string w = message_arg(why);
    locked([&](Producer& p) { p.abort_sync(w); });
  }

  // begin_sync + every write + end_sync in one call; aborts the sync (and
  // rethrows) when a write fails.
  std::uint64_t send_batch(py::handle specs, py::handle ptrs, py::handle devices, py::handle layouts,
                           py::handle streams, py::handle version) {
    const std::uint64_t ver = int_arg<std::uint64_t>(version, "version", 0, kU64Max);
    std::vector<TensorSpec> s = to_specs(specs);
    std::vector<Source> srcs = to_sources(ptrs, devices, layouts, streams);
    if (srcs.size() != s.size())
      throw Error(Errc::kInvalidArgument, "send_batch(): " + std::to_string(s.size()) + " specs but " +
                                              std::to_string(srcs.size()) + " sources");
    return locked([&](Producer& p) {
      const std::uint64_t v = begin_locked(std::move(s), ver);
      try {
        write_locked(0, srcs);
        p.end_sync();
      } catch (const Error& e) {
        try {
          p.abort_sync(e.what());
        } catch (...) {
        }
        throw;
      }
      return v;
    });
  }

  void wait_for_consumers(py::handle n_arg, py::handle timeout) {
    const std::uint32_t n = int_arg<std::uint32_t>(n_arg, "n", 0, limits::kMaxConsumers);
    const auto deadline = Clock::now() + seconds_arg(timeout, "timeout", true);
    // In slices, so Ctrl-C works during a long wait.
    for (;;) {
      const bool done = locked([&](Producer& p) {
        const auto left = deadline - Clock::now();
        const Duration slice = std::min<Duration>(std::chrono::duration_cast<Duration>(left), kSlice);
        try {
          p.wait_for_consumers(n, slice < Duration::zero() ? Duration::zero() : slice);
          return true;
        } catch (const Error& e) {
          if (e.code() != Errc::kTimeout || Clock::now() >= deadline) throw;
        }
        return false;
      });
      if (done) return;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  std::uint32_t consumers() {
    return locked([](Producer& p) { return p.consumers(); });
  }

  void wait_drained(py::handle timeout) {
    const Duration t = seconds_arg(timeout, "timeout", true);
    locked([&](Producer& p) { p.wait_drained(t); });
  }

  py::list take_events() {
    std::vector<std::string> ev = locked([](Producer& p) { return p.take_events(); });
    py::list out;
    for (const std::string& e : ev) out.append(text(e));
    return out;
  }

  void close() {
    if (forked()) return;  // the parent's region: not the child's to close
    py::gil_scoped_release nogil;
    std::lock_guard lk(mu_);
    if (p_) p_->close();
    closed_ = true;
  }

  bool closed() const { return closed_; }
  std::string name() const { return p_->name(); }
  py::str path() const { return text(p_->path(), "surrogateescape"); }
  std::uint64_t region_bytes() const { return p_->region_bytes(); }
  std::uint64_t slot_bytes() const { return p_->slot_bytes(); }
  std::uint32_t slots() const { return p_->slots(); }
  std::uint64_t last_version() const { return p_->last_version(); }
  std::uint64_t last_round() const { return p_->last_round(); }
  bool pinned() const { return p_->pinned(); }
  std::string engine() const { return p_->engine() == CopyEngine::kCuda ? "cuda" : "host"; }
  std::string mode() const { return mode_name(p_->mode()); }
  double pin_seconds() const { return p_->pin_seconds(); }
  double create_seconds() const { return p_->create_seconds(); }
  SyncLayout last_sync() {
    check();
    return get().last_layout();
  }

 private:
  static constexpr Duration kSlice = std::chrono::milliseconds(200);

  void check_nbytes(std::size_t i, const std::optional<std::uint64_t>& nbytes) const {
    if (!nbytes || i >= nbytes_.size()) return;  // the library reports a bad index
    if (*nbytes != nbytes_[i])
      throw Error(Errc::kInvalidArgument, "write(" + std::to_string(i) + "): the source has " + std::to_string(*nbytes) +
                                              " bytes but the spec says " + std::to_string(nbytes_[i]));
  }

  std::uint64_t begin_locked(std::vector<TensorSpec> specs, std::uint64_t version = 0) {
    Producer& p = get();
    const std::uint64_t v = p.begin_sync(specs, version);
    nbytes_.resize(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) nbytes_[i] = specs[i].local_nbytes();
    return v;
  }

  void write_locked(std::size_t first, const std::vector<Source>& srcs) {
    Producer& p = get();
    for (std::size_t k = 0; k < srcs.size(); ++k) {
      const Source& s = srcs[k];
      const std::size_t i = first + k;
      if (s.device) {
        if (s.layout)
          p.write_device_strided(i, s.ptr, *s.layout, s.stream);
        else
          p.write_device(i, s.ptr, s.stream);
      } else {
        if (s.layout)
          p.write_strided(i, s.ptr, *s.layout);
        else
          p.write(i, s.ptr);
      }
    }
  }

  std::unique_ptr<Producer> p_;
  std::mutex mu_;
  bool closed_ = false;
  std::vector<std::uint64_t> nbytes_;
};

// ------------------------------------------------------------------ consumer

class PyConsumer : Owned {
  // (First: the methods below deduce their return types from it.)
  // Runs f(consumer) with the GIL released and this object locked.
  template <class F>
  decltype(auto) locked(F&& f) {
    check_owner("Consumer");
    py::gil_scoped_release nogil;
    std::lock_guard lk(mu_);
    return f(get());
  }

  Consumer& get() {
    if (closed_) throw Error(Errc::kClosed, "this consumer is closed");
    return *c_;
  }

 public:
  PyConsumer(py::handle name, py::handle open_timeout, py::handle chunk_timeout, py::handle pin,
             bool verify_checksums, bool group_access, py::handle trusted_uids) {
    const std::string n = region_name_arg(name);
    ConsumerOptions o;
    o.group_access = group_access;
    if (!trusted_uids.is_none())
      for (py::handle u : py::iterable(py::reinterpret_borrow<py::object>(trusted_uids)))
        o.trusted_uids.push_back(int_arg<std::uint32_t>(u, "trusted_uids", 0, 0xfffffffeu));
    o.open_timeout = seconds_arg(open_timeout, "open_timeout", false);
    o.chunk_timeout = seconds_arg(chunk_timeout, "chunk_timeout", false);
    o.pin = parse_pin(pin);
    o.verify_checksums = verify_checksums;
    py::gil_scoped_release nogil;
    c_ = std::make_unique<Consumer>(Consumer::open(n, o));
  }

  // What every other call raises first: InvalidArgument in a forked child,
  // Closed once closed.
  void check() {
    check_owner("Consumer");
    (void)get();
  }

  ~PyConsumer() {
    if (forked()) (void)c_.release();  // the parent's seat: leave it be
  }

  PySync wait_sync(py::handle timeout) {
    const auto deadline = Clock::now() + seconds_arg(timeout, "timeout", true);
    for (;;) {
      std::optional<SyncInfo> got = locked([&](Consumer& c) -> std::optional<SyncInfo> {
        const auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
        const Duration slice = std::max(Duration::zero(), std::min<Duration>(left, kSlice));
        try {
          return c.wait_sync(slice);  // copy: the snapshot is converted with the GIL held
        } catch (const Error& e) {
          if (e.code() != Errc::kTimeout || Clock::now() >= deadline) throw;
        }
        return std::nullopt;
      });
      if (got) {
        try {
          last_ = PySync::from(*got);
        } catch (const Error&) {  // a name Python cannot hold: the sync is skipped, not left half-taken
          try {
            locked([](Consumer& c) { c.skip(); });
          } catch (const Error&) {
          }
          throw;
        }
        return last_;
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  void read_into(py::handle ptrs, py::handle selections) {
    std::vector<void*> d = to_ptrs(ptrs);
    std::vector<Selection> sel = to_selections(selections);
    locked([&](Consumer& c) { c.read_into(d, sel); });
  }

  void read_into_device(py::handle ptrs, py::handle stream, py::handle selections) {
    std::vector<void*> d = to_ptrs(ptrs);
    std::vector<Selection> sel = to_selections(selections);
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    locked([&](Consumer& c) { c.read_into_device(d, s, sel); });
  }

  std::vector<std::uintptr_t> read_to_staging(py::handle device, py::handle stream) {
    const int dev = int_arg<int>(device, "device", 0, std::numeric_limits<int>::max());
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    std::vector<void*> out = locked([&](Consumer& c) { return c.read_to_staging(dev, s); });
    std::vector<std::uintptr_t> r(out.size());
    for (std::size_t i = 0; i < out.size(); ++i) r[i] = reinterpret_cast<std::uintptr_t>(out[i]);
    return r;
  }

  // fn(tensor_index, offset, data_ptr, nbytes, tensor_nbytes) for every piece,
  // while its slot is held: data_ptr is valid only during the call.
  void visit(const py::function& fn) {
    locked([&](Consumer& c) {
      c.visit([&](const Piece& p) {
        py::gil_scoped_acquire gil;
        fn(p.tensor, p.offset, reinterpret_cast<std::uintptr_t>(p.data), p.bytes, p.tensor_bytes);
      });
    });
  }

  void skip() {
    locked([](Consumer& c) { c.skip(); });
  }

  // Store regions: the held version's tensors in the region (0 for an empty one).
  std::vector<std::uintptr_t> views() {
    std::vector<const std::byte*> v = locked([](Consumer& c) { return c.views(); });
    std::vector<std::uintptr_t> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = reinterpret_cast<std::uintptr_t>(v[i]);
    return r;
  }
  bool views_valid() {
    return locked([](Consumer& c) { return c.views_valid(); });
  }
  bool views_read_only() {
    return locked([](Consumer& c) { return c.views_read_only(); });
  }
  std::string mode() const { return mode_name(c_->mode()); }

  void close() {
    if (forked()) return;  // the parent's seat: not the child's to free
    py::gil_scoped_release nogil;
    std::lock_guard lk(mu_);
    if (c_) c_->close();
    closed_ = true;
  }

  bool closed() const { return closed_; }
  const PySync& sync() const { return last_; }
  std::uint64_t last_version() const { return c_->last_version(); }
  int seat() const { return closed_ ? -1 : c_->seat(); }
  std::string name() const { return c_->name(); }
  bool pinned() const { return c_->pinned(); }
  double pin_seconds() const { return c_->pin_seconds(); }
  double open_seconds() const { return c_->open_seconds(); }

 private:
  static constexpr Duration kSlice = std::chrono::milliseconds(200);

  std::unique_ptr<Consumer> c_;
  std::mutex mu_;
  bool closed_ = false;
  PySync last_;
};

}  // namespace

PYBIND11_MODULE(_shmcast, m) {
  m.doc() = "shmcast: move tensors between processes through a named, pinned POSIX shared-memory region "
            "(low-level binding; see the shmcast package for the torch API)";
  m.attr("version_major") = kVersionMajor;
  m.attr("version_minor") = kVersionMinor;
  register_exceptions(m);
  py::dict limits;  // the library's limits on a region's geometry (docs/protocol.md)
  limits["max_consumers"] = limits::kMaxConsumers;
  limits["min_slots"] = 2;
  limits["max_slots"] = limits::kMaxSlots;
  limits["max_slot_bytes"] = limits::kMaxSlotBytes;
  limits["min_manifest_bytes"] = limits::kMinManifestBytes;
  limits["max_manifest_bytes"] = limits::kMaxManifestBytes;
  m.attr("limits") = limits;

  m.def("region_dir", [] { return text(region_dir(), "surrogateescape"); },
        "Region directory: $SHMCAST_DIR if set, else /dev/shm.");
  m.def("region_path", [](py::handle n) { return text(region_path(region_name_arg(n)), "surrogateescape"); },
        py::arg("name"));
  m.def(
      "validate_name",
      [](py::handle n) {
        try {
          return text(validate_name(region_name_arg(n)));
        } catch (const Error& e) {  // a str with no UTF-8 form
          return text(strip_prefix(e));
        }
      },
      py::arg("name"),
        "Empty string when the region name is valid, else the reason.");
  m.def("unlink_region", [](py::handle n) { return unlink_region(region_name_arg(n)); }, py::arg("name"),
        "Removes the region's name; False when there was nothing to remove.");
  m.def(
      "check_int",
      [](py::handle value, const std::string& name, std::int64_t lo, std::int64_t hi) {
        return int_arg<std::int64_t>(value, name.c_str(), lo, hi);
      },
      py::arg("value"), py::arg("name"), py::arg("lo"), py::arg("hi"),
      "`value` as an int when it is one in lo..hi; else InvalidArgument naming `name` and the range (TypeError for a "
      "non-integer). The check every numeric argument of the binding gets.");
  m.def("cuda_available", &cuda_available, "True when built with CUDA and a device is usable.");
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason);
  m.def("dtype_size", [](py::handle n) { return dtype_size(parse_dtype(n)); }, py::arg("dtype"));
  m.def("dtype_names", [] {
    std::vector<std::string> out;
    for (int i = 1; i <= 255; ++i) {
      const std::string_view n = dtype_name(static_cast<DType>(i));
      if (n != "unknown") out.emplace_back(n);
    }
    return out;
  });
  py::dict dtypes;  // shmcast dtype name -> bytes per element (the library's table)
  for (int i = 1; i <= 255; ++i) {
    const std::string_view n = dtype_name(static_cast<DType>(i));
    if (n != "unknown") dtypes[py::str(std::string(n))] = dtype_size(static_cast<DType>(i));
  }
  m.attr("dtypes") = dtypes;
  m.attr("tensor_align") = limits::kTensorAlign;
  m.attr("data_align") = limits::kDataAlign;
  m.def(
      "selection_problem",
      [](py::handle tensor, py::handle selection) {
        return text(to_selection(selection).problem(to_tensor_info(tensor)));
      },
      py::arg("tensor"), py::arg("selection"),
      "Why `selection` (None, or (dim, start, length) with dim >= 0) cannot be read from `tensor` (an entry of "
      "SyncInfo.tensors), or '' when it can: the check read_into() makes (shmcast::Selection::problem).");
  m.def(
      "selection_bytes",
      [](py::handle tensor, py::handle selection) {
        return to_selection(selection).nbytes(to_tensor_info(tensor));
      },
      py::arg("tensor"), py::arg("selection"),
      "Bytes of the destination of `selection` of `tensor` (shmcast::Selection::nbytes); InvalidArgument when "
      "it does not fit.");
  m.def(
      "stream_layout",
      [](py::handle specs, py::handle slot_bytes_arg) {
        std::vector<TensorSpec> s = to_specs(specs);
        const std::uint64_t slot_bytes = int_arg<std::uint64_t>(slot_bytes_arg, "slot_bytes", 1, limits::kMaxSlotBytes);
        const SyncLayout l = shmcast::stream_layout(s, slot_bytes);
        return py::make_tuple(l.stream_bytes, l.payload_bytes, l.chunks, l.offsets);
      },
      py::arg("specs"), py::arg("slot_bytes"),
      "(stream_bytes, payload_bytes, chunks, offsets) of a sync of `specs` in slots of slot_bytes "
      "(use Producer.slot_bytes: the library rounds slot sizes up to 2 MiB).");
  m.def(
      "store_bytes_needed",
      [](py::handle specs) {
        std::vector<TensorSpec> s = to_specs(specs);
        return shmcast::store_bytes_needed(s);
      },
      py::arg("specs"), "store_bytes a store region (mode='store') needs for a sync of `specs`.");

  py::class_<PySync>(m, "SyncInfo", "A received sync's manifest (a snapshot).")
      .def_readonly("version", &PySync::version)
      .def_readonly("stream_bytes", &PySync::stream_bytes)
      .def_readonly("payload_bytes", &PySync::payload_bytes)
      .def_readonly("first_seq", &PySync::first_seq)
      .def_readonly("chunks", &PySync::chunks)
      .def_readonly("tensors", &PySync::tensors, "list of (name, dtype, shape, nbytes, stream_offset)")
      .def_readonly("world_size", &PySync::world_size, "producer ranks that wrote the sync")
      .def_readonly("pieces", &PySync::pieces,
                    "per tensor, its pieces: [(rank, dim, start, length, nbytes)] (dim -1: the whole tensor)")
      .def("__len__", [](const PySync& s) { return s.tensors.size(); })
      .def("__repr__", [](const PySync& s) {
        return "<shmcast.SyncInfo version=" + std::to_string(s.version) + " tensors=" +
               std::to_string(s.tensors.size()) + " payload_bytes=" + std::to_string(s.payload_bytes) + ">";
      });

  py::class_<SyncLayout>(m, "SentSync", "Layout of the last sync a producer began (shmcast::SyncLayout).")
      .def_readonly("version", &SyncLayout::version)
      .def_readonly("first_seq", &SyncLayout::first_seq)
      .def_readonly("chunks", &SyncLayout::chunks)
      .def_readonly("stream_bytes", &SyncLayout::stream_bytes)
      .def_readonly("payload_bytes", &SyncLayout::payload_bytes)
      .def_property_readonly("tensors", [](const SyncLayout& l) { return l.offsets.size(); })
      .def_readonly("offsets", &SyncLayout::offsets)
      .def_readonly("rank", &SyncLayout::rank)
      .def_readonly("world_size", &SyncLayout::world_size)
      .def_readonly("rank_chunks", &SyncLayout::rank_chunks);

  py::class_<PyProducer>(m, "Producer", "Low-level producer (shmcast::Producer). Pointers are ints.")
      .def(py::init<py::handle, py::handle, py::handle, py::handle, py::handle, bool, bool, bool, bool, py::handle,
                    py::handle, py::handle, py::handle, py::handle, py::handle, py::handle, py::handle,
                    py::handle>(),
           py::arg("name"), py::kw_only(), py::arg("slot_bytes") = 256ull << 20, py::arg("slots") = 2,
           py::arg("max_consumers") = 8, py::arg("manifest_bytes") = 1ull << 20, py::arg("group_access") = false,
           py::arg("replace_stale") = true, py::arg("unlink_on_close") = true, py::arg("checksums") = false,
           py::arg("stall_policy") = "fail", py::arg("consumer_timeout") = 60.0, py::arg("pin") = "auto",
           py::arg("engine") = "auto", py::arg("rank") = 0, py::arg("world_size") = 1, py::arg("rank_timeout") = 120.0,
           py::arg("mode") = "ring", py::arg("store_bytes") = 0)
      .def("begin_sync", &PyProducer::begin_sync, py::arg("specs"), py::arg("version") = 0,
           "specs: sequence of (name, dtype, shape), or (name, dtype, full shape, dim, start, length) for a shard "
           "(sharded producers). version: 0 (the next), or the sync's version (greater than the last; sharded "
           "producers: the same on every rank). Returns the sync's version.")
      .def("skip_sync", &PyProducer::skip_sync, py::arg("why"), py::arg("version") = 0,
           "Sharded producers: takes this rank's next sync round and fails it on every rank with `why` (the caller "
           "could not begin it), so the ranks stay in step. One rank: does nothing.")
      .def("write", &PyProducer::write, py::arg("index"), py::arg("ptr"), py::arg("nbytes") = py::none())
      .def("write_strided", &PyProducer::write_strided, py::arg("index"), py::arg("ptr"), py::arg("rows"),
           py::arg("row_bytes"), py::arg("pitch_bytes"))
      .def("write_device", &PyProducer::write_device, py::arg("index"), py::arg("ptr"), py::arg("stream") = 0)
      .def("write_device_strided", &PyProducer::write_device_strided, py::arg("index"), py::arg("ptr"),
           py::arg("rows"), py::arg("row_bytes"), py::arg("pitch_bytes"), py::arg("stream") = 0)
      .def("write_batch", &PyProducer::write_batch, py::arg("first"), py::arg("ptrs"),
           py::arg("devices") = py::none(), py::arg("layouts") = py::none(), py::arg("streams") = py::none(),
           "Writes tensors first, first+1, ... in one call. devices: bool or per-tensor bools; layouts: per-tensor "
           "None or (rows, row_bytes, pitch_bytes); streams: int or per-tensor ints (cudaStream_t).")
      .def("end_sync", &PyProducer::end_sync)
      .def("abort_sync", &PyProducer::abort_sync, py::arg("why"))
      .def("send_batch", &PyProducer::send_batch, py::arg("specs"), py::arg("ptrs"), py::arg("devices") = py::none(),
           py::arg("layouts") = py::none(), py::arg("streams") = py::none(), py::arg("version") = 0,
           "begin_sync + write_batch + end_sync in one call (the sync is aborted if a write fails).")
      .def("wait_for_consumers", &PyProducer::wait_for_consumers, py::arg("n"), py::arg("timeout") = 30.0)
      .def_property_readonly("consumers", &PyProducer::consumers)
      .def("wait_drained", &PyProducer::wait_drained, py::arg("timeout") = 60.0)
      .def("take_events", &PyProducer::take_events)
      .def("close", &PyProducer::close, "Idempotent; does nothing in a forked child (the object is the parent's).")
      .def("check", &PyProducer::check, "Raises Closed once closed, InvalidArgument in a forked child.")
      .def_property_readonly("closed", &PyProducer::closed)
      .def_property_readonly("name", &PyProducer::name)
      .def_property_readonly("path", &PyProducer::path)
      .def_property_readonly("region_bytes", &PyProducer::region_bytes)
      .def_property_readonly("slot_bytes", &PyProducer::slot_bytes)
      .def_property_readonly("slots", &PyProducer::slots)
      .def_property_readonly("last_version", &PyProducer::last_version)
      .def_property_readonly("last_round", &PyProducer::last_round,
                             "Sharded producers: the last sync round this rank took (begun, failed or skipped)")
      .def_property_readonly("last_sync", &PyProducer::last_sync, py::return_value_policy::copy)
      .def_property_readonly("pinned", &PyProducer::pinned)
      .def_property_readonly("engine", &PyProducer::engine, "'host' or 'cuda': the copy engine chosen at create")
      .def_property_readonly("mode", &PyProducer::mode, "'ring' or 'store'")
      .def_property_readonly("pin_seconds", &PyProducer::pin_seconds)
      .def_property_readonly("create_seconds", &PyProducer::create_seconds);

  py::class_<PyConsumer>(m, "Consumer", "Low-level consumer (shmcast::Consumer). Pointers are ints.")
      .def(py::init<py::handle, py::handle, py::handle, py::handle, bool, bool, py::handle>(), py::arg("name"),
           py::kw_only(), py::arg("open_timeout") = 30.0, py::arg("chunk_timeout") = 60.0, py::arg("pin") = "auto",
           py::arg("verify_checksums") = true, py::arg("group_access") = false, py::arg("trusted_uids") = py::none())
      .def("wait_sync", &PyConsumer::wait_sync, py::arg("timeout") = 30.0,
           "Waits for the next sync (timeout in seconds, None = forever) and returns its SyncInfo.")
      .def("read_into", &PyConsumer::read_into, py::arg("ptrs"), py::arg("selections") = py::none(),
           "Host copy: ptrs[i] receives tensor i (None or 0 skips it); selections: None, or per tensor None or "
           "(dim, start, length): ptrs[i] then receives that slice, contiguous.")
      .def("read_into_device", &PyConsumer::read_into_device, py::arg("ptrs"), py::arg("stream") = 0,
           py::arg("selections") = py::none())
      .def("read_to_staging", &PyConsumer::read_to_staging, py::arg("device"), py::arg("stream") = 0,
           "Copies the sync into a library-owned device buffer; returns one device pointer per tensor, valid "
           "until the next wait_sync().")
      .def("visit", &PyConsumer::visit, py::arg("fn"))
      .def("skip", &PyConsumer::skip)
      .def("views", &PyConsumer::views,
           "Store regions: pointers (ints) to each tensor of the version wait_sync() returned, in the region; "
           "held until skip(), the next wait_sync() or close().")
      .def("views_valid", &PyConsumer::views_valid, "True while the viewed version is held and unchanged.")
      .def_property_readonly("views_read_only", &PyConsumer::views_read_only,
                             "Store regions: True when this process maps the stored versions read-only (a write "
                             "through a view faults); False where a GPU driver needed them pinned writable, and "
                             "for ring regions.")
      .def_property_readonly("mode", &PyConsumer::mode, "'ring' or 'store' (the region's)")
      .def("close", &PyConsumer::close, "Idempotent; does nothing in a forked child (the object is the parent's).")
      .def("check", &PyConsumer::check, "Raises Closed once closed, InvalidArgument in a forked child.")
      .def_property_readonly("closed", &PyConsumer::closed)
      .def_property_readonly("sync", &PyConsumer::sync, py::return_value_policy::copy)
      .def_property_readonly("last_version", &PyConsumer::last_version)
      .def_property_readonly("seat", &PyConsumer::seat)
      .def_property_readonly("name", &PyConsumer::name)
      .def_property_readonly("pinned", &PyConsumer::pinned)
      .def_property_readonly("pin_seconds", &PyConsumer::pin_seconds)
      .def_property_readonly("open_seconds", &PyConsumer::open_seconds);
}
