// dump: receive the next sync as a consumer and write it as .safetensors.
//
// File layout (https://github.com/huggingface/safetensors):
//   8 bytes     N, little-endian u64: length of the JSON header
//   N bytes     JSON header, padded with spaces so 8 + N is a multiple of 8
//   the rest    tensor data, contiguous, in manifest (stream) order
//
// Memory stays bounded: visit() hands out zero-copy pieces of each slot;
// each piece is copied out of the mapping by guarded_copy (a region file
// truncated under dump is an error, not SIGBUS, and the file engine never
// reads the mapping) into one of a few fixed bounce buffers, which the file
// engine writes at the piece's place in the file.
//
// Nothing ends dump by a signal: SIGINT/SIGTERM/SIGHUP, the --timeout
// watchdog (SIGALRM) and a SIGBUS raised in library code all remove the
// temporary file, print a message (and the --json failure document) and
// _exit with a documented code.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string_view>
#include <unordered_map>

#include "commands.hpp"
#include "file_io.hpp"
#include "format.hpp"
#include "shmcast/files.hpp"
#include "shmcast/safetensors.hpp"

namespace shmcast::inspect {

namespace {

// ---- the temporary file, removed on any failure and by the last-words
// handlers below.
char g_tmp_path[4096];
volatile sig_atomic_t g_tmp_set = 0;

// Last words: what a handler prints and the code it exits with, prepared
// before the handlers are installed (a handler may only write(2) them).
struct LastWords {
  std::string err, out;  // stderr line; stdout JSON document (with --json)
  int code = kExitFailure;
};
enum Why { kInterrupted, kTimedOut, kBus, kWhyCount };
LastWords g_last[kWhyCount];

[[noreturn]] void last_words(Why why) {
  if (g_tmp_set) ::unlink(g_tmp_path);
  const LastWords& w = g_last[why];
  (void)!::write(STDERR_FILENO, w.err.data(), w.err.size());
  if (!w.out.empty()) (void)!::write(STDOUT_FILENO, w.out.data(), w.out.size());
  ::_exit(w.code);
}

void on_stop_signal(int) { last_words(kInterrupted); }
void on_alarm(int) { last_words(kTimedOut); }
void on_bus() { last_words(kBus); }

void prepare_last_words(const Common& c, double timeout_s) {
  auto set = [&](Why why, int code, const std::string& msg) {
    g_last[why].code = code;
    g_last[why].err = "shmcast-inspect dump: " + term_safe(msg) + "\n";
    g_last[why].out = c.json ? fail_json(c, "dump", code, msg) + "\n" : std::string();
  };
  set(kInterrupted, kExitInterrupted, "interrupted; the temporary file was removed");
  char t[64];
  std::snprintf(t, sizeof t, "%g", timeout_s);
  set(kTimedOut, kExitTimeout,
      std::string("--timeout ") + t + " s passed before the dump finished; the temporary file was removed");
  set(kBus, kExitDamaged,
      "the region file was truncated while dump was attached (SIGBUS); the temporary file was removed");
}

// The --timeout watchdog: SIGALRM ends dump whatever it is doing, kWatchdogGrace
// after the deadline. The library's own waits get the time left, so they
// normally end it first, with a more precise message and exit code (3 when
// the region never appeared); the watchdog catches anything that does not
// honour them.
constexpr double kWatchdogGrace = 1.0;
void arm_watchdog(double seconds) {
  struct sigaction sa {};
  sa.sa_handler = on_alarm;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGALRM, &sa, nullptr);
  struct itimerval it {};
  const double s = seconds > 1e-6 ? seconds : 1e-6;  // 0 would disarm
  it.it_value.tv_sec = static_cast<time_t>(s);
  it.it_value.tv_usec = static_cast<suseconds_t>((s - static_cast<double>(it.it_value.tv_sec)) * 1e6);
  if (it.it_value.tv_sec == 0 && it.it_value.tv_usec == 0) it.it_value.tv_usec = 1;
  ::setitimer(ITIMER_REAL, &it, nullptr);
}

void disarm_watchdog() {
  struct itimerval it {};
  ::setitimer(ITIMER_REAL, &it, nullptr);
}

struct TempFile {
  std::string path;
  int fd = -1;
  bool committed = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!path.empty() && !committed) ::unlink(path.c_str());
    g_tmp_set = 0;
  }
};

// safetensors dtype for a shmcast dtype, from fileio's table
// (safetensors::from_shmcast); false when safetensors has none (the tensor
// is then written as U8 bytes and its real dtype is recorded in the
// metadata).
bool safetensors_dtype(DType d, std::string* out) {
  const std::string_view name = safetensors::from_shmcast(d);
  *out = name.empty() ? std::string("U8") : std::string(name);
  return !name.empty();
}

int exit_for(Errc code) {
  switch (code) {
    case Errc::kNotFound: return kExitNotFound;
    case Errc::kTimeout: return kExitTimeout;
    case Errc::kCorrupt:
    case Errc::kVersionMismatch: return kExitDamaged;
    case Errc::kRegionFull: return kExitNoSpace;
    default: return kExitFailure;
  }
}

}  // namespace

int cmd_dump(const Common& c, const std::string& name, const std::string& out, double timeout_s, bool overwrite) {
  namespace fs = std::filesystem;
  if (int rc; !check_name(c, "dump", name, &rc)) return rc;
  if (out.empty()) return fail(c, "dump", kExitUsage, "--out is empty");

  const fs::path out_path = fs::absolute(fs::path(out));
  const fs::path out_dir = out_path.parent_path();
  struct stat st {};
  if (::stat(out_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return fail(c, "dump", kExitFailure, "output directory " + out_dir.string() + " does not exist");
  if (::access(out_dir.c_str(), W_OK) != 0)
    return fail(c, "dump", kExitFailure, "cannot write to " + out_dir.string() + ": " + std::strerror(errno));
  if (::lstat(out_path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return fail(c, "dump", kExitUsage, out_path.string() + " is a directory");
    if (!overwrite)
      return fail(c, "dump", kExitRefused, out_path.string() + " exists: pass --overwrite to replace it");
  }

  // A damaged or untrusted region will never deliver a sync we may use: say
  // so now instead of timing out. A missing one may still appear (the
  // producer may be restarting): the consumer waits for it, and the region
  // it opened is checked again below.
  auto refuse_region = [&](const probe::Region& r) {
    return fail(c, "dump", kExitDamaged, "region '" + name + "' is " + probe::state_name(r.state) + ": " + r.reason);
  };
  try {
    const probe::Region r = probe::probe_region(c.dir, name, probe::Options{});
    if (probe::state_is_damaged(r.state)) return refuse_region(r);
  } catch (const Error& e) {
    if (e.code() != Errc::kNotFound) return fail(c, "dump", kExitFailure, e.what());
  }

  // The library finds regions through $SHMCAST_DIR.
  ::setenv("SHMCAST_DIR", c.dir.c_str(), 1);
  prepare_last_words(c, timeout_s);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
  probe::set_bus_hook(on_bus);

  // --timeout bounds the whole dump: the library's waits get the time left,
  // and the watchdog ends anything that does not honour them.
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s));
  auto left = [&] {
    const auto l = deadline - std::chrono::steady_clock::now();
    return l.count() > 0 ? std::chrono::duration_cast<Duration>(l) : Duration(0);
  };
  arm_watchdog(timeout_s + kWatchdogGrace);
  // Every exit from here on reports once: the watchdog is disarmed first.
  auto bail = [&](int code, const std::string& message) {
    disarm_watchdog();
    return fail(c, "dump", code, message);
  };

  try {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    co.open_timeout = left();
    co.chunk_timeout = left();
    Consumer consumer = Consumer::open(name, co);
    // visit() hands slot bytes to this process's host code: a region of
    // device slots is refused now, before a sync is waited for.
    if (consumer.slot_memory() == SlotMemory::kDevice)
      throw Error(Errc::kUnsupported, "region '" + name + "' keeps its slots in GPU memory; dump reads slots on "
                                      "the host, so it cannot dump this region (a consumer that reads into host "
                                      "memory with read_into() can)");
    // The region may have appeared only now, or been replaced since the
    // probe above: check the file the name holds now.
    try {
      const probe::Region r = probe::probe_region(c.dir, name, probe::Options{});
      if (r.state == probe::State::kUntrustedOwner) {
        disarm_watchdog();
        return refuse_region(r);
      }
    } catch (const Error&) {
    }
    const SyncInfo& info = consumer.wait_sync(left());
    const auto t_sync = std::chrono::steady_clock::now();

    // safetensors names must be unique; no shmcast producer sends a name
    // twice, so a manifest that does is corrupt.
    {
      std::unordered_map<std::string_view, std::size_t> seen;
      seen.reserve(info.tensors.size());
      for (std::size_t i = 0; i < info.tensors.size(); ++i) {
        const auto [it, fresh] = seen.emplace(info.tensors[i].name, i);
        if (!fresh) {
          consumer.skip();
          return bail(kExitDamaged, "sync " + std::to_string(info.version) + " names tensor '" +
                                        info.tensors[i].name + "' twice (tensors " + std::to_string(it->second) +
                                        " and " + std::to_string(i) +
                                        "): the manifest is corrupt and a safetensors file cannot hold it");
        }
      }
    }

    // ---- the safetensors header
    json header;
    json meta;
    meta["format"] = "pt";
    meta["shmcast_version"] = std::to_string(kVersionMajor) + "." + std::to_string(kVersionMinor);
    meta["shmcast_region"] = name;
    meta["shmcast_sync_version"] = std::to_string(info.version);
    json substituted = json::object();
    std::vector<std::uint64_t> file_off(info.tensors.size());
    std::uint64_t data_bytes = 0;
    json tensors = json::object();
    for (std::size_t i = 0; i < info.tensors.size(); ++i) {
      const TensorInfo& t = info.tensors[i];
      if (t.name == "__metadata__") {
        consumer.skip();
        return bail(kExitFailure, "the sync has a tensor named __metadata__, which safetensors reserves");
      }
      std::string dt;
      std::vector<std::int64_t> shape = t.shape;
      if (!safetensors_dtype(t.dtype, &dt)) {
        const std::size_t es = dtype_size(t.dtype);
        if (es > 1) shape.push_back(static_cast<std::int64_t>(es));
        substituted[t.name] = json{{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}};
      }
      file_off[i] = data_bytes;
      json e;
      e["dtype"] = dt;
      e["shape"] = shape;
      e["data_offsets"] = json::array({data_bytes, data_bytes + t.nbytes});
      tensors[t.name] = e;
      data_bytes += t.nbytes;
    }
    if (!substituted.empty()) meta["shmcast_dtypes"] = substituted.dump();
    header["__metadata__"] = meta;
    for (auto& [k, v] : tensors.items()) header[k] = v;

    std::string htext;
    try {
      htext = header.dump();  // strict: names must be valid UTF-8
    } catch (const json::exception&) {
      consumer.skip();
      return bail(kExitFailure, "a tensor name is not valid UTF-8, which safetensors requires");
    }
    while ((8 + htext.size()) % 8 != 0) htext.push_back(' ');
    const std::uint64_t data_start = 8 + htext.size();
    const std::uint64_t file_bytes = data_start + data_bytes;

    // ---- free space first
    struct statvfs vfs {};
    if (::statvfs(out_dir.c_str(), &vfs) == 0) {
      const std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      if (avail < file_bytes) {
        consumer.skip();
        return bail(kExitNoSpace, out_dir.string() + " has " + human_bytes(avail) + " free; the dump needs " +
                                      human_bytes(file_bytes) + " (" + std::to_string(file_bytes) + " bytes)");
      }
    }

    // ---- temp file in the same directory, then rename (shmcast/files.hpp:
    // a new name, O_EXCL|O_NOFOLLOW, fchmod on the descriptor; the rename
    // replaces whatever is at the output name, never writes through it).
    TempFile tmp;
    const mode_t mask = ::umask(0);
    ::umask(mask);
    // No last-words handler between creating the file and recording its name.
    sigset_t block, saved;
    sigemptyset(&block);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGALRM}) sigaddset(&block, sig);
    ::sigprocmask(SIG_BLOCK, &block, &saved);
    std::string create_error;
    try {
      std::string path;
      tmp.fd = shmcast::create_temp_file(out_dir.string(), "." + out_path.filename().string() + ".tmp.", 0666 & ~mask,
                                         &path);
      tmp.path = std::move(path);
      if (tmp.path.size() < sizeof g_tmp_path) {
        std::memcpy(g_tmp_path, tmp.path.c_str(), tmp.path.size() + 1);
        g_tmp_set = 1;
      }
    } catch (const Error& e) {
      create_error = e.what();
    }
    ::sigprocmask(SIG_SETMASK, &saved, nullptr);
    if (tmp.fd < 0) {
      consumer.skip();
      return bail(kExitFailure, "cannot create a temporary file in " + out_dir.string() + ": " + create_error);
    }
    const int fa = ::posix_fallocate(tmp.fd, 0, static_cast<off_t>(file_bytes));
    if (fa == ENOSPC || fa == EFBIG) {
      consumer.skip();
      return bail(kExitNoSpace,
                  "not enough space for " + std::to_string(file_bytes) + " bytes in " + out_dir.string());
    }

    // Everything goes out through the file engine: io_uring where the kernel
    // and seccomp allow it (Docker's default profile does not), else pwrite.
    // It writes the header, then the tensors from the bounce buffers, never
    // from the mapping; a buffer is reused only after a flush() has completed
    // every write queued from it.
    shmcast::detail::FileWriter writer;
    if (const int rc = writer.attach(tmp.fd); rc != 0)
      return bail(kExitFailure, std::string("output file: ") + std::strerror(-rc));
    auto check = [&](int rc) {
      if (rc != 0)
        throw Error(rc == -ENOSPC ? Errc::kRegionFull : Errc::kSystem,
                    std::string("writing the output file: ") + std::strerror(-rc), -rc);
    };
    unsigned char len_le[8];
    for (int b = 0; b < 8; ++b) len_le[b] = static_cast<unsigned char>(std::uint64_t{htext.size()} >> (8 * b));
    check(writer.write_at(len_le, 8, 0));
    check(writer.write_at(htext.data(), htext.size(), 8));

    std::vector<std::uint64_t> written(info.tensors.size(), 0);
    constexpr std::size_t kBounceBytes = 4u << 20;
    constexpr std::size_t kBounces = 4;
    const std::unique_ptr<std::byte[]> bounce(new std::byte[kBounceBytes * kBounces]);
    std::size_t next_bounce = 0;
    consumer.visit([&](const Piece& p) {
      if (p.bytes == 0) return;
      if (p.tensor >= info.tensors.size() || p.offset + p.bytes > info.tensors[p.tensor].nbytes)
        throw Error(Errc::kCorrupt, "a piece falls outside its tensor");
      const std::byte* src = p.data;
      std::uint64_t off = data_start + file_off[p.tensor] + p.offset;
      for (std::uint64_t n = p.bytes; n > 0;) {
        const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(n, kBounceBytes));
        if (next_bounce == kBounces) {
          check(writer.flush());
          next_bounce = 0;
        }
        std::byte* buf = bounce.get() + kBounceBytes * next_bounce++;
        if (!probe::guarded_copy(buf, src, take))
          throw Error(Errc::kCorrupt, "the region file was truncated while dump read tensor '" +
                                          info.tensors[p.tensor].name + "' from it");
        check(writer.write_at(buf, take, off));
        src += take;
        off += take;
        n -= take;
      }
      written[p.tensor] += p.bytes;
    });
    check(writer.flush());
    const std::string io_backend = writer.backend();
    const std::string io_fallback = writer.fallback_reason();
    writer.close();
    for (std::size_t i = 0; i < info.tensors.size(); ++i)
      if (written[i] != info.tensors[i].nbytes)
        return bail(kExitFailure, "tensor '" + info.tensors[i].name + "' got " + std::to_string(written[i]) + " of " +
                                      std::to_string(info.tensors[i].nbytes) + " bytes");
    const std::uint64_t version = info.version;
    const std::size_t ntensors = info.tensors.size();
    const std::uint64_t payload = info.payload_bytes;
    consumer.close();  // leave the seat: the producer need not wait for us

    if (::ftruncate(tmp.fd, static_cast<off_t>(file_bytes)) != 0 || ::fsync(tmp.fd) != 0)
      return bail(kExitFailure, std::string("flushing the output file: ") + std::strerror(errno));
    ::close(tmp.fd);
    tmp.fd = -1;
    // The last point the watchdog may remove the file: after the rename it
    // is the user's.
    disarm_watchdog();
    probe::set_bus_hook(nullptr);
    if (::rename(tmp.path.c_str(), out_path.c_str()) != 0)
      return bail(kExitFailure, "rename to " + out_path.string() + ": " + std::strerror(errno));
    g_tmp_set = 0;
    tmp.committed = true;
    const int dfd = ::open(out_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
    const auto t1 = std::chrono::steady_clock::now();
    const double wait_s = std::chrono::duration<double>(t_sync - t0).count();
    const double write_s = std::chrono::duration<double>(t1 - t_sync).count();
    if (c.json) {
      json j = doc("dump");
      j["dir"] = c.dir;
      j["exit_code"] = 0;
      j["name"] = name;
      j["out"] = out_path.string();
      j["sync_version"] = version;
      j["tensor_count"] = ntensors;
      j["payload_bytes"] = payload;
      j["header_bytes"] = htext.size();
      j["file_bytes"] = file_bytes;
      j["substituted_dtypes"] = substituted.size();
      j["wait_s"] = wait_s;
      j["write_s"] = write_s;
      j["io_backend"] = io_backend;
      j["io_fallback_reason"] = io_fallback;
      print_json(j);
    } else {
      std::cout << "wrote " << term_safe(out_path.string()) << ": sync " << version << " of '" << term_safe(name)
                << "', " << ntensors << " tensors, " << human_bytes(payload) << " (file " << human_bytes(file_bytes)
                << ") in " << write_s << " s after waiting " << wait_s << " s, through " << io_backend
                << (io_fallback.empty() ? "" : " (" + io_fallback + ")") << "\n";
      if (!substituted.empty())
        std::cout << substituted.size()
                  << " tensor(s) have no safetensors dtype and were written as U8; see __metadata__.shmcast_dtypes\n";
    }
    return kExitOk;
  } catch (const Error& e) {
    return bail(exit_for(e.code()), e.what());
  }
}

}  // namespace shmcast::inspect
