// shmcast._shmcast: Python arguments -> C++ values. Each is checked here,
// with the GIL held: a bad one is InvalidArgument naming it and its range, or
// a TypeError naming it (binding.hpp).
#include "binding.hpp"

namespace shmcast::python {

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

double ratio_arg(py::handle h, const char* what) {
  PyObject* o = h.ptr();
  if (!(PyFloat_Check(o) || PyLong_Check(o) || PyIndex_Check(o)))
    throw py::type_error(std::string(what) + " must be a number, not " + Py_TYPE(o)->tp_name);
  const double r = PyFloat_AsDouble(o);
  if (r == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
    PyErr_Clear();  // an int beyond a double: out of range either way
  } else if (r > 0.0 && r <= 1.0) {  // false for NaN
    return r;
  }
  throw Error(Errc::kInvalidArgument, std::string(what) + " is " + ascii_repr(h) + "; it must be a number in (0, 1]");
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

std::size_t index_arg(py::handle h, const char* what) {
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

SlotMemory parse_slot_memory(py::handle h) {
  const std::string s = utf8_arg(h, "slot_memory", Errc::kInvalidArgument);
  if (s == "host") return SlotMemory::kHost;
  if (s == "device") return SlotMemory::kDevice;
  throw Error(Errc::kInvalidArgument, "slot_memory must be 'host' or 'device', not '" + s + "'");
}

const char* slot_memory_name(SlotMemory m) { return m == SlotMemory::kDevice ? "device" : "host"; }

QuantizeFilter quantize_filter_arg(py::handle f) {
  if (!PyCallable_Check(f.ptr())) throw Error(Errc::kInvalidArgument, "quantize_filter must be callable or None");
  // The callable is released with the GIL held, whichever thread drops the
  // producer's options last.
  std::shared_ptr<py::object> fn(new py::object(py::reinterpret_borrow<py::object>(f)), [](py::object* o) {
    if (!Py_IsInitialized()) return;  // at exit: leak it rather than touch a finalized interpreter
    py::gil_scoped_acquire gil;
    delete o;
  });
  return [fn](const TensorSpec& t) {
    py::gil_scoped_acquire gil;
    const py::object r = (*fn)(text(t.name, "surrogateescape"), shape_tuple(t.shape), py::str(std::string(dtype_name(t.dtype))));
    const int truth = PyObject_IsTrue(r.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth == 1;
  };
}

int device_arg(py::handle h, const char* what) {
  if (h.is_none()) return -1;
  return int_arg<int>(h, what, -1, std::numeric_limits<int>::max());
}

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
std::uintptr_t as_ptr(py::handle h, const char* what) {
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

py::dict sync_report(const SyncReport& r) {
  py::dict d;
  d["version"] = r.version;
  if (r.version == 0)
    d["kind"] = py::none();  // no sync yet
  else
    d["kind"] = r.delta ? "delta" : "full";
  d["logical_bytes"] = r.logical_bytes;
  d["payload_bytes"] = r.payload_bytes;
  return d;
}

py::tuple shape_tuple(const std::vector<std::int64_t>& shape) {
  py::tuple t(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t[i] = py::int_(shape[i]);
  return t;
}

}  // namespace shmcast::python
