// The trainer and the inference workers around shmcast-relay in the relay
// tests: one process per role, on one "node" (its SHMCAST_DIR).
//
//   relay_peer produce NAME --syncs N [--tensors T | --bytes N] [--slot-bytes B] [--seed S]
//                           [--consumers C] [--go PREFIX] [--pause-sync V --resume FILE] [--abort-sync V]
//                           [--empty-sync V] --report FILE
//   relay_peer consume NAME --syncs N [--tensors T | --bytes N] [--slot-bytes B] [--seed S] [--stall] [--empty-sync V]
//                           [--wait-sync S] --report FILE
//
// Sync v carries random_manifest(seed + v, slot_bytes, T) (multi-slot and
// empty tensors included); tensor i holds fill_pattern(seed_of(v, i)).
// --empty-sync V: sync V has the same names but every tensor is empty.
// --bytes N: every sync is one tensor of N bytes (u8) instead.
// produce: creates the region, reports "ready", waits for C consumers, then
// for each sync v waits for the file PREFIX.v when --go is given, sends it
// and reports "sent v". With --pause-sync V, sync V stops after half its
// tensors (reports "paused V") until FILE exists; with --abort-sync V, sync V
// is abandoned after half its tensors (abort_sync; reports "aborted V").
// consume: reports "attached", then per sync "manifest v", and "ok v" once
// every byte and the manifest matched, "bad v" when not, "error v CODE" on
// an error (PeerDied/Closed: it reopens the region and reports "reopened").
// It ends after N "ok" lines. --stall: attach, report, never read (until
// killed). --wait-sync S: how long it waits for each sync (90 s; a worker
// behind a relay the test stops for good needs longer on a loaded machine).
// Exit: 0 done, 2 usage, 12 wrong bytes, 20+Errc on another error.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

namespace {

struct Args {
  std::string role, name, report, go, resume;
  int syncs = 3, tensors = 12, pause_sync = 0, abort_sync = 0, empty_sync = 0, wait_sync_s = 90;
  std::uint32_t consumers = 1;
  std::uint64_t slot_bytes = 2 << 20, seed = 7, bytes = 0;
  bool stall = false;
};

void report(const Args& a, const std::string& line) {
  std::ofstream f(a.report, std::ios::app);
  f << line << "\n";
  f.flush();
}

bool wait_file(const std::string& path, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  struct stat st {};
  while (::stat(path.c_str(), &st) != 0) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

std::vector<TensorSpec> manifest(const Args& a, std::uint64_t v) {
  if (a.bytes > 0) return {TensorSpec{"w", DType::kU8, {static_cast<std::int64_t>(a.bytes)}}};
  std::vector<TensorSpec> specs = random_manifest(a.seed + v, a.slot_bytes, a.tensors);
  if (static_cast<int>(v) == a.empty_sync)
    for (TensorSpec& t : specs) t.shape = {0};
  return specs;
}

int produce(const Args& a) {
  ProducerOptions o;
  o.slot_bytes = a.slot_bytes;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.consumer_timeout = 60s;
  Producer p = Producer::create(a.name, o);
  report(a, "ready");
  p.wait_for_consumers(a.consumers, 60s);
  for (int v = 1; v <= a.syncs; ++v) {
    if (!a.go.empty() && !wait_file(a.go + "." + std::to_string(v), 90s)) {
      std::fprintf(stderr, "relay_peer produce: no go file for sync %d\n", v);
      return 3;
    }
    const std::vector<TensorSpec> specs = manifest(a, static_cast<std::uint64_t>(v));
    std::vector<std::vector<std::uint8_t>> data(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      data[i].resize(specs[i].nbytes());
      fill_pattern(data[i].data(), data[i].size(), seed_of(static_cast<std::uint64_t>(v), i));
    }
    const std::uint64_t got = p.begin_sync(specs);
    if (got != static_cast<std::uint64_t>(v)) return 4;
    bool aborted = false;
    for (std::size_t i = 0; i < specs.size() && !aborted; ++i) {
      if (v == a.pause_sync && i == specs.size() / 2) {
        report(a, "paused " + std::to_string(v));
        if (!wait_file(a.resume, 90s)) return 3;
      }
      if (v == a.abort_sync && i == specs.size() / 2) {
        p.abort_sync("relay_peer: sync " + std::to_string(v) + " abandoned halfway");
        aborted = true;
        break;
      }
      p.write(i, data[i].data());
    }
    if (aborted) {
      report(a, "aborted " + std::to_string(v));
      continue;
    }
    p.end_sync();
    report(a, "sent " + std::to_string(v));
  }
  // Stay until the test ends us: downstream consumers may still read.
  for (;;) std::this_thread::sleep_for(1s);
}

int consume(const Args& a) {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 90s;
  o.chunk_timeout = 60s;
  std::optional<Consumer> c;
  c.emplace(Consumer::open(a.name, o));
  report(a, "attached");
  if (a.stall)
    for (;;) std::this_thread::sleep_for(1s);
  int ok = 0;
  while (ok < a.syncs) {
    std::uint64_t v = 0;
    try {
      const SyncInfo& info = c->wait_sync(std::chrono::seconds(a.wait_sync_s));
      v = info.version;
      report(a, "manifest " + std::to_string(v));
      const std::vector<TensorSpec> want = manifest(a, v);
      bool same = want.size() == info.tensors.size();
      for (std::size_t i = 0; same && i < want.size(); ++i)
        same = want[i].name == info.tensors[i].name && want[i].dtype == info.tensors[i].dtype &&
               want[i].shape == info.tensors[i].shape;
      std::vector<std::vector<std::uint8_t>> got(info.tensors.size());
      std::vector<void*> dst;
      for (std::size_t i = 0; i < info.tensors.size(); ++i) {
        got[i].assign(info.tensors[i].nbytes, 0xEE);
        dst.push_back(got[i].data());
      }
      c->read_into(dst);
      if (!same || !check_pattern(got, v)) {
        report(a, "bad " + std::to_string(v));
        return 12;
      }
      report(a, "ok " + std::to_string(v));
      ++ok;
    } catch (const Error& e) {
      report(a, "error " + std::to_string(v) + " " + errc_name(e.code()));
      if (e.code() == Errc::kAborted) continue;
      if (e.code() != Errc::kPeerDied && e.code() != Errc::kClosed) throw;
      c.reset();
      c.emplace(Consumer::open(a.name, o));
      report(a, "reopened");
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: relay_peer produce|consume NAME [options]\n");
    return 2;
  }
  Args a;
  a.role = argv[1];
  a.name = argv[2];
  for (int i = 3; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--stall") {
      a.stall = true;
      continue;
    }
    if (i + 1 >= argc) return 2;
    const std::string v = argv[++i];
    if (k == "--syncs") a.syncs = std::stoi(v);
    else if (k == "--tensors") a.tensors = std::stoi(v);
    else if (k == "--slot-bytes") a.slot_bytes = std::stoull(v);
    else if (k == "--bytes") a.bytes = std::stoull(v);
    else if (k == "--seed") a.seed = std::stoull(v);
    else if (k == "--consumers") a.consumers = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--go") a.go = v;
    else if (k == "--pause-sync") a.pause_sync = std::stoi(v);
    else if (k == "--resume") a.resume = v;
    else if (k == "--abort-sync") a.abort_sync = std::stoi(v);
    else if (k == "--empty-sync") a.empty_sync = std::stoi(v);
    else if (k == "--report") a.report = v;
    else if (k == "--wait-sync") a.wait_sync_s = std::stoi(v);
    else {
      std::fprintf(stderr, "relay_peer: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (a.report.empty()) return 2;
  try {
    if (a.role == "produce") return produce(a);
    if (a.role == "consume") return consume(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "relay_peer %s: %s\n", a.role.c_str(), e.what());
    return errc_exit(e);
  }
  return 2;
}
