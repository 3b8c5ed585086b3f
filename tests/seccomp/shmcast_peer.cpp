// A producer or consumer process for container tests: run it under
// shmcast-seccomp-run, in its own PID namespace, or both.
//
//   shmcast_peer produce NAME [--syncs N] [--consumers C] [--tensors T] [--bytes B] [--report FILE]
//   shmcast_peer consume NAME [--syncs N] [--save FILE] [--report FILE]
//
// Tensor i of sync v holds fill_pattern(seed_of(v, i)); the consumer checks
// every byte. --save writes the last sync's bytes through the file engine
// (io_uring or its pwrite fallback) and checks the file. --report writes
// "pidns=<inode> pid=<pid> backend=<file backend>" lines.
// Exit: 0 ok, 2 usage, 12 wrong bytes, 13 bad saved file, 20+Errc on shmcast::Error.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "file_io.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

struct Args {
  std::string role, name, save, report;
  int syncs = 3, tensors = 8;
  std::uint32_t consumers = 1;
  std::uint64_t bytes = 3 << 20;
};

void report(const Args& a, const std::string& extra) {
  if (a.report.empty()) return;
  struct stat st {};
  ::stat("/proc/self/ns/pid", &st);
  std::ofstream f(a.report, std::ios::app);
  f << "role=" << a.role << " pidns=" << st.st_ino << " pid=" << ::getpid() << " " << extra << "\n";
}

int produce(const Args& a) {
  ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.pin = Pin::kNo;
  o.consumer_timeout = 30s;
  Producer p = Producer::create(a.name, o);
  report(a, "");
  p.wait_for_consumers(a.consumers, 30s);
  for (int v = 1; v <= a.syncs; ++v) {
    PatternSync s(a.tensors, a.bytes, static_cast<std::uint64_t>(v));
    p.send(s.specs, s.ptrs);
  }
  p.wait_drained(30s);
  return 0;
}

int save_and_check(const Args& a, const std::vector<std::vector<std::uint8_t>>& got) {
  detail::FileWriter w;
  ::unlink(a.save.c_str());
  if (w.open(a.save) != 0) return 13;
  std::uint64_t off = 0;
  for (const auto& g : got) {
    if (w.write_at(g.data(), g.size(), off) != 0) return 13;
    off += g.size();
  }
  if (w.fsync() != 0 || w.close() != 0) return 13;
  report(a, std::string("backend=") + w.backend() + " why=\"" + w.fallback_reason() + "\"");
  std::ifstream f(a.save, std::ios::binary);
  for (const auto& g : got) {
    std::vector<std::uint8_t> back(g.size());
    f.read(reinterpret_cast<char*>(back.data()), static_cast<std::streamsize>(back.size()));
    if (back != g) return 13;
  }
  return 0;
}

int consume(const Args& a) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 30s;
  Consumer c = Consumer::open(a.name, o);
  report(a, "");
  std::vector<std::vector<std::uint8_t>> got;
  for (int i = 0; i < a.syncs; ++i) {
    const SyncInfo& info = c.wait_sync(30s);
    got.assign(info.tensors.size(), {});
    std::vector<void*> dst;
    for (std::size_t t = 0; t < info.tensors.size(); ++t) {
      got[t].assign(info.tensors[t].nbytes, 0xEE);
      dst.push_back(got[t].data());
    }
    c.read_into(dst);
    if (!check_pattern(got, info.version)) return 12;
  }
  return a.save.empty() ? 0 : save_and_check(a, got);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: shmcast_peer produce|consume NAME [options]\n");
    return 2;
  }
  Args a;
  a.role = argv[1];
  a.name = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--syncs") a.syncs = std::stoi(v);
    else if (k == "--consumers") a.consumers = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--tensors") a.tensors = std::stoi(v);
    else if (k == "--bytes") a.bytes = std::stoull(v);
    else if (k == "--save") a.save = v;
    else if (k == "--report") a.report = v;
    else {
      std::fprintf(stderr, "shmcast_peer: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    if (a.role == "produce") return produce(a);
    if (a.role == "consume") return consume(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "shmcast_peer %s: %s\n", a.role.c_str(), e.what());
    return errc_exit(e);
  }
  return 2;
}
