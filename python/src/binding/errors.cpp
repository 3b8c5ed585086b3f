// shmcast._shmcast: shmcast::Error becomes shmcast.Error, or its subclass for
// the error's code (one per Errc), with .code and .sys_errno.
#include "binding.hpp"

namespace shmcast::python {

// ------------------------------------------------------------------ text

// A Python str from bytes that need not be UTF-8: error texts come from the
// region (another process wrote them, and the library cuts them at 255
// bytes, possibly inside a character), so decoding must never raise.
// errors: "backslashreplace" for messages, "surrogateescape" for paths
// (what os.fsdecode does).
py::str text(std::string_view s, const char* errors) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), errors);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// ------------------------------------------------------------------ errors

namespace {

constexpr int kMaxErrc = static_cast<int>(Errc::kNeedsFullSync);
std::array<PyObject*, kMaxErrc + 1> g_exc_by_code{};  // index: Errc value
PyObject* g_exc_base = nullptr;

}  // namespace

std::string strip_prefix(const Error& e) {
  std::string what = e.what();
  const std::string prefix = std::string("shmcast ") + errc_name(e.code()) + ": ";
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  return what;
}

namespace {

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

}  // namespace

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
      {Errc::kNeedsFullSync, "NeedsFullSync", nullptr,
       "A delta sync these destinations cannot take (other buffers, or a version they do not hold); a full sync "
       "was requested: wait for the next sync."},
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

}  // namespace shmcast::python
