// shmcast._shmcast: Consumer (shmcast::Consumer, pointers as ints) and
// SyncInfo (a received sync's manifest, converted once).
#include "binding.hpp"

namespace shmcast::python {


namespace {

// A new reference, or throws the Python error.
PyObject* checked(PyObject* o) {
  if (!o) throw py::error_already_set();
  return o;
}

// The dtype names as Python strs, made once: every tensor of a sync shares
// them (a new reference; a code beyond the table, which only a broken
// region holds, gets a str of its own).
PyObject* dtype_str(DType d) {
  static std::array<PyObject*, 256> names{};
  const auto i = static_cast<std::size_t>(d);
  if (i >= names.size()) return checked(PyUnicode_FromString(std::string(dtype_name(d)).c_str()));
  if (!names[i]) names[i] = checked(PyUnicode_InternFromString(std::string(dtype_name(d)).c_str()));
  Py_INCREF(names[i]);
  return names[i];
}

// (a, b, c, ...) from new references (stolen, also when it fails).
template <class... T>
PyObject* tuple_of(T... items) {
  PyObject* v[] = {items...};
  PyObject* t = PyTuple_New(sizeof...(T));
  if (!t) {
    for (PyObject* o : v) Py_DECREF(o);
    throw py::error_already_set();
  }
  for (std::size_t i = 0; i < sizeof...(T); ++i) PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), v[i]);
  return t;
}

}  // namespace

namespace {

// Python's strict UTF-8 (what PyUnicode_DecodeUTF8 accepts): no overlong
// form, no surrogate, nothing beyond U+10FFFF.
bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int n;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // beyond U+10FFFF
    } else {
      return false;
    }
    if (end - p <= n || p[1] < lo || p[1] > hi) return false;
    for (int k = 2; k <= n; ++k)
      if ((p[k] & 0xC0) != 0x80) return false;
    p += n + 1;
  }
  return true;
}

}  // namespace

// Flat copies of the manifest's tensors, no Python object: this runs for
// every tensor of every sync a Python consumer takes (issue 43 item 2).
PySync PySync::from(const SyncInfo& s) {
  PySync p;
  p.version = s.version;
  p.stream_bytes = s.stream_bytes;
  p.payload_bytes = s.payload_bytes;
  p.first_seq = s.first_seq;
  p.chunks = s.chunks;
  p.world_size = s.world_size;
  p.base_version = s.base_version;
  p.wire_bytes = s.wire_bytes;
  const std::size_t n = s.tensors.size();
  Flat& f = *p.flat;
  f.name_end.reserve(n);
  f.dtypes.reserve(n);
  f.nbytes.reserve(n);
  f.offsets.reserve(n);
  f.dims_end.reserve(n);
  std::size_t name_bytes = 0, dims = 0;
  for (const TensorInfo& t : s.tensors) {
    name_bytes += t.name.size();
    dims += t.shape.size();
  }
  f.names.reserve(name_bytes);
  f.dims.reserve(dims);
  Pieces& pieces = *p.pieces_data;
  pieces.starts.reserve(n + 1);
  pieces.shards.reserve(n);
  pieces.starts.push_back(0);
  for (std::size_t i = 0; i < n; ++i) {
    const TensorInfo& t = s.tensors[i];
    // Names reach Python only as valid UTF-8 (a producer rejects others;
    // a region written by something else may still hold any bytes).
    if (!valid_utf8(t.name))
      throw Error(Errc::kCorrupt, "sync " + std::to_string(s.version) + ": the name of tensor " + std::to_string(i) +
                                      " ('" + text(t.name).cast<std::string>() +
                                      "') is not valid UTF-8; whatever wrote the region is broken");
    f.names += t.name;
    f.name_end.push_back(f.names.size());
    f.dtypes.push_back(t.dtype);
    f.nbytes.push_back(t.nbytes);
    f.offsets.push_back(t.stream_offset);
    f.dims.insert(f.dims.end(), t.shape.begin(), t.shape.end());
    f.dims_end.push_back(f.dims.size());
    pieces.shards.insert(pieces.shards.end(), t.shards.begin(), t.shards.end());
    pieces.starts.push_back(pieces.shards.size());
  }
  return p;
}

// One tuple per tensor, built with the C API, once per sync, in a tuple:
// immutable, as every SyncInfo copy shares it and the batched read looks
// the names up in it (a list a caller reordered or shortened would pair
// destinations with other tensors' bytes, or be read past its end).
py::object PySync::tensors() const {
  Flat& f = *flat;
  if (f.list) return f.list;
  GcPaused paused;
  const auto n = static_cast<Py_ssize_t>(f.size());
  py::tuple out = py::reinterpret_steal<py::tuple>(checked(PyTuple_New(n)));
  for (Py_ssize_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const std::string_view nm = f.name(k);
    PyObject* name = checked(PyUnicode_DecodeUTF8(nm.data(), static_cast<Py_ssize_t>(nm.size()), nullptr));
    const std::span<const std::int64_t> dims = f.shape(k);
    PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(dims.size()));
    if (!shape) {
      Py_DECREF(name);
      throw py::error_already_set();
    }
    for (std::size_t d = 0; d < dims.size(); ++d) {
      PyObject* v = PyLong_FromLongLong(dims[d]);
      if (!v) {
        Py_DECREF(name);
        Py_DECREF(shape);
        throw py::error_already_set();
      }
      PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(d), v);
    }
    PyObject* dt;
    try {
      dt = dtype_str(f.dtypes[k]);
    } catch (...) {
      Py_DECREF(name);
      Py_DECREF(shape);
      throw;
    }
    PyObject* nbytes = PyLong_FromUnsignedLongLong(f.nbytes[k]);
    PyObject* off = PyLong_FromUnsignedLongLong(f.offsets[k]);
    if (!nbytes || !off) {
      Py_DECREF(name);
      Py_DECREF(dt);
      Py_DECREF(shape);
      Py_XDECREF(nbytes);
      Py_XDECREF(off);
      throw py::error_already_set();
    }
    PyTuple_SET_ITEM(out.ptr(), i, tuple_of(name, dt, shape, nbytes, off));
  }
  f.list = std::move(out);
  return f.list;
}

py::object PySync::pieces() const {
  Pieces& d = *pieces_data;
  if (d.list) return d.list;
  const std::size_t n = d.starts.empty() ? 0 : d.starts.size() - 1;
  py::list out(n);
  for (std::size_t i = 0; i < n; ++i) {
    PyObject* ps = checked(PyList_New(static_cast<Py_ssize_t>(d.starts[i + 1] - d.starts[i])));
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), ps);  // owned by the list from here: filled below
    for (std::size_t k = d.starts[i]; k < d.starts[i + 1]; ++k) {
      const ShardInfo& sh = d.shards[k];
      PyList_SET_ITEM(ps, static_cast<Py_ssize_t>(k - d.starts[i]),
                      py::make_tuple(sh.rank, sh.dim, sh.start, sh.length, sh.nbytes).release().ptr());
    }
  }
  d.list = std::move(out);
  d.shards = {};
  d.starts = {};
  return d.list;
}

namespace {

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
             bool verify_checksums, bool group_access, py::handle trusted_uids, py::handle device) {
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
    o.device = device_arg(device, "device");
    py::gil_scoped_release nogil;
    c_ = std::make_unique<Consumer>(Consumer::open(n, o));
    delta_ = c_->delta();
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

  // The sync is converted where the library holds it, with this object
  // locked and the GIL taken again (as visit() does; no thread waits for
  // the lock with the GIL held): no copy of its manifest.
  PySync wait_sync(py::handle timeout) {
    const auto deadline = Clock::now() + seconds_arg(timeout, "timeout", true);
    for (;;) {
      std::optional<PySync> got;
      std::exception_ptr bad;  // a name Python cannot hold: the sync is skipped, not left half-taken
      locked([&](Consumer& c) {
        const auto left = std::chrono::duration_cast<Duration>(deadline - Clock::now());
        const Duration slice = std::max(Duration::zero(), std::min<Duration>(left, kSlice));
        const SyncInfo* s = nullptr;
        try {
          s = &c.wait_sync(slice);
        } catch (const Error& e) {
          if (e.code() != Errc::kTimeout || Clock::now() >= deadline) throw;
          return;
        }
        {
          py::gil_scoped_acquire gil;
          try {
            got = PySync::from(*s);
          } catch (const Error&) {
            bad = std::current_exception();
          }
        }
        if (bad) {
          try {
            c.skip();
          } catch (const Error&) {
          }
        }
      });
      if (bad) std::rethrow_exception(bad);
      if (got) {
        last_ = std::move(*got);
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

  // read_into / read_into_device of the destinations plain_destinations()
  // checked (a GPU batch: on `stream`, in the current device's context).
  void read_plain(py::handle plain, py::handle stream) {
    int device = -1;
    std::vector<void*> d = plain_ptrs(plain, &device);
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    if (device < 0)
      locked([&](Consumer& c) { c.read_into(d, {}); });
    else
      locked([&](Consumer& c) { c.read_into_device(d, s, {}); });
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
  void request_full_sync() {
    locked([](Consumer& c) { c.request_full_sync(); });
  }
  void forget_destinations(std::uintptr_t ptr, std::uint64_t bytes) {
    locked([&](Consumer& c) { c.forget_destinations(reinterpret_cast<const void*>(ptr), bytes); });
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
  std::string slot_memory() const { return slot_memory_name(c_->slot_memory()); }

  void close() {
    if (forked()) return;  // the parent's seat: not the child's to free
    py::gil_scoped_release nogil;
    std::lock_guard lk(mu_);
    if (c_) c_->close();
    closed_ = true;
  }

  bool closed() const { return closed_; }
  const PySync& sync() const { return last_; }
  py::dict last_sync() const { return sync_report(c_->last_sync()); }
  bool delta() const { return delta_; }
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
  bool delta_ = false;
  PySync last_;
};

}  // namespace

void bind_sync_info(py::module_& m) {
  py::class_<PySync>(m, "SyncInfo", "A received sync's manifest (a snapshot).")
      .def_readonly("version", &PySync::version)
      .def_readonly("stream_bytes", &PySync::stream_bytes)
      .def_readonly("payload_bytes", &PySync::payload_bytes)
      .def_readonly("first_seq", &PySync::first_seq)
      .def_readonly("chunks", &PySync::chunks)
      .def_readonly("base_version", &PySync::base_version,
                    "a delta sync: the version its deltas apply to; 0: a full sync")
      .def_readonly("wire_bytes", &PySync::wire_bytes,
                    "bytes the sync's pieces take in the region (a delta sync: its blobs; payload_bytes stays the "
                    "tensors' logical size)")
      .def_property_readonly("delta", [](const PySync& s) { return s.base_version != 0; },
                             "True for a delta sync (base_version != 0)")
      .def_property_readonly("tensors", &PySync::tensors,
                             "tuple of (name, dtype, shape, nbytes, stream_offset) (made on first use, then the same "
                             "tuple)")
      .def_readonly("world_size", &PySync::world_size, "producer ranks that wrote the sync")
      .def_property_readonly("pieces", &PySync::pieces,
                    "per tensor, its pieces: [(rank, dim, start, length, nbytes)] (dim -1: the whole tensor)")
      .def("__len__", [](const PySync& s) { return s.flat->size(); })
      .def("__repr__", [](const PySync& s) {
        return "<shmcast.SyncInfo version=" + std::to_string(s.version) + " tensors=" +
               std::to_string(s.flat->size()) + " payload_bytes=" + std::to_string(s.payload_bytes) +
               (s.base_version != 0 ? " delta of " + std::to_string(s.base_version) : std::string()) + ">";
      });
}

void bind_consumer(py::module_& m) {
  py::class_<PyConsumer>(m, "Consumer", "Low-level consumer (shmcast::Consumer). Pointers are ints.")
      .def(py::init<py::handle, py::handle, py::handle, py::handle, bool, bool, py::handle, py::handle>(),
           py::arg("name"), py::kw_only(), py::arg("open_timeout") = 30.0, py::arg("chunk_timeout") = 60.0,
           py::arg("pin") = "auto", py::arg("verify_checksums") = true, py::arg("group_access") = false,
           py::arg("trusted_uids") = py::none(), py::arg("device") = py::none(),
           "device: regions with device slots, the GPU (this process's ordinal) whose streams copy out of them; "
           "None: the current device (shmcast::ConsumerOptions::device). Unsupported when they cannot be mapped "
           "here.")
      .def("wait_sync", &PyConsumer::wait_sync, py::arg("timeout") = 30.0,
           "Waits for the next sync (timeout in seconds, None = forever) and returns its SyncInfo.")
      .def("read_into", &PyConsumer::read_into, py::arg("ptrs"), py::arg("selections") = py::none(),
           "Host copy: ptrs[i] receives tensor i (None or 0 skips it); selections: None, or per tensor None or "
           "(dim, start, length): ptrs[i] then receives that slice, contiguous.")
      .def("read_plain", &PyConsumer::read_plain, py::arg("plain"), py::arg("stream") = py::none(),
           "read_into (CPU) or read_into_device (a GPU batch, on `stream`) into the destinations "
           "plain_destinations() checked against this sync.")
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
      .def_property_readonly("slot_memory", &PyConsumer::slot_memory,
                             "'host' or 'device' (the region's). Device slots: every read is a copy by the GPU "
                             "(read_into, read_into_device, read_to_staging); visit() raises Unsupported")
      .def("close", &PyConsumer::close, "Idempotent; does nothing in a forked child (the object is the parent's).")
      .def("check", &PyConsumer::check, "Raises Closed once closed, InvalidArgument in a forked child.")
      .def_property_readonly("closed", &PyConsumer::closed)
      .def_property_readonly("sync", &PyConsumer::sync, py::return_value_policy::copy,
                             "SyncInfo of the last sync wait_sync() returned")
      .def_property_readonly("last_sync", &PyConsumer::last_sync,
                             "The last sync read_into() / read_into_device() completed: {'version', 'kind' ('full' | "
                             "'delta'), 'logical_bytes', 'payload_bytes'} (shmcast::Consumer::last_sync)")
      .def("request_full_sync", &PyConsumer::request_full_sync,
           "Delta regions: the next sync is full, and no delta is applied to the destinations meanwhile "
           "(shmcast::Consumer::request_full_sync)")
      .def("forget_destinations", &PyConsumer::forget_destinations, py::arg("ptr"), py::arg("nbytes"),
           "Delta regions: the memory [ptr, ptr + nbytes) no longer holds what a read left there; no delta is "
           "applied to it on that read's base (shmcast::Consumer::forget_destinations)")
      .def_property_readonly("delta", &PyConsumer::delta,
                             "True when the region was created with delta syncs (Producer(delta=True))")
      .def_property_readonly("last_version", &PyConsumer::last_version)
      .def_property_readonly("seat", &PyConsumer::seat)
      .def_property_readonly("name", &PyConsumer::name)
      .def_property_readonly("pinned", &PyConsumer::pinned)
      .def_property_readonly("pin_seconds", &PyConsumer::pin_seconds)
      .def_property_readonly("open_seconds", &PyConsumer::open_seconds);
}

}  // namespace shmcast::python
