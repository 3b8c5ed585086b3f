// shmcast._shmcast: Producer (shmcast::Producer, pointers as ints) and
// SentSync (shmcast::SyncLayout).
#include "binding.hpp"

namespace shmcast::python {

namespace {

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
             py::handle world_size, py::handle rank_timeout, py::handle mode, py::handle store_bytes, bool delta,
             py::handle keyframe_every, py::handle delta_max_ratio, py::handle slot_memory, py::handle slot_device,
             py::handle quantize, py::handle quantize_filter) {
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
    // None: the library's default (room for limits::kMaxTensors, reserved sparsely).
    if (!manifest_bytes.is_none())
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
    o.delta = delta;
    o.keyframe_every = int_arg<std::uint32_t>(keyframe_every, "keyframe_every", 0, 0xffffffffu);
    if (!delta_max_ratio.is_none()) o.delta_max_ratio = ratio_arg(delta_max_ratio, "delta_max_ratio");
    o.slot_memory = parse_slot_memory(slot_memory);
    o.slot_device = device_arg(slot_device, "slot_device");
    if (!quantize.is_none()) {
      const std::string q = utf8_arg(quantize, "quantize", Errc::kInvalidArgument);
      if (!quantize_from_name(q, &o.quantize))
        throw Error(Errc::kInvalidArgument, "quantize must be None, 'fp8-block128' or 'fp8-block128-ue8m0', not '" +
                                                q + "'");
    }
    if (!quantize_filter.is_none()) o.quantize_filter = quantize_filter_arg(quantize_filter);
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

  // The tensors, in order, of the manifest a sync of `specs` would announce
  // (Producer::manifest_specs: with quantize, the selected tensors in
  // float8 and each one's scales after it), as (name, dtype, shape).
  py::list manifest_specs(py::handle specs) {
    std::vector<TensorSpec> s = to_specs(specs);
    const std::vector<TensorSpec> wire = locked([&](Producer& p) { return p.manifest_specs(s); });
    py::list out;
    for (const TensorSpec& t : wire)
      out.append(py::make_tuple(py::str(t.name), py::str(std::string(dtype_name(t.dtype))), shape_tuple(t.shape)));
    return out;
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
    return send_locked(std::move(s), srcs, ver);
  }

  // send_batch for what plain_sources checked (its specs are moved out:
  // one send per PlainTensors). stream: the CUDA stream of a GPU batch.
  std::uint64_t send_plain(py::handle plain, py::handle stream, py::handle version) {
    const std::uint64_t ver = int_arg<std::uint64_t>(version, "version", 0, kU64Max);
    int device = -1;
    const std::vector<void*>& ptrs = plain_ptrs(plain, &device);
    void* s = reinterpret_cast<void*>(as_ptr(stream, "stream"));
    std::vector<Source> srcs(ptrs.size());
    for (std::size_t i = 0; i < ptrs.size(); ++i) srcs[i] = Source{ptrs[i], device >= 0, std::nullopt, s};
    std::vector<TensorSpec> specs = take_specs(plain);
    if (specs.size() != srcs.size())
      throw Error(Errc::kInvalidArgument, "send_plain(): this PlainTensors was sent already (or came from "
                                          "plain_destinations): check the tensors again with plain_sources()");
    return send_locked(std::move(specs), srcs, ver);
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
  SyncLayout last_layout() {
    check();
    return get().last_layout();
  }
  py::dict last_sync() const { return sync_report(p_->last_sync()); }
  std::uint64_t delta_base_bytes() const { return p_->delta_base_bytes(); }
  std::string slot_memory() const { return slot_memory_name(p_->slot_memory()); }
  int slot_device() const { return p_->slot_device(); }
  std::uint64_t slot_device_bytes() const { return p_->slot_device_bytes(); }

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

  // begin + every write + end, locked; the sync is aborted (and the error
  // rethrown) when a write fails.
  std::uint64_t send_locked(std::vector<TensorSpec> specs, const std::vector<Source>& srcs, std::uint64_t ver) {
    return locked([&](Producer& p) {
      // Quantize-on-send from a GPU: every tensor's scales before the sync
      // begins, in one pass (a NaN or Inf fails here, nothing announced).
      {  // (prepare_device() is a no-op without quantize)
        std::vector<const void*> dev(srcs.size(), nullptr);
        void* stream = nullptr;
        bool any = false;
        for (std::size_t i = 0; i < srcs.size(); ++i)
          if (srcs[i].device && !srcs[i].layout) {
            if (!any) stream = srcs[i].stream;
            if (any && srcs[i].stream != stream) continue;  // one stream per pass; the rest make their own
            dev[i] = srcs[i].ptr;
            any = true;
          }
        if (any) p.prepare_device(specs, dev, stream);
      }
      const std::uint64_t v = begin_locked(std::move(specs), ver);
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

}  // namespace

void bind_producer(py::module_& m) {
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
                    py::handle, bool, py::handle, py::handle, py::handle, py::handle, py::handle, py::handle>(),
           py::arg("name"), py::kw_only(), py::arg("slot_bytes") = 256ull << 20, py::arg("slots") = 2,
           py::arg("max_consumers") = 8, py::arg("manifest_bytes") = py::none(), py::arg("group_access") = false,
           py::arg("replace_stale") = true, py::arg("unlink_on_close") = true, py::arg("checksums") = false,
           py::arg("stall_policy") = "fail", py::arg("consumer_timeout") = 60.0, py::arg("pin") = "auto",
           py::arg("engine") = "auto", py::arg("rank") = 0, py::arg("world_size") = 1, py::arg("rank_timeout") = 120.0,
           py::arg("mode") = "ring", py::arg("store_bytes") = 0, py::arg("delta") = false,
           py::arg("keyframe_every") = 0, py::arg("delta_max_ratio") = py::none(), py::arg("slot_memory") = "host",
           py::arg("slot_device") = py::none(), py::arg("quantize") = py::none(),
           py::arg("quantize_filter") = py::none())
      .def("begin_sync", &PyProducer::begin_sync, py::arg("specs"), py::arg("version") = 0,
           "specs: sequence of (name, dtype, shape), or (name, dtype, full shape, dim, start, length) for a shard "
           "(sharded producers). version: 0 (the next), or the sync's version (greater than the last; sharded "
           "producers: the same on every rank). Returns the sync's version.")
      .def("manifest_specs", &PyProducer::manifest_specs, py::arg("specs"),
           "The (name, dtype, shape) of each tensor, in order, that a sync of `specs` (as begin_sync takes them) "
           "announces: with quantize, each tensor the filter selects in float8, followed by its scales. Changes "
           "nothing.")
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
      .def("send_plain", &PyProducer::send_plain, py::arg("plain"), py::arg("stream") = py::none(),
           py::arg("version") = 0,
           "send_batch of the tensors plain_sources() checked (a GPU batch: on `stream`, in the current device's "
           "context); each PlainTensors is sent once.")
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
      .def_property_readonly("last_layout", &PyProducer::last_layout, py::return_value_policy::copy,
                             "SentSync: the layout of the last sync begun")
      .def_property_readonly("last_sync", &PyProducer::last_sync,
                             "The last completed sync: {'version', 'kind' ('full' | 'delta'), 'logical_bytes', "
                             "'payload_bytes'} (shmcast::Producer::last_sync); version 0: none yet")
      .def_property_readonly("delta_base_bytes", &PyProducer::delta_base_bytes,
                             "Bytes of host memory the delta base takes (0 without delta=True)")
      .def_property_readonly("slot_memory", &PyProducer::slot_memory,
                             "'host' (slots in the region file) or 'device' (slots on a GPU, shared as a VMM fd)")
      .def_property_readonly("slot_device", &PyProducer::slot_device,
                             "Device slots: the GPU that holds them (this process's ordinal); -1 for host slots")
      .def_property_readonly("slot_device_bytes", &PyProducer::slot_device_bytes,
                             "Device slots: GPU bytes allocated for them (slots x slot_bytes, rounded up to the "
                             "GPU's granularity); 0 for host slots")
      .def_property_readonly("pinned", &PyProducer::pinned)
      .def_property_readonly("engine", &PyProducer::engine, "'host' or 'cuda': the copy engine chosen at create")
      .def_property_readonly("mode", &PyProducer::mode, "'ring' or 'store'")
      .def_property_readonly("pin_seconds", &PyProducer::pin_seconds)
      .def_property_readonly("create_seconds", &PyProducer::create_seconds);
}

}  // namespace shmcast::python
