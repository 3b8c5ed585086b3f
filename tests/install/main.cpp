// Built against an installed shmcast: one sync through the public header,
// then the region seen through the read-only probe.
#include <shmcast/probe.hpp>
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
  namespace probe = shmcast::probe;
  const probe::Region r = probe::probe_region(shmcast::region_dir(), name, {.decode_manifest = true});
  if (r.state != probe::State::kReady || r.manifest.status != probe::ManifestStatus::kOk ||
      r.manifest.tensors.size() != 1 || r.manifest.tensors[0].name != "msg" || r.seats.empty()) {
    std::printf("probe: %s (%s), manifest %s\n", probe::state_name(r.state), r.reason.c_str(),
                probe::state_name(r.manifest.status));
    return 1;
  }
  std::printf("%s\n", out);
  return std::strcmp(out, msg) == 0 ? 0 : 1;
}
