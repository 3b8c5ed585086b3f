// shmcast._shmcast: the pybind11 binding of shmcast.hpp (module, constants,
// free functions). binding.hpp says what the other files hold.
#include "binding.hpp"

using namespace shmcast;
using namespace shmcast::python;

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
  m.attr("max_delta_groups") = limits::kMaxDeltaGroups;
  // Quantize-on-send (shmcast.hpp, Quantize): the rules stay the library's.
  m.attr("quantize_block") = quantize::kBlock;
  m.attr("quantize_scale_suffix") = std::string(quantize::kScaleSuffix);
  m.attr("quantize_names") = py::make_tuple(std::string(quantize_name(Quantize::kFp8Block128)),
                                            std::string(quantize_name(Quantize::kFp8Block128Ue8m0)));
  m.def(
      "default_quantize_filter",
      [](py::handle name, py::handle shape, py::handle dtype) {
        TensorSpec t;
        t.name = utf8_arg(name, "name", Errc::kInvalidArgument);
        t.dtype = parse_dtype(dtype);
        for (py::handle d : shape) t.shape.push_back(d.cast<std::int64_t>());
        return default_quantize_filter(t);
      },
      py::arg("name"), py::arg("shape"), py::arg("dtype"),
      "Whether a quantizing producer converts this tensor when given no filter (shmcast::default_quantize_filter): "
      "2-D bf16/f16/f32 '*.weight' with both dims >= 128, not embeddings, lm_head, norms or routers (mlp.gate).");
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

  bind_sync_info(m);
  bind_producer(m);
  bind_consumer(m);
  bind_tensors(m);
}
