// Shared by the two-process GPU benches (delta_sync_bench.cpp,
// device_slots_bench.cpp): CLOCK_MONOTONIC, min/median/max, and the copy
// ceilings measured in the same run: a device-to-device copy, and the host
// path's concurrent D2H + H2D (pinned host memory, two streams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace bench::gpu {

// Throws std::runtime_error naming `what` when e is not cudaSuccess.
void ck(cudaError_t e, const char* what);
// CLOCK_MONOTONIC in seconds: comparable between processes of one machine.
double mono_s();
// {"n", "min", "median", "max"} of v ({"n": 0} when empty).
nlohmann::json stat(std::vector<double> v);
// "median (min .. max)", each times `scale`, in printf format f; "-" without a median.
std::string fmt_stat(const nlohmann::json& s, double scale, const char* f);
// The command line as one string (for the JSON's "command").
std::string command_line(int argc, char** argv);
// The ceilings, measured in a child process (CUDA is never initialised in
// the caller, which forks its roles afterwards), on device 0:
//   d2d_gbps        cudaMemcpy device-to-device of `bytes`, after a warm-up, `reps` times
//   host_both_gbps  a D2H and an H2D of `bytes` each at once, on two streams,
//                   pinned host buffers; GB/s per direction, `reps` times after a warm-up
// {"error": ...} when it failed.
nlohmann::json ceilings(std::uint64_t bytes, int reps);

}  // namespace bench::gpu
