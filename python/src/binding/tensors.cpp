// shmcast._shmcast: the batched checks of a sync's torch tensors (issue 43
// item 2), as one C++ loop over the tensors through the CPython API.
//
// send() and receive_into() take a sync of plain tensors (each a
// torch.Tensor or nn.Parameter, strided, contiguous, without a conj or neg
// bit, all on the CPU or all on one GPU) with one call here instead of a
// dozen Python-level passes. The binding stays torch-free: shmcast._batch
// hands over, once (use_torch), the descriptors of the torch.Tensor
// attributes it reads and the dtype table, and this file calls them
// directly (a getset's getter, a method descriptor's vectorcall), the
// calls Python itself makes for t.shape or t.data_ptr(). Whatever is not
// plain gives None, before anything is sent or read, and the Python caller
// takes its per-tensor path, which checks each tensor and words the errors:
// so these functions only ever accept what that path accepts.
#include "binding.hpp"

namespace shmcast::python {

namespace {

// A torch.Tensor attribute, as its descriptor.
struct Attr {
  PyObject* descr = nullptr;  // owned (kept for the life of the process)
  bool method = false;        // called with the tensor (t.name()), else read (t.name)

  // t.attr (getset) or t.attr() (method): a new reference, or throws.
  PyObject* of(PyObject* t) const {
    PyObject* r = method ? PyObject_Vectorcall(descr, &t, 1, nullptr)
                         : Py_TYPE(descr)->tp_descr_get(descr, t, reinterpret_cast<PyObject*>(Py_TYPE(t)));
    if (!r) throw py::error_already_set();
    return r;
  }
  // A bool attribute or method (True/False; anything else is a TypeError).
  bool flag(PyObject* t) const {
    PyObject* r = of(t);
    const int v = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (v < 0) throw py::error_already_set();
    return v == 1;
  }
};

struct TorchApi {
  bool ready = false;
  PyObject* tensor_type = nullptr;  // torch.Tensor
  PyObject* param_type = nullptr;   // torch.nn.Parameter (None when its attributes are not torch.Tensor's)
  PyObject* strided = nullptr;      // torch.strided
  Attr layout, get_device, is_cpu, is_cuda, is_contiguous, is_conj, is_neg, dtype, shape, data_ptr;
  std::vector<std::pair<PyObject*, DType>> to_code;  // torch dtype -> shmcast dtype (the producer's table)
  std::array<PyObject*, 256> from_code{};            // shmcast dtype code -> torch dtype (the consumer's)
  std::vector<PyObject*> complex;                     // the dtypes a conj bit can be set on

  DType code_of(PyObject* dt, std::size_t& hint) const {  // DType{} (0): not carried
    if (hint < to_code.size() && to_code[hint].first == dt) return to_code[hint].second;
    for (std::size_t i = 0; i < to_code.size(); ++i)
      if (to_code[i].first == dt) {
        hint = i;
        return to_code[i].second;
      }
    return DType{};
  }
  bool is_complex(PyObject* dt) const { return std::find(complex.begin(), complex.end(), dt) != complex.end(); }
};

TorchApi& torch_api() {
  static TorchApi api;  // set once, with the GIL held; its objects are never freed
  return api;
}

const TorchApi& api_or_throw() {
  const TorchApi& a = torch_api();
  if (!a.ready)
    throw Error(Errc::kInvalidArgument, "the torch API is not set: import shmcast (its _batch module calls use_torch)");
  return a;
}

// The descriptor of torch.Tensor.`name`, found as t.name finds it: a
// method (called with the tensor: a method descriptor, or a function where
// torch defines it in Python) or an attribute (read through its
// __get__: a getset, or a property).
Attr attr_arg(py::dict attrs, const char* name, bool method) {
  if (!attrs.contains(name)) throw Error(Errc::kInvalidArgument, std::string("use_torch: no descriptor for ") + name);
  py::object d = attrs[name];
  const bool ok = method ? PyCallable_Check(d.ptr()) != 0 : Py_TYPE(d.ptr())->tp_descr_get != nullptr;
  if (!ok)
    throw Error(Errc::kInvalidArgument, std::string("use_torch: torch.Tensor.") + name + " is not " +
                                            (method ? "callable" : "a descriptor"));
  Attr a;
  a.descr = d.release().ptr();
  a.method = method;
  return a;
}

// One tensor of a sync, if plain: dtype (new reference), shape (a new
// reference to its torch.Size) and data pointer. `dev` is the device of the
// first tensor (set by it: -2 before), which every other must share. False:
// not plain (the caller's per-tensor path decides).
struct Seen {
  py::object dtype, shape;
  void* ptr = nullptr;
};

bool plain_tensor(const TorchApi& a, PyObject* t, int& dev, bool batch_cuda, Seen& out) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(t));
  if (type != a.tensor_type && type != a.param_type) return false;  // a subclass, a DTensor, not a tensor
  {
    PyObject* l = a.layout.of(t);
    const bool strided = l == a.strided;
    Py_DECREF(l);
    if (!strided) return false;
  }
  {
    PyObject* d = a.get_device.of(t);
    const long v = PyLong_AsLong(d);
    Py_DECREF(d);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (dev == -2) {
      if (v >= 0 && !batch_cuda) return false;  // CUDA tensors keep the per-tensor path (_batch.BATCH_CUDA)
      if (v > std::numeric_limits<int>::max()) return false;
      dev = static_cast<int>(v);
    } else if (v != dev) {
      return false;  // another device
    }
  }
  if (!(dev < 0 ? a.is_cpu : a.is_cuda).flag(t)) return false;  // another kind of device (meta, ...)
  if (!a.is_contiguous.flag(t) || a.is_neg.flag(t)) return false;
  out.dtype = py::reinterpret_steal<py::object>(a.dtype.of(t));
  // The conj bit is set on complex tensors only (conj() of a real tensor is
  // the tensor); a real tensor's bytes are its values either way.
  if (a.is_complex(out.dtype.ptr()) && a.is_conj.flag(t)) return false;
  out.shape = py::reinterpret_steal<py::object>(a.shape.of(t));
  if (!PyTuple_Check(out.shape.ptr())) return false;
  PyObject* p = a.data_ptr.of(t);
  out.ptr = PyLong_AsVoidPtr(p);
  Py_DECREF(p);
  if (!out.ptr && PyErr_Occurred()) throw py::error_already_set();
  return true;
}

// What plain_sources / plain_destinations found: the sync's tensors, ready.
struct PyPlain {
  int device = -1;                // -1: every tensor on the CPU; else the CUDA device of all
  std::vector<TensorSpec> specs;  // plain_sources: the sync to begin
  std::vector<void*> ptrs;        // each tensor's data (plain_destinations: nullptr for an empty one)
};

py::object plain_sources(py::handle names_arg, py::handle tensors_arg, bool batch_cuda) {
  const TorchApi& a = api_or_throw();
  PyObject* names = names_arg.ptr();
  PyObject* tensors = tensors_arg.ptr();
  if (!PyList_Check(names) || !PyList_Check(tensors)) throw py::type_error("plain_sources: names and tensors are lists");
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (n == 0 || PyList_GET_SIZE(names) != n) return py::none();
  GcPaused paused;
  PyPlain out;
  out.specs.resize(static_cast<std::size_t>(n));
  out.ptrs.resize(static_cast<std::size_t>(n));
  int dev = -2;
  std::size_t hint = 0;
  Seen s;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* name = PyList_GET_ITEM(names, i);
    if (!PyUnicode_Check(name) || !plain_tensor(a, PyList_GET_ITEM(tensors, i), dev, batch_cuda, s))
      return py::none();
    TensorSpec& spec = out.specs[static_cast<std::size_t>(i)];
    spec.dtype = a.code_of(s.dtype.ptr(), hint);
    if (spec.dtype == DType{}) return py::none();  // a dtype shmcast does not carry
    Py_ssize_t len = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(name, &len);
    if (!utf8) {  // no UTF-8 form: the per-tensor path says so
      PyErr_Clear();
      return py::none();
    }
    spec.name.assign(utf8, static_cast<std::size_t>(len));
    PyObject* shape = s.shape.ptr();
    const Py_ssize_t dims = PyTuple_GET_SIZE(shape);
    spec.shape.resize(static_cast<std::size_t>(dims));
    for (Py_ssize_t k = 0; k < dims; ++k) {
      const long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, k));
      if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
      spec.shape[static_cast<std::size_t>(k)] = d;
    }
    out.ptrs[static_cast<std::size_t>(i)] = s.ptr;
  }
  out.device = dev;
  return py::cast(std::move(out));
}

// The torch.Size `shape` equals `dims`.
bool same_shape(PyObject* shape, std::span<const std::int64_t> dims) {
  if (PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(dims.size())) return false;
  for (std::size_t k = 0; k < dims.size(); ++k) {
    const long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, static_cast<Py_ssize_t>(k)));
    if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (d != dims[k]) return false;
  }
  return true;
}

py::object plain_destinations(const PySync& info, py::handle dsts_arg, bool strict, bool batch_cuda) {
  const TorchApi& a = api_or_throw();
  PyObject* dsts = dsts_arg.ptr();
  if (!PyDict_CheckExact(dsts)) throw py::type_error("plain_destinations: the destinations are a dict");
  const PySync::Flat& flat = *info.flat;
  const std::size_t n = flat.size();
  if (n == 0 || (strict && PyDict_GET_SIZE(dsts) != static_cast<Py_ssize_t>(n))) return py::none();
  // The names as Python strs: those of SyncInfo.tensors once it is made
  // (their hashes kept), else made here one at a time.
  // (SyncInfo.tensors is a tuple: nobody can reorder or shorten it.)
  PyObject* list = flat.list ? flat.list.ptr() : nullptr;
  GcPaused paused;
  PyPlain out;
  out.ptrs.resize(n);
  int dev = -2;
  Seen s;
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* d;
    if (list) {
      d = PyDict_GetItemWithError(dsts, PyTuple_GET_ITEM(PyTuple_GET_ITEM(list, static_cast<Py_ssize_t>(i)), 0));
    } else {
      const std::string_view nm = flat.name(i);
      PyObject* name = PyUnicode_DecodeUTF8(nm.data(), static_cast<Py_ssize_t>(nm.size()), nullptr);
      if (!name) throw py::error_already_set();
      d = PyDict_GetItemWithError(dsts, name);  // borrowed: the dict holds it
      Py_DECREF(name);
    }
    if (!d) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return py::none();  // no destination: strict or not, the per-tensor path decides
    }
    // A strong reference while torch's getters run (they may run Python
    // code that changes the dict).
    const py::object held = py::reinterpret_borrow<py::object>(d);
    if (!plain_tensor(a, held.ptr(), dev, batch_cuda, s)) return py::none();
    const auto code = static_cast<std::size_t>(flat.dtypes[i]);
    if (code >= a.from_code.size() || !a.from_code[code] || s.dtype.ptr() != a.from_code[code]) return py::none();
    if (!same_shape(s.shape.ptr(), flat.shape(i))) return py::none();
    out.ptrs[i] = flat.nbytes[i] ? s.ptr : nullptr;
  }
  out.device = dev;
  return py::cast(std::move(out));
}

}  // namespace

void bind_tensors(py::module_& m) {
  py::class_<PyPlain>(m, "PlainTensors",
                      "A sync's plain tensors, checked (plain_sources, plain_destinations): Producer.send_plain and "
                      "Consumer.read_plain take it.")
      .def_readonly("device", &PyPlain::device, "-1: all on the CPU; else the CUDA device of every tensor")
      .def("__len__", [](const PyPlain& p) { return p.ptrs.size(); });

  m.def(
      "use_torch",
      [](py::handle tensor, py::handle parameter, py::handle strided, py::dict attrs, py::dict to_name,
         py::dict from_name, py::handle complex) {
        TorchApi& a = torch_api();
        if (a.ready) return;  // once per process (a reload of shmcast._batch passes the same objects)
        TorchApi n;
        n.tensor_type = py::reinterpret_borrow<py::object>(tensor).release().ptr();
        n.param_type = parameter.is_none() ? nullptr : py::reinterpret_borrow<py::object>(parameter).release().ptr();
        n.strided = py::reinterpret_borrow<py::object>(strided).release().ptr();
        n.layout = attr_arg(attrs, "layout", false);
        n.get_device = attr_arg(attrs, "get_device", true);
        n.is_cpu = attr_arg(attrs, "is_cpu", false);
        n.is_cuda = attr_arg(attrs, "is_cuda", false);
        n.is_contiguous = attr_arg(attrs, "is_contiguous", true);
        n.is_conj = attr_arg(attrs, "is_conj", true);
        n.is_neg = attr_arg(attrs, "is_neg", true);
        n.dtype = attr_arg(attrs, "dtype", false);
        n.shape = attr_arg(attrs, "shape", false);
        n.data_ptr = attr_arg(attrs, "data_ptr", true);
        for (auto [dt, name] : to_name)
          n.to_code.emplace_back(py::reinterpret_borrow<py::object>(dt).release().ptr(), parse_dtype(name));
        for (auto [name, dt] : from_name) {
          const auto code = static_cast<std::size_t>(parse_dtype(name));
          if (code < n.from_code.size()) n.from_code[code] = py::reinterpret_borrow<py::object>(dt).release().ptr();
        }
        for (py::handle dt : complex) n.complex.push_back(py::reinterpret_borrow<py::object>(dt).release().ptr());
        n.ready = true;
        a = std::move(n);
      },
      py::arg("tensor"), py::arg("parameter"), py::arg("strided"), py::arg("attrs"), py::arg("to_name"),
      py::arg("from_name"), py::arg("complex"),
      "Called once by shmcast._batch: torch.Tensor, nn.Parameter (None: not batched), torch.strided, the "
      "descriptors of the tensor attributes the batched checks read, torch dtype -> shmcast name, shmcast name -> "
      "torch dtype, the complex dtypes.");
  m.def("plain_sources", &plain_sources, py::arg("names"), py::arg("tensors"), py::arg("batch_cuda"),
        "send(): PlainTensors when every tensor of the list is plain (a torch.Tensor or nn.Parameter, strided, "
        "contiguous, no conj or neg bit, a dtype shmcast carries; all on the CPU or, with batch_cuda, all on one "
        "GPU) and every name a str; else None (nothing is sent).");
  m.def("plain_destinations", &plain_destinations, py::arg("info"), py::arg("destinations"), py::arg("strict"),
        py::arg("batch_cuda"),
        "receive_into(): PlainTensors when every tensor of the sync `info` has a plain destination in the dict "
        "(strict: and nothing else is in it) of its dtype and shape; else None (nothing is read).");
}

// Producer.send_plain and Consumer.read_plain (producer.cpp, consumer.cpp)
// take what these made.
std::vector<TensorSpec> take_specs(py::handle plain) { return std::move(plain.cast<PyPlain&>().specs); }
const std::vector<void*>& plain_ptrs(py::handle plain, int* device) {
  const PyPlain& p = plain.cast<const PyPlain&>();
  *device = p.device;
  return p.ptrs;
}

}  // namespace shmcast::python
