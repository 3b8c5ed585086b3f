// Built against an installed shmcast: one sync through the public header.
#include <shmcast/shmcast.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <unistd.h>

int main() {
  const std::string name = "install-check-" + std::to_string(::getpid());
  shmcast::ProducerOptions po;
  po.slot_bytes = 2 << 20;
  po.pin = shmcast::Pin::kNo;
  auto p = shmcast::Producer::create(name, po);
  shmcast::ConsumerOptions co;
  co.pin = shmcast::Pin::kNo;
  auto c = shmcast::Consumer::open(name, co);
  const char msg[] = "installed";
  std::vector<shmcast::TensorSpec> specs = {{"msg", shmcast::DType::kU8, {sizeof msg}}};
  const void* src[] = {msg};
  p.send(specs, src);
  c.wait_sync(std::chrono::seconds(5));
  char out[sizeof msg] = {};
  void* dst[] = {out};
  c.read_into(dst);
  std::printf("%s\n", out);
  return std::strcmp(out, msg) == 0 ? 0 : 1;
}
