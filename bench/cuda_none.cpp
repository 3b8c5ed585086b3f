// shmcast-bench built without CUDA (or without nvcc for its kernels):
// --mode cuda reports that and exits 2.
#include <stdexcept>

#include "bench.hpp"

namespace bench {

bool bench_has_cuda() { return false; }
int cuda_producer(Ctl*) { throw std::runtime_error("this shmcast-bench was built without CUDA"); }
int cuda_consumer(Ctl*, int) { throw std::runtime_error("this shmcast-bench was built without CUDA"); }
Ceilings measure_ceilings(int, int, std::uint64_t, int) {
  Ceilings c;
  c.error = "this shmcast-bench was built without CUDA";
  return c;
}

}  // namespace bench
