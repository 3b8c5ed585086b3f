// shmcast-publish: load a safetensors checkpoint from disk and publish it as
// one sync of a shmcast region (docs/publish.md).
//
//   shmcast-publish CHECKPOINT --region NAME [--wait-consumers N] [--repeat N] ...
//   shmcast-publish CHECKPOINT --list            validate and list, no region
//
// CHECKPOINT is a .safetensors file, a directory with
// model.safetensors.index.json and its shards (or one model.safetensors), or
// the index file itself. Every header is validated before a byte of tensor
// data is read. Reads go through io_uring (O_DIRECT where the file system
// allows it and the file is not already in the page cache), and through
// pread(2) where io_uring is denied (Docker's and Podman's seccomp profiles).
#include <signal.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "shmcast/safetensors.hpp"
#include "shmcast/shmcast.hpp"

using json = nlohmann::json;
namespace st = shmcast::safetensors;
using shmcast::Errc;

namespace {

enum Exit {
  kOk = 0,
  kFailure = 1,
  kUsage = 2,
  kNotFound = 3,
  kInvalid = 4,
  kExists = 5,
  kTimedOut = 6,
  kNoSpace = 7,
  kInterrupted = 130,
};

const char* kFooter = R"(CHECKPOINT: a .safetensors file; a directory holding model.safetensors.index.json
and its shards (or a single model.safetensors); or the index file itself. Shards
must be plain files in the index's directory: a symlinked shard is refused unless
--allow-symlinks (a Hugging Face cache snapshot links its files into ../../blobs).

--io: auto (io_uring; O_DIRECT for files not in the page cache, buffered for cached
ones; pread where io_uring is denied or SHMCAST_NO_URING=1), direct, buffered, pread.

Exit codes:
  0    success
  1    failure (I/O error, region error)
  2    usage error
  3    the checkpoint (or a shard it names) does not exist
  4    the checkpoint is invalid (a header, the index, or a tensor shmcast cannot carry)
  5    the region name is taken by a live producer
  6    timed out waiting for consumers (--wait-consumers) or for them to finish (--drain-timeout)
  7    not enough room in the region directory
  130  interrupted (SIGINT/SIGTERM): the sync in progress is aborted, the region removed)";

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

CLI::Validator number(double lo, double hi, bool whole) {
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return "'" + in + "' is not a number";
        if (!std::isfinite(v)) return "must be a finite number, not '" + in + "'";
        if (v < lo || v > hi) return "must be between " + std::to_string(lo) + " and " + std::to_string(hi);
        if (whole && v != std::floor(v)) return "must be a whole number, not " + in;
        return {};
      },
      whole ? "INT" : "NUMBER");
}

int exit_for(const shmcast::Error& e) {
  switch (e.code()) {
    case Errc::kNotFound: return kNotFound;
    case Errc::kCorrupt: return kInvalid;
    case Errc::kExists: return kExists;
    case Errc::kTimeout: return kTimedOut;
    case Errc::kRegionFull: return kNoSpace;
    case Errc::kAborted: return g_stop.load() ? kInterrupted : kFailure;
    default: return kFailure;
  }
}

std::string human(std::uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  else if (b >= (1ull << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1ull << 20));
  else
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

json io_json(const st::ReadStats& r) {
  return json{{"path", r.path},
              {"fallback_reason", r.fallback_reason},
              {"bytes", r.bytes},
              {"direct_bytes", r.direct_bytes},
              {"requests", r.requests},
              {"registered_buffers", r.registered_buffers},
              {"queue_depth", r.queue_depth},
              {"staging_bytes", r.staging_bytes},
              {"seconds", r.seconds}};
}

int fail(bool as_json, int code, const std::string& msg) {
  std::cerr << "shmcast-publish: " << msg << "\n";
  if (as_json)
    std::cout << json{{"schema", 1}, {"command", "publish"}, {"ok", false}, {"exit_code", code}, {"error", msg}}
                     .dump(-1, ' ', false, json::error_handler_t::replace)
              << std::endl;
  return code;
}

int list(const st::Checkpoint& c, bool as_json) {
  if (as_json) {
    json files = json::array();
    for (const st::CheckpointFile& f : c.files())
      files.push_back({{"path", f.path},
                       {"file_bytes", f.header.file_bytes},
                       {"header_bytes", f.header.header_bytes},
                       {"metadata", f.header.metadata}});
    json tensors = json::array();
    for (const st::TensorEntry& t : c.tensors())
      tensors.push_back({{"name", t.name},
                         {"dtype", t.dtype},
                         {"shape", t.shape},
                         {"nbytes", t.nbytes},
                         {"file", t.file},
                         {"offset", t.offset}});
    std::cout << json{{"schema", 1},        {"command", "list"},         {"ok", true},
                      {"checkpoint", c.path()}, {"sharded", c.sharded()}, {"payload_bytes", c.payload_bytes()},
                      {"files", files},     {"tensors", tensors}}
                     .dump(-1, ' ', false, json::error_handler_t::replace)
              << std::endl;
    return kOk;
  }
  for (const st::TensorEntry& t : c.tensors()) {
    std::string shape = "[";
    for (std::size_t d = 0; d < t.shape.size(); ++d) shape += (d ? ", " : "") + std::to_string(t.shape[d]);
    shape += "]";
    std::cout << json(t.name).dump(-1, ' ', false, json::error_handler_t::replace) << "  " << t.dtype << "  "
              << shape << "  " << t.nbytes << " B  file " << t.file << " @ " << t.offset << "\n";
  }
  std::cout << c.tensors().size() << " tensors, " << human(c.payload_bytes()) << " in " << c.files().size()
            << " file(s); every header is valid\n";
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmcast-publish: load a safetensors checkpoint and publish it as one sync of a shmcast region",
               "shmcast-publish"};
  app.footer(kFooter);
  app.set_version_flag("--version", "shmcast-publish " + std::to_string(shmcast::kVersionMajor) + "." +
                                        std::to_string(shmcast::kVersionMinor));
  std::string path, region, dir, io = "auto", pin = "no";
  bool as_json = false, do_list = false, allow_symlinks = false, checksums = false, no_register = false,
       drop_cache = false, store = false, keep = false;
  double slot_mb = 256, window_mb = 64, request_kb = 1024, wait_timeout = 60, drain_timeout = 60,
         consumer_timeout = 60, interval = 0;
  std::uint32_t slots = 2, max_consumers = 8, wait_consumers = 0, queue_depth = 32, windows = 3, pread_threads = 4;
  std::uint64_t repeat = 1, manifest_bytes = 0;
  app.add_option("CHECKPOINT", path, "A .safetensors file, a checkpoint directory, or its index.json")->required();
  app.add_option("--region,-r", region, "Region to create and publish into");
  app.add_flag("--list", do_list, "Validate the checkpoint and list its tensors; no region");
  app.add_option("--dir", dir, "Region directory (default: $SHMCAST_DIR, else /dev/shm)");
  app.add_option("--slot-mb", slot_mb, "Slot size in MiB (rounded up to 2 MiB)")
      ->check(number(2, 65536, false))
      ->capture_default_str();
  app.add_option("--slots", slots, "Slots (K >= 2)")->check(number(2, 4096, true))->capture_default_str();
  app.add_option("--max-consumers", max_consumers, "Consumer seats")->check(number(1, 64, true))->capture_default_str();
  app.add_option("--manifest-bytes", manifest_bytes, "Manifest room; 0: what the checkpoint needs (>= 1 MiB)")
      ->check(number(0, 1ull << 30, true));
  app.add_flag("--checksums", checksums, "XXH3 per slot, verified by consumers");
  app.add_flag("--store", store,
               "Create a store region: it keeps the checkpoint for consumers that come at any time (two versions' "
               "room: 2 x the checkpoint, pinned with --pin); --slot-mb and --slots are ignored");
  app.add_flag("--keep", keep,
               "Leave the region's name in place at exit: a store region stays readable after the tool is gone "
               "(remove it with shmcast-inspect rm)");
  app.add_option("--pin", pin, "Pin the region with cudaHostRegister: no, yes, auto")
      ->check(CLI::IsMember({"no", "yes", "auto"}))
      ->capture_default_str();
  app.add_option("--wait-consumers", wait_consumers, "Before each sync, wait for this many consumers")
      ->check(number(0, 64, true))
      ->capture_default_str();
  app.add_option("--wait-timeout", wait_timeout, "Seconds to wait for them")
      ->check(number(0, 604800, false))
      ->capture_default_str();
  app.add_option("--drain-timeout", drain_timeout,
                 "After each sync, seconds to wait until every consumer has read it (0: do not wait)")
      ->check(number(0, 604800, false))
      ->capture_default_str();
  app.add_option("--consumer-timeout", consumer_timeout, "Seconds a live consumer may hold back a slot")
      ->check(number(0.001, 604800, false))
      ->capture_default_str();
  app.add_option("--repeat", repeat, "Syncs to publish (the checkpoint is read again for each); 0: until SIGINT/SIGTERM (with --wait-consumers, a new sync as soon as that many are attached; pace it with --interval)")
      ->check(number(0, 1e12, true))
      ->capture_default_str();
  app.add_option("--interval", interval, "Seconds between syncs")->check(number(0, 86400, false))->capture_default_str();
  app.add_option("--io", io, "Read path: auto, direct, buffered, pread")
      ->check(CLI::IsMember({"auto", "direct", "buffered", "pread"}))
      ->capture_default_str();
  app.add_option("--queue-depth", queue_depth, "io_uring reads in flight")->check(number(1, 4096, true))->capture_default_str();
  app.add_option("--request-kb", request_kb, "Size of one read in KiB (a power of two, 4..65536)")
      ->check(number(4, 65536, true))
      ->capture_default_str();
  app.add_option("--window-mb", window_mb, "Staging window in MiB (a tensor larger than this is read into a buffer of its own)")
      ->check(number(1, 65536, false))
      ->capture_default_str();
  app.add_option("--windows", windows, "Staging windows (reads run ahead of the copies into the region by up to this many)")
      ->check(number(2, 64, true))
      ->capture_default_str();
  app.add_option("--pread-threads", pread_threads, "Threads for --io pread (and the fallback)")
      ->check(number(1, 64, true))
      ->capture_default_str();
  app.add_flag("--no-register-buffers", no_register, "Do not register the staging windows with io_uring");
  app.add_flag("--allow-symlinks", allow_symlinks, "Follow shards that are symbolic links");
  app.add_flag("--drop-cache", drop_cache,
               "Before each sync, drop the checkpoint's files from the page cache (posix_fadvise DONTNEED): "
               "every sync reads from the disk (benchmarks)");
  app.add_flag("--json", as_json, "Print one JSON document per sync on stdout (docs/publish.md)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kOk : kUsage;
  }
  if (!do_list && region.empty()) return fail(as_json, kUsage, "--region NAME is required (or --list)");
  if (!region.empty()) {
    const std::string why = shmcast::validate_name(region);
    if (!why.empty()) return fail(as_json, kUsage, why + ": '" + region + "'");
  }
  const auto req = static_cast<std::uint64_t>(request_kb) << 10;
  if (req & (req - 1)) return fail(as_json, kUsage, "--request-kb must be a power of two");
  if (!dir.empty()) ::setenv("SHMCAST_DIR", dir.c_str(), 1);

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESETHAND;  // a second signal ends the process
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  using namespace std::chrono;
  auto dur = [](double s) { return duration_cast<shmcast::Duration>(duration<double>(s)); };
  try {
    st::OpenOptions oo;
    oo.allow_symlinks = allow_symlinks;
    const auto t_open = steady_clock::now();
    st::Checkpoint ckpt = st::open_checkpoint(path, oo);
    const double open_s = duration<double>(steady_clock::now() - t_open).count();
    if (do_list) return list(ckpt, as_json);
    (void)ckpt.specs();  // refuse a tensor shmcast cannot carry before creating the region

    shmcast::ProducerOptions po;
    po.slot_bytes = static_cast<std::uint64_t>(slot_mb * (1 << 20));
    po.slots = slots;
    po.max_consumers = max_consumers;
    po.manifest_bytes = std::max(manifest_bytes, st::manifest_bytes_for(ckpt));
    po.checksums = checksums;
    po.consumer_timeout = dur(consumer_timeout);
    po.pin = pin == "yes" ? shmcast::Pin::kYes : pin == "auto" ? shmcast::Pin::kAuto : shmcast::Pin::kNo;
    po.engine = shmcast::CopyEngine::kHost;
    po.unlink_on_close = !keep;
    if (store) {
      po.mode = shmcast::RegionMode::kStore;
      po.store_bytes = shmcast::store_bytes_needed(ckpt.specs());
    }
    shmcast::Producer prod = shmcast::Producer::create(region, po);

    st::PublishOptions opt;
    opt.read.path = io == "direct"     ? st::IoPath::kDirect
                    : io == "buffered" ? st::IoPath::kBuffered
                    : io == "pread"    ? st::IoPath::kPread
                                       : st::IoPath::kAuto;
    opt.read.queue_depth = queue_depth;
    opt.read.request_bytes = req;
    opt.read.window_bytes = static_cast<std::uint64_t>(window_mb * (1 << 20));
    opt.read.windows = windows;
    opt.read.pread_threads = pread_threads;
    opt.read.register_buffers = !no_register;
    opt.drain_timeout = shmcast::Duration(0);  // drained below, in slices that notice a signal
    opt.stop = &g_stop;
    // One Reader for every sync: its ring, staging windows and their
    // registration are set up once.
    st::Reader reader(opt.read);

    for (std::uint64_t n = 0; repeat == 0 || n < repeat; ++n) {
      if (g_stop.load()) return fail(as_json, kInterrupted, "interrupted");
      if (n > 0 && interval > 0) {
        const auto until = steady_clock::now() + dur(interval);
        while (!g_stop.load() && steady_clock::now() < until) std::this_thread::sleep_for(milliseconds(20));
        if (g_stop.load()) return fail(as_json, kInterrupted, "interrupted");
      }
      // Wait for consumers in slices, so that a signal is noticed.
      const auto t_wait = steady_clock::now();
      if (wait_consumers > 0 && prod.consumers() < wait_consumers) {
        // Scripts (and the tests) wait for this line: the region is ready.
        std::cerr << "shmcast-publish: region '" << region << "' is ready (" << prod.path() << "); waiting for "
                  << wait_consumers << " consumer(s)" << std::endl;
        const auto deadline = t_wait + dur(wait_timeout);
        while (prod.consumers() < wait_consumers) {
          if (g_stop.load()) return fail(as_json, kInterrupted, "interrupted");
          const auto left = deadline - steady_clock::now();
          if (left <= steady_clock::duration::zero())
            return fail(as_json, kTimedOut,
                        std::to_string(prod.consumers()) + " of " + std::to_string(wait_consumers) +
                            " consumers attached to '" + region + "' within --wait-timeout " +
                            std::to_string(wait_timeout) + " s: start them, or raise --wait-timeout");
          try {
            prod.wait_for_consumers(wait_consumers, std::min<shmcast::Duration>(left, milliseconds(100)));
          } catch (const shmcast::Error& e) {
            if (e.code() != Errc::kTimeout) throw;
          }
        }
      }
      const double wait_s = duration<double>(steady_clock::now() - t_wait).count();
      if (drop_cache) st::drop_page_cache(ckpt);
      st::PublishStats s = st::publish(prod, ckpt, opt, &reader);
      s.wait_s = wait_s;
      const auto t_drain = steady_clock::now();
      if (drain_timeout > 0 && s.consumers > 0) {
        const auto deadline = t_drain + dur(drain_timeout);
        for (;;) {
          try {
            prod.wait_drained(std::min<shmcast::Duration>(
                std::max<shmcast::Duration>(deadline - steady_clock::now(), shmcast::Duration(0)), milliseconds(100)));
            break;
          } catch (const shmcast::Error& e) {
            if (e.code() != Errc::kTimeout) throw;
          }
          if (g_stop.load()) return fail(as_json, kInterrupted, "interrupted");
          if (steady_clock::now() >= deadline)
            return fail(as_json, kTimedOut,
                        "the consumers of sync " + std::to_string(s.version) + " did not finish within --drain-timeout " +
                            std::to_string(drain_timeout) + " s");
        }
      }
      s.drain_s = duration<double>(steady_clock::now() - t_drain).count();
      const double gbps = s.publish_s > 0 ? static_cast<double>(s.payload_bytes) / s.publish_s / 1e9 : 0;
      for (const std::string& ev : prod.take_events()) std::cerr << "shmcast-publish: " << ev << "\n";
      if (as_json) {
        std::cout << json{{"schema", 1},
                          {"command", "publish"},
                          {"ok", true},
                          {"exit_code", 0},
                          {"checkpoint", ckpt.path()},
                          {"region", region},
                          {"region_path", prod.path()},
                          {"mode", store ? "store" : "ring"},
                          {"files", ckpt.files().size()},
                          {"tensors", s.tensors},
                          {"payload_bytes", s.payload_bytes},
                          {"version", s.version},
                          {"consumers", s.consumers},
                          {"open_s", open_s},
                          {"wait_s", s.wait_s},
                          {"publish_s", s.publish_s},
                          {"drain_s", s.drain_s},
                          {"gbps", gbps},
                          {"slot_bytes", prod.slot_bytes()},
                          {"slots", prod.slots()},
                          {"io", io_json(s.read)}}
                         .dump(-1, ' ', false, json::error_handler_t::replace)
                  << std::endl;
      } else {
        std::cout << "published sync " << s.version << " of '" << region << "': " << s.tensors << " tensors, "
                  << human(s.payload_bytes) << " from " << ckpt.files().size() << " file(s) in " << s.publish_s
                  << " s (" << gbps << " GB/s) through " << s.read.path
                  << (s.read.path == "pread" ? "" : " io_uring") << ", qd " << s.read.queue_depth
                  << (s.read.registered_buffers ? ", registered buffers" : "") << ", staging "
                  << human(s.read.staging_bytes);
        if (!s.read.fallback_reason.empty()) std::cout << " (" << s.read.fallback_reason << ")";
        if (s.consumers > 0) std::cout << "; " << s.consumers << " consumer(s) done " << s.drain_s << " s later";
        std::cout << std::endl;
      }
    }
    return kOk;
  } catch (const shmcast::Error& e) {
    return fail(as_json, exit_for(e), e.what());
  } catch (const std::exception& e) {
    return fail(as_json, kFailure, e.what());
  }
}
