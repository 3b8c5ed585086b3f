// shmcast relay: the network thread (UCX: listener, connections, chunk
// fan-out), the source reader (a Consumer of the source region, sending
// slots in place) and the region writer (the Producer of a downstream
// node's region). docs/relay.md describes the protocol and the faults.
#include "shmcast/relay.hpp"

#include "shmcast/files.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "admission.hpp"
#include "auth.hpp"
#include "base/clock.hpp"
#include "base/sys.hpp"
#include "base/text.hpp"
#include "ctrl.hpp"
#include "ratelog.hpp"
#include "ucx.hpp"
#include "wire.hpp"

namespace shmcast::relay {

using namespace std::chrono_literals;
using detail::coarse_bytes;
using detail::mono_ns;
using detail::retry_eintr;
using detail::unix_ns;
using wire::SyncPlan;
using wire::Type;
using wire::Writer;

namespace {

std::string fmt_gbs(std::uint64_t bytes, double seconds) {
  char b[64];
  std::snprintf(b, sizeof b, "%.3f GB/s", seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0);
  return b;
}
// Slot sizes are multiples of kDataAlign (Producer::create rounds them up).
std::uint64_t align_slot(std::uint64_t n) {
  return (n + limits::kDataAlign - 1) / limits::kDataAlign * limits::kDataAlign;
}

struct Op;
// An endpoint failure, as the error handler reports it.
struct EpFailure {
  std::uint64_t conn;  // 0: upstream
  std::uint64_t gen;   // upstream connection generation
  ucs_status_t status;
};
// Where UCX callbacks file what happened, for the network thread. They run on
// a worker's progress thread (threaded workers) or on the network thread
// itself; `wake` tells the network thread.
struct Sink {
  std::mutex mu;
  std::vector<Op*> completed;
  std::vector<EpFailure> failures;
  // Data connections to a downstream's listener: (connection id, request).
  std::vector<std::pair<std::uint64_t, ucp_conn_request_h>> conns;
  bool empty() {
    std::lock_guard<std::mutex> g(mu);
    return completed.empty() && failures.empty() && conns.empty();
  }
};
// A downstream's data listener's argument; outlives the listener.
struct ListenArg {
  Sink* sink;
  std::uint64_t conn;
};
void on_data_conn(ucp_conn_request_h req, void* arg) {
  auto* a = static_cast<ListenArg*>(arg);
  std::lock_guard<std::mutex> g(a->sink->mu);
  a->sink->conns.emplace_back(a->conn, req);
}

// One UCX request and what the network thread needs to finish it.
struct Op {
  enum Kind : std::uint8_t { kDataSend, kDataRecv, kJunkRecv, kClose };
  Kind kind = kDataSend;
  Sink* sink = nullptr;  // where the callback files it
  ucp_worker_h worker = nullptr;
  void* req = nullptr;
  ucs_status_t status = UCS_INPROGRESS;
  std::atomic<bool> done{false};
  std::uint64_t conn = 0;  // downstream connection; 0: the upstream one
  std::uint64_t gen = 0;   // upstream connection generation
  std::uint64_t ord = 0;   // kDataSend: the fan-out fragment's ordinal (Impl::fan)
  int buf = -1;            // receive buffer
  std::uint32_t chunk = 0;
  std::uint32_t frag = 0;     // fragment of the chunk
  std::size_t pos = 0;        // position in the plan's data_chunks
  std::uint64_t serial = 0;   // the incoming sync it belongs to (In::serial)
  std::uint64_t version = 0, bytes = 0;
  std::size_t length = 0;
  std::uint64_t sender_tag = 0;
  ucp_tag_recv_info_t info{};  // filled by UCX when a receive completes at once
  std::vector<std::uint8_t> msg;
};

void op_send_cb(void*, ucs_status_t st, void* user) {
  auto* op = static_cast<Op*>(user);
  std::lock_guard<std::mutex> g(op->sink->mu);
  op->status = st;
  op->done.store(true, std::memory_order_release);
  op->sink->completed.push_back(op);
}
void op_recv_cb(void*, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
  auto* op = static_cast<Op*>(user);
  std::lock_guard<std::mutex> g(op->sink->mu);
  op->status = st;
  if (info) {
    op->length = info->length;
    op->sender_tag = info->sender_tag;
  }
  op->done.store(true, std::memory_order_release);
  op->sink->completed.push_back(op);
}

// Every endpoint's error handler argument; freed after the endpoint.
struct EpArg {
  Sink* sink;
  std::uint64_t conn;
  std::uint64_t gen;
};
void ep_error_cb(void* arg, ucp_ep_h, ucs_status_t st) {
  auto* a = static_cast<EpArg*>(arg);
  std::lock_guard<std::mutex> g(a->sink->mu);
  a->sink->failures.push_back(EpFailure{a->conn, a->gen, st});
}

// A receive buffer of one chunk (middle and leaf nodes).
struct Buffer {
  std::byte* p = nullptr;
  std::size_t cap = 0;
  ucx::Registration reg;
  int refs = 0;  // 0: free
};

// How many UCX operations (receives, forwarding sends) use each slot of
// this node's region, shared by the network thread, which counts, and the
// region writer, which lends a slot (or recreates the region) only once
// nothing reads or writes the old bytes any more.
class SlotUse {
 public:
  void add(const std::byte* p, int n) {
    std::lock_guard<std::mutex> g(mu_);
    refs_[p] += n;
    if (refs_[p] <= 0) {
      refs_.erase(p);
      cv_.notify_all();
    }
  }
  // False when `p` (nullptr: every slot) was still in use at the deadline
  // or once stop() was called.
  bool wait_free(const std::byte* p, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> g(mu_);
    const bool free = cv_.wait_until(g, deadline, [&] { return stop_ || (p ? refs_.count(p) == 0 : refs_.empty()); });
    return free && (p ? refs_.count(p) == 0 : refs_.empty());
  }
  void stop() {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<const std::byte*, int> refs_;
  bool stop_ = false;
};

// A downstream relay connected to our listener.
struct Down {
  // kJoining: it proved the key; its data connection is awaited.
  enum State { kHandshake, kJoining, kReady, kActive, kClosing };
  std::uint64_t id = 0;  // never reused (64 bits)
  CtrlSocket sock;       // its control channel: every message on it is this connection's
  // Its data connection: a UCX listener of its own, opened once it proved
  // the key and closed once it connected (the endpoint).
  ucp_listener_h listener = nullptr;
  std::unique_ptr<ListenArg> larg;
  ucp_ep_h ep = nullptr;
  bool ep_closing = false;
  std::int64_t closing_ns = 0;
  std::unique_ptr<EpArg> arg;
  std::string peer;
  std::string source;    // the peer's address without the port (its data connection comes from it)
  bool pending = false;  // counted by the listener's Admission (handshake not done)
  State state = kHandshake;
  auth::Transcript tr;
  std::string session;
  std::uint64_t send_seq = 0;
  std::int64_t deadline_ns = 0;
  std::int64_t first_deadline_ns = 0;  // for its response to the challenge (kHandshake)
  std::int64_t since_unix_ns = 0;
  std::uint64_t version = 0;  // sync it takes part in (kActive)
  std::uint64_t frags_sent = 0;  // of the sync in progress
  std::uint32_t tag_base = 0;    // of its data tags (auth::data_tag_base)
  std::uint64_t syncs_begun = 0; // sync messages sent on this connection
  std::uint32_t serial = 0;      // the data tag serial of the sync in progress
  int pending_data = 0;
  std::set<std::uint64_t> pend;  // fan-out ordinals of its sends in flight (Impl::fan)
  std::int64_t progress_ns = 0;
  std::uint64_t bytes_sent = 0, syncs = 0;
};

// A thread that computes XXH3-64 of one buffer at a time while the region
// writer copies it: the writer's per-chunk cost is then the slower of the
// two passes, not their sum.
class Hasher {
 public:
  Hasher() : t_([this] { run(); }) {}
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  ~Hasher() {
    {
      std::lock_guard<std::mutex> g(mu_);
      exit_ = true;
    }
    cv_.notify_all();
    t_.join();
  }
  // Starts hashing [p, p + n); the caller must wait() before the bytes may
  // go (Job does it on every path). A job still running is waited for first.
  void start(const std::byte* p, std::uint64_t n) {
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return !busy_; });
      p_ = p;
      n_ = n;
      busy_ = true;
    }
    cv_.notify_all();
  }
  // A hash in flight over a buffer: the destructor waits for it, so no path
  // (an exception from the copy included) hands the buffer back while it is
  // still being read.
  class Job {
   public:
    Job(Hasher& h, const std::byte* p, std::uint64_t n) : h_(h) { h_.start(p, n); }
    Job(const Job&) = delete;
    Job& operator=(const Job&) = delete;
    ~Job() {
      if (!done_) (void)h_.wait();
    }
    std::uint64_t sum() {
      done_ = true;
      return h_.wait();
    }

   private:
    Hasher& h_;
    bool done_ = false;
  };
  std::uint64_t wait() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [this] { return !busy_; });
    return sum_;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [this] { return busy_ || exit_; });
      if (exit_) return;
      const std::byte* p = p_;
      const std::uint64_t n = n_;
      g.unlock();
      const std::uint64_t sum = XXH3_64bits(p, n);
      g.lock();
      sum_ = sum;
      busy_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  const std::byte* p_ = nullptr;
  std::uint64_t n_ = 0, sum_ = 0;
  bool busy_ = false, exit_ = false;
  std::thread t_;
};

// UCX's own warnings and errors, at most kUcxBurst per source line and 10 s
// (a peer can make UCX log at will: a refused connection, a malformed
// packet, a message for an id nothing handles). Process-wide, once.
constexpr int kUcxBurst = 5;
constexpr std::int64_t kUcxWindowNs = 10'000'000'000;
struct UcxLogSite {
  std::int64_t window_start = 0;
  int printed = 0;
  std::uint64_t held = 0;
};
std::mutex g_ucx_log_mu;
std::map<std::pair<std::string, unsigned>, UcxLogSite>* g_ucx_log_sites = nullptr;

ucs_log_func_rc_t ucx_log_limiter(const char* file, unsigned line, const char*, ucs_log_level_t level,
                                  const ucs_log_component_config_t*, const char*, va_list) {
  if (level > UCS_LOG_LEVEL_WARN) return UCS_LOG_FUNC_RC_CONTINUE;  // diagnostics someone asked for
  const std::int64_t now = mono_ns();
  std::lock_guard<std::mutex> g(g_ucx_log_mu);
  UcxLogSite& site = (*g_ucx_log_sites)[{file ? file : "?", line}];
  if (now - site.window_start >= kUcxWindowNs) {
    if (site.held > 0)
      std::fprintf(stderr, "shmcast-relay: %llu more UCX messages from %s:%u left out in the last 10 s\n",
                   static_cast<unsigned long long>(site.held), file ? file : "?", line);
    site = UcxLogSite{now, 0, 0};
  }
  if (site.printed < kUcxBurst) {
    ++site.printed;
    return UCS_LOG_FUNC_RC_CONTINUE;  // UCX's handler prints it
  }
  ++site.held;
  return UCS_LOG_FUNC_RC_STOP;
}

void limit_ucx_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_ucx_log_sites = new std::map<std::pair<std::string, unsigned>, UcxLogSite>();  // lives as long as UCX may log
    ucs_log_push_handler(ucx_log_limiter);
  });
}

const char* state_name(Down::State s) {
  switch (s) {
    case Down::kHandshake: return "handshake";
    case Down::kJoining: return "joining";
    case Down::kReady: return "ready";
    case Down::kActive: return "active";
    case Down::kClosing: return "closing";
  }
  return "?";
}

}  // namespace

// ---------------------------------------------------------------- addresses, keys

std::string Address::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

Address parse_address(std::string_view s) {
  Address a;
  std::string_view host, port;
  if (!s.empty() && s.front() == '[') {
    const auto close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':')
      throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use [V6ADDR]:PORT");
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    const auto colon = s.rfind(':');
    if (colon == std::string_view::npos || s.find(':') != colon)
      throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use HOST:PORT");
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  if (host.empty() || port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoul(std::string(port)) > 65535)
    throw Error(Errc::kInvalidArgument, "bad address '" + std::string(s) + "': use HOST:PORT with a port of 0..65535");
  a.host = std::string(host);
  a.port = static_cast<std::uint16_t>(std::stoul(std::string(port)));
  return a;
}

std::string load_key(const std::string& key_file) {
  std::string key;
  if (!key_file.empty()) {
    const int fd = ::open(key_file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw Error(errno == EACCES ? Errc::kPermission : Errc::kInvalidArgument,
                  "cannot open key file " + key_file + ": " + std::strerror(errno), errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error(Errc::kInvalidArgument, "key file " + key_file + " is not a regular file");
    }
    // Whoever may write the key can make this relay trust a peer of their
    // choosing: the file must be this user's (or root's), and no one else
    // may write it or, outside its group, read it.
    if (st.st_uid != ::geteuid() && st.st_uid != 0) {
      ::close(fd);
      throw Error(Errc::kPermission, "key file " + key_file + " is owned by uid " + std::to_string(st.st_uid) +
                                         ", not by this user (uid " + std::to_string(::geteuid()) +
                                         ") or root: whoever owns it can change the key; chown it");
    }
    if ((st.st_mode & 0022) != 0) {
      ::close(fd);
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw Error(Errc::kPermission, "key file " + key_file + " (mode " + mode +
                                         ") can be written by its group or by others: chmod go-w it (0600, or 0440 "
                                         "with a group; Kubernetes: defaultMode: 0440 and fsGroup)");
    }
    if ((st.st_mode & 0007) != 0) {
      ::close(fd);
      throw Error(Errc::kPermission, "key file " + key_file +
                                         " can be read or written by others: chmod o-rwx it (0600, or 0440 with a "
                                         "group; Kubernetes: defaultMode: 0440 and fsGroup)");
    }
    char buf[4096];
    for (;;) {
      const ssize_t n = retry_eintr([&] { return ::read(fd, buf, sizeof buf); });
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        throw Error(Errc::kSystem, "cannot read key file " + key_file + ": " + std::strerror(e), e);
      }
      if (n == 0) break;
      key.append(buf, static_cast<std::size_t>(n));
      if (key.size() > (1u << 16)) {
        ::close(fd);
        throw Error(Errc::kInvalidArgument, "key file " + key_file + " is larger than 64 KiB");
      }
    }
    ::close(fd);
    if (!key.empty() && key.back() == '\n') key.pop_back();
    if (!key.empty() && key.back() == '\r') key.pop_back();
  } else if (const char* env = std::getenv("SHMCAST_RELAY_KEY"); env != nullptr) {
    key = env;
  } else {
    throw Error(Errc::kInvalidArgument, "no key: give --key-file FILE or set SHMCAST_RELAY_KEY (the same secret, of "
                                        "at least 16 bytes, on every node)");
  }
  if (key.size() < 16)
    throw Error(Errc::kInvalidArgument, "the relay key has " + std::to_string(key.size()) +
                                            " bytes; use at least 16 (e.g. `openssl rand -hex 32`)");
  return key;
}

std::string default_status_path(std::string_view name) {
  return region_dir() + "/shmcast-relay." + std::string(name) + ".json";
}

// ---------------------------------------------------------------- the relay

// Checks chunks received straight into slots (XXH3 against the sum the
// upstream sent) on a thread of its own, so that neither the network thread
// nor the region writer, which may wait for this node's consumers, holds
// the next chunk up. Results are collected with take().
class Verifier {
 public:
  struct Job {
    std::uint64_t serial = 0;
    std::size_t pos = 0;
    const std::byte* p = nullptr;
    std::uint64_t n = 0, sum = 0;
    int buf = -1;  // the relay's reference to the slot, held until take()
    bool ok = false;
  };
  explicit Verifier(std::function<void()> done) : done_(std::move(done)), t_([this] { run(); }) {}
  Verifier(const Verifier&) = delete;
  Verifier& operator=(const Verifier&) = delete;
  // Returns once no job is running: the slots may go.
  ~Verifier() {
    {
      std::lock_guard<std::mutex> g(mu_);
      exit_ = true;
    }
    cv_.notify_all();
    t_.join();
  }
  void submit(const Job& j) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(j);
    }
    cv_.notify_all();
  }
  std::vector<Job> take() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Job> out;
    out.swap(out_);
    return out;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [this] { return !q_.empty() || exit_; });
      if (exit_) return;
      Job j = q_.front();
      q_.pop_front();
      g.unlock();
      j.ok = XXH3_64bits(j.p, j.n) == j.sum;
      g.lock();
      out_.push_back(j);
      done_();
    }
  }
  std::function<void()> done_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> q_;
  std::vector<Job> out_;
  bool exit_ = false;
  std::thread t_;
};

struct Relay::Impl {
  RelayOptions o;
  bool source = false;
  std::string status_path;
  std::atomic<bool> stopping{false};
  int wake_fd = -1;

  // fatal error that ends run()
  std::mutex fatal_mu;
  std::optional<Error> fatal;

  // ---- UCX (network thread only)
  std::unique_ptr<ucx::Context> ctx;
  std::unique_ptr<ucx::Worker> lw;  // the downstream connections' worker (their data endpoints)
  int listen_fd = -1;               // the control channels' listening socket
  std::string listen_str;
  Sink sink;                   // what callbacks filed (any thread)
  std::vector<Op*> completed;  // taken from the sink, being processed (network thread)
  std::unordered_map<Op*, std::unique_ptr<Op>> ops;
  std::vector<EpFailure> ep_failures;
  // Upstream workers of ended connections, kept until their requests finish.
  struct Retired {
    std::unique_ptr<EpArg> arg;     // declared first: destroyed after the worker (and its progress thread)
    std::unique_ptr<ucx::Worker> w;
    std::int64_t since_ns = 0;
  };
  std::vector<Retired> retired;
  bool kick_lw = false, kick_up = false;  // requests were posted: wake the worker's progress thread
  std::map<std::uint64_t, std::unique_ptr<Down>> downs;
  std::uint64_t next_conn = 1;
  std::int64_t accept_paused_until_ns = 0;  // accept4 ran out of descriptors: listen_fd is not polled until then
  int lw_junk_busy = 0;  // tagged messages on the listener's worker being drained
  static constexpr int kJunkBatch = 64;  // junk receives posted per pass, and in flight, at most
  std::uint64_t refused = 0;  // downstreams refused at the handshake (wrong key, region)
  std::uint64_t rejected = 0; // connections refused at once (too many pending handshakes)
  std::uint64_t ignored = 0;  // junk: tagged messages that are not chunk bytes
  std::uint64_t unproven = 0; // connections dropped before they proved the key (deadlines, bad proofs, closes)
  Admission admission;
  RateLog rlog;

  // ---- fan-out progress per fragment sent downstream (lag isolation)
  struct FanFrag {
    int pending = 0;                  // sends of it in flight
    std::int64_t first_done_ns = 0;   // when the first downstream took it
  };
  std::uint64_t fan_seq = 0;
  std::map<std::uint64_t, FanFrag> fan;

  // ---- outgoing sync (fan-out to the downstream relays)
  struct Out {
    std::shared_ptr<const SyncPlan> plan;  // null: none in progress
    std::int64_t start_ns = 0;
  } out;

  // ---- upstream connection (nodes with `from`)
  struct Up {
    enum State { kIdle, kConnecting, kAwaitWelcome, kAuthed };
    State state = kIdle;
    std::unique_ptr<ucx::Worker> w;  // the data connection's worker: receives the chunk bytes
    ucp_ep_h ep = nullptr;           // the data connection (to the listener the upstream opened for it)
    std::unique_ptr<EpArg> arg;
    CtrlSocket sock;                 // the control channel
    bool tcp_up = false;             // its connect() finished
    std::uint64_t gen = 0;
    std::int64_t retry_at_ns = 0, backoff_ns = 0, deadline_ns = 0;
    auth::Transcript tr;
    std::string session;
    std::uint64_t recv_seq = 0;
    std::uint32_t tag_base = 0;     // of this connection's data tags
    std::uint64_t syncs_begun = 0;  // sync messages received on it
    int junk_busy = 0;              // tagged messages that are not chunk bytes being drained
    std::deque<std::vector<std::uint8_t>> ctrl;  // verified, not yet acted on
    std::uint64_t chunk_bytes = 0;               // the source's slot size, once known
    std::int64_t since_unix_ns = 0;
    std::uint64_t connects = 0;
    std::uint64_t refusals = 0;                  // answers that refused this relay (none is proven)
    std::string last_error, last_refusal;
  } up;
  Address from_addr;

  // ---- incoming sync (nodes with `from`)
  struct In {
    std::shared_ptr<const SyncPlan> plan;
    struct Chunk {
      int buf = -1;                // its buffer, from posting until it is handed on (one reference)
      std::vector<Op*> ops;        // fragment receives in flight (each holds a buffer reference)
      std::vector<std::uint8_t> got;  // per fragment: 0 awaited, 1 received, 2 failed or not sent
      std::uint32_t left = 0;      // fragments not yet received or failed
      bool have_sum = false, ok = true;
      std::uint64_t len = 0, sum = 0;
      // Direct receive: 1 asked the writer for the chunk's slot, 2 lent
      // (slot_p), 3 refused (a receive buffer instead).
      int lend = 0;
      int verify = 0;  // direct receive with checksums: 1 being checked, 2 good, 3 bad
      std::byte* slot_p = nullptr;
      std::uint64_t slot_gen = 0;
    };
    std::uint64_t serial = 0;
    std::uint32_t tag_serial = 0;  // its data tags' serial (wire::data_tag)
    std::vector<Chunk> chunks;  // per data_chunks position
    // posted/processed/limit count chunk positions; limit_frags: fragments
    // the upstream sends (all, or what an abort says it sent).
    std::size_t posted = 0, processed = 0, limit = 0;
    // Direct receive into this node's region (its slots are the chunks):
    // positions below `asked` were asked of the writer.
    bool direct = false;
    std::size_t asked = 0;
    std::uint64_t limit_frags = 0;
    // Forwarding cursor: fragments go downstream in order, each as soon as
    // it and every fragment before it are here.
    std::size_t fwd_pos = 0;
    std::uint32_t fwd_frag = 0;
    bool ended = false, aborted = false, discard = false;
    std::int64_t start_ns = 0;
    std::int64_t progress_ns = 0;  // the last fragment or control message of this sync
  } in;
  std::uint64_t in_serial = 0;
  std::vector<Buffer> bufs;
  std::uint64_t buf_bytes = 0;
  // Slots of this node's region used as receive buffers (direct receive):
  // buffer index kSlotBase + i, registered with UCX per region generation.
  static constexpr int kSlotBase = 1 << 20;
  struct SlotBuf {
    Buffer b;
    std::uint64_t gen = 0;
  };
  std::vector<SlotBuf> sbufs;
  SlotUse slot_use;
  std::unique_ptr<Verifier> verifier;  // created with the first direct chunk
  // Lends the writer answered: (serial, position, slot or nullptr, gen).
  struct LendReply {
    std::uint64_t serial = 0;
    std::size_t pos = 0;
    std::byte* p = nullptr;
    std::uint64_t gen = 0;
  };
  std::vector<LendReply> lend_replies;  // under wmu
  std::atomic<std::uint32_t> region_slots{0};  // of this node's region (0: none yet)
  std::atomic<std::uint64_t> region_slot_bytes{0};

  // ---- source reader <-> network thread
  struct SrcCmd {
    enum T { kOpened, kBegin, kChunk, kSum, kEnd, kAbort, kClosed } t;
    std::shared_ptr<const SyncPlan> plan;
    std::uint32_t chunk = 0;
    const std::byte* base = nullptr;
    std::uint64_t len = 0, sum = 0, ticket = 0;
    std::string why;
    std::function<void()> release;  // kChunk: lets go of the source slot
  };
  std::mutex cmd_mu;
  std::condition_variable cmd_cv;
  std::deque<SrcCmd> cmds;
  std::uint64_t next_ticket = 1, replied_ticket = 0;
  std::int64_t reply_value = 0;
  bool net_done = false;
  // network thread's view of the source
  std::uint64_t src_slot_bytes = 0;
  // Source chunks being sent, several at once (Consumer::visit_chunks):
  // each slot is released once every downstream has it and its sum went.
  struct SrcChunk {
    int pending = 0;
    bool sum_sent = false;
    std::uint64_t version = 0;
    std::function<void()> release;
  };
  std::map<std::uint32_t, SrcChunk> src_chunks;
  std::map<const std::byte*, ucx::Registration> slot_regs;
  std::thread reader;

  // ---- region writer (nodes with `from`)
  struct WCmd {
    enum T { kOpen, kBegin, kChunk, kEnd, kAbort, kLend } t;
    std::shared_ptr<const SyncPlan> plan;
    int buf = -1;
    std::uint32_t chunk = 0;
    const std::byte* data = nullptr;
    std::uint64_t len = 0, sum = 0, chunk_bytes = 0;
    std::string why;
    std::uint64_t serial = 0;  // kLend: the incoming sync
    std::size_t pos = 0;       // kLend: its position in data_chunks
    bool verified = false;     // kChunk: its checksum matched (Verifier); why "bad": it did not
  };
  std::mutex wmu;
  std::condition_variable wcv;
  std::deque<WCmd> wq;
  std::vector<int> wdone;  // buffers the writer is finished with
  bool writer_exit = false;
  std::thread writer;

  // ---- status (any thread, under smu)
  std::mutex smu;
  struct Stats {
    std::string state = "starting";
    std::uint64_t syncs = 0, aborted = 0, skipped = 0, bytes_in = 0, bytes_out = 0;
    std::uint64_t last_version = 0, last_bytes = 0;
    double last_seconds = 0;
    std::string last_error;
    // local region (writer) or source region (reader)
    bool region_ready = false;
    std::uint64_t region_slot_bytes = 0, region_version = 0, region_syncs = 0, region_failed = 0;
    std::uint32_t region_consumers = 0;
    std::string region_error;
  } st;
  std::int64_t next_status_ns = 0, next_status_write_ns = 0;
  std::atomic<bool> status_dirty{true};

  explicit Impl(RelayOptions opts)
      : o(std::move(opts)),
        admission(std::max<std::uint32_t>(o.max_pending, 1), std::max<std::uint32_t>(o.max_pending_per_source, 1)),
        rlog([this](const std::string& line) { log(line); }, 10, 10'000'000'000) {
    if (std::string why = validate_name(o.region); !why.empty())
      throw Error(Errc::kBadName, why + ": '" + o.region + "'");
    source = o.from.empty();
    if (source && o.listen.empty())
      throw Error(Errc::kInvalidArgument, "a source relay (no --from) needs --listen HOST:PORT for its downstream "
                                          "relays");
    if (o.key.size() < 16) throw Error(Errc::kInvalidArgument, "the relay key must have at least 16 bytes");
    if (!source) from_addr = parse_address(o.from);
    if (!source && from_addr.host.find(':') != std::string::npos) {
      socklen_t len = 0;
      (void)ucx::resolve(from_addr, false, &len);  // a numeric IPv6 address: refused now if UCX cannot take it
    }
    if (!o.listen.empty()) (void)parse_address(o.listen);
    if (o.buffers < 2) throw Error(Errc::kInvalidArgument, "buffers must be at least 2");
    if (o.fragment_bytes < wire::kMinFragBytes || o.fragment_bytes > wire::kMaxFragBytes ||
        (o.fragment_bytes & (o.fragment_bytes - 1)) != 0)
      throw Error(Errc::kInvalidArgument, "fragment_bytes must be a power of two from 64 KiB to 2 MiB, not " +
                                              std::to_string(o.fragment_bytes));
    if (o.max_pending == 0 || o.max_pending_per_source == 0)
      throw Error(Errc::kInvalidArgument, "max_pending and max_pending_per_source must be at least 1");
    if (o.max_lag.count() <= 0) throw Error(Errc::kInvalidArgument, "max_lag must be positive");
    if (o.first_response_timeout.count() <= 0)
      throw Error(Errc::kInvalidArgument, "first_response_timeout must be positive");
    status_path = o.status_path.empty() ? default_status_path(o.region) : o.status_path;
    if (status_path == "-") status_path.clear();
    wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd < 0) throw Error(Errc::kSystem, std::string("eventfd: ") + std::strerror(errno), errno);
  }

  ~Impl() {
    verifier.reset();  // its thread wakes the network thread through wake_fd
    // run() may have failed before shutdown(): no progress thread may
    // outlive the sink, the ops or the wake fd.
    if (lw) lw->stop_progress();
    if (up.w) up.w->stop_progress();
    for (Retired& r : retired)
      if (r.w) r.w->stop_progress();
    if (wake_fd >= 0) ::close(wake_fd);
    if (listen_fd >= 0) ::close(listen_fd);
  }

  // ------------------------------------------------------------ helpers

  void log(const std::string& line) {
    if (o.log) {
      o.log(line);
      return;
    }
    const std::int64_t now = unix_ns();
    const std::time_t secs = static_cast<std::time_t>(now / 1000000000);
    std::tm tm{};
    ::gmtime_r(&secs, &tm);
    char ts[32];
    std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
    std::fprintf(stderr, "shmcast-relay %s %s.%03dZ %s\n", o.region.c_str(), ts,
                 static_cast<int>((now / 1000000) % 1000), line.c_str());
  }

  void wake() noexcept {
    const std::uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd, &one, sizeof one);
  }

  void set_fatal(const Error& e) {
    {
      std::lock_guard<std::mutex> g(fatal_mu);
      if (!fatal) fatal = e;
    }
    stopping = true;
    wake();
    wcv.notify_all();
    cmd_cv.notify_all();
  }

  void set_state(const std::string& s) {
    std::lock_guard<std::mutex> g(smu);
    if (st.state != s) {
      st.state = s;
      status_dirty = true;
    }
  }
  void note_error(const std::string& e) {
    std::lock_guard<std::mutex> g(smu);
    st.last_error = e;
    status_dirty = true;
  }

  Op* new_op(Op::Kind k, ucp_worker_h w) {
    auto op = std::make_unique<Op>();
    op->kind = k;
    op->sink = &sink;
    op->worker = w;
    Op* p = op.get();
    ops.emplace(p, std::move(op));
    return p;
  }
  // Files the result of an *_nbx call.
  void track(Op* op, ucs_status_ptr_t r) {
    if (op->worker == (lw ? lw->get() : nullptr)) kick_lw = true;
    else kick_up = true;
    if (UCS_PTR_IS_ERR(r) || r == nullptr) {
      if (!op->done) {
        op->status = r == nullptr ? UCS_OK : UCS_PTR_STATUS(r);
        op->done = true;
        completed.push_back(op);
      }
    } else {
      op->req = r;
    }
    if (r == nullptr && (op->kind == Op::kDataRecv || op->kind == Op::kJunkRecv)) {
      op->length = op->info.length;
      op->sender_tag = op->info.sender_tag;
    }
  }
  ucp_request_param_t send_param(Op* op, ucp_mem_h memh = nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = op_send_cb;
    p.user_data = op;
    if (memh) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    return p;
  }
  ucp_request_param_t recv_param(Op* op, ucp_mem_h memh = nullptr) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv = op_recv_cb;
    p.user_data = op;
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    p.recv_info.tag_info = &op->info;
    if (memh) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    return p;
  }

  // Most bytes of control messages a downstream may leave unread: a sync
  // message (its manifest) and the chunk messages behind it.
  static constexpr std::size_t kMaxCtrlOut = wire::kMaxControlBytes + (16u << 20);

  // The bytes of a control message; `session` empty: unauthenticated
  // (handshake), else with its sequence number and MAC.
  static std::vector<std::uint8_t>& seal(Writer& msg, const std::string& session, std::uint64_t* seq,
                                         std::string_view dir) {
    auto& b = msg.buffer();
    if (!session.empty()) {
      msg.set_seq((*seq)++);
      const wire::Mac m = auth::message_mac(session, dir, b);
      b.insert(b.end(), m.begin(), m.end());
    }
    return b;
  }
  // Sends on a downstream's control channel (dropping it when it reads
  // nothing: more than kMaxCtrlOut unread).
  void send_down(Down& d, Writer& msg, bool authenticated = true) {
    if (d.state == Down::kClosing) return;
    if (!d.sock.send(seal(msg, authenticated ? d.session : std::string(), &d.send_seq, "down"), kMaxCtrlOut)) {
      drop_down(d, "reads none of its control messages (" + std::to_string(d.sock.pending_out()) + " bytes unread)");
      return;
    }
    if (!d.sock.flush()) drop_down(d, "control channel: " + d.sock.error());
  }

  void close_ep(ucp_worker_h w, ucp_ep_h ep, bool force, std::uint64_t conn) {
    Op* op = new_op(Op::kClose, w);
    op->conn = conn;
    op->gen = up.gen;
    ucp_request_param_t p = send_param(op);
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    track(op, ucp_ep_close_nbx(ep, &p));
  }

  // ------------------------------------------------------------ listener side

  // Downstream relays connect to the relay's own TCP socket (not to a UCX
  // listener: UCX 1.13's TCP connection manager dies of an assertion when
  // connections come and go fast, which any peer can make happen, and a
  // UCX listener bound messages to ids its peers wrote). The key handshake
  // and every control message travel on that connection; once the
  // downstream proved the key, this relay opens a UCX listener for that
  // connection's chunk bytes (on_up_message, accept_data_conns).
  void start_listener() {
    if (o.listen.empty()) return;
    const Address a = parse_address(o.listen);
    socklen_t len = 0;
    const sockaddr_storage ss = ucx::resolve(a, true, &len);
    listen_fd = ctrl_listen(ss, len, a.str());
    sockaddr_storage bound{};
    socklen_t blen = sizeof bound;
    ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&bound), &blen);
    listen_str = a.host + ":" + std::to_string(ucx::sockaddr_port(bound));
    if (a.host.find(':') != std::string::npos)
      listen_str = "[" + a.host + "]:" + std::to_string(ucx::sockaddr_port(bound));
    log("listening on " + listen_str + " for downstream relays");
    status_dirty = true;
  }

  // The address of a peer, without the port.
  static std::string source_of(const sockaddr_storage& ss) {
    const std::string s = ucx::sockaddr_str(ss);
    const auto colon = s.rfind(':');
    return colon == std::string::npos ? s : s.substr(0, colon);
  }

  void accept_conns() {
    if (listen_fd < 0 || mono_ns() < accept_paused_until_ns) return;
    for (int i = 0; i < 256; ++i) {  // then the rest of the loop's work
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int fd = retry_eintr(
          [&] { return ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC); });
      if (fd < 0) {
        if (errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        const int err = errno;
        rlog.log("accept", std::string("accept: ") + std::strerror(err), mono_ns());
        // Out of descriptors (or kernel memory): the connection stays in the
        // backlog and the socket stays readable, so polling it would spin.
        // It is left alone for 100 ms (wait_events), while connections that
        // end free descriptors.
        if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
          accept_paused_until_ns = mono_ns() + 100'000'000;
        return;
      }
      CtrlSocket sock(fd);
      const std::string peer = ucx::sockaddr_str(ss), src = source_key(ss);
      if (stopping) continue;  // closed
      // At most o.max_pending handshakes at once, o.max_pending_per_source
      // from one address (an IPv6 /64): a newcomer beyond either takes the
      // place of an older one, which is closed (Admission; docs/relay.md,
      // "Limits").
      const std::uint64_t id = next_conn_id(&next_conn, [this](std::uint64_t id) { return downs.count(id) != 0; });
      std::uint64_t evict = 0;
      const Admission::Verdict verdict = admission.admit(src, id, mono_ns(), &evict);
      if (verdict == Admission::Verdict::kRefused) {
        ++rejected;
        status_dirty = true;
        rlog.log("reject", "connection from " + peer + " refused at once: " + std::to_string(admission.pending()) +
                               " handshakes pending (" + std::to_string(admission.pending_from(src)) +
                               " from its address; at most " + std::to_string(o.max_pending) + ", " +
                               std::to_string(o.max_pending_per_source) + " per address)",
                 mono_ns());
        continue;
      }
      if (verdict == Admission::Verdict::kEvicted)
        if (auto v = downs.find(evict); v != downs.end()) {
          v->second->pending = false;  // Admission let it go already
          drop_down(*v->second, "evicted: it sent no response, and " + peer + " needs its pending slot");
        }
      ctrl_tune(fd);
      auto d = std::make_unique<Down>();
      d->id = id;
      d->sock = std::move(sock);
      d->peer = peer;
      d->source = source_of(ss);  // its exact address (its data connection must come from it)
      d->pending = true;
      d->tr.region = o.region;
      d->tr.conn = d->id;
      d->tr.server_nonce = auth::nonce();
      d->deadline_ns = mono_ns() + o.handshake_timeout.count();
      d->first_deadline_ns = mono_ns() + std::min(o.first_response_timeout, o.handshake_timeout).count();
      d->since_unix_ns = unix_ns();
      Down& dr = *d;
      downs.emplace(d->id, std::move(d));
      Writer w(Type::kChallenge);
      w.u32(wire::kProto).u64(dr.id).bytes(dr.tr.server_nonce).str(o.region);
      send_down(dr, w, false);
      rlog.log("accept", "connection " + std::to_string(dr.id) + " from " + dr.peer + ": challenge sent", mono_ns());
      status_dirty = true;
    }
  }

  // A downstream leaves the listener's pending handshakes (it proved the
  // key, or it ends).
  void leave_pending(Down& d) {
    if (!d.pending) return;
    d.pending = false;
    admission.release(d.id);
  }

  // Ends a downstream connection: its control channel closes once what was
  // queued on it went out (at most 1 s: a refusal reaches its peer), its
  // data endpoint closes (`force`: at once, cancelling sends in flight).
  void drop_down(Down& d, const std::string& why, bool force = true) {
    if (d.state == Down::kClosing) return;
    const std::string line = "downstream " + std::to_string(d.id) + " (" + d.peer + ") dropped: " + why;
    // Connections that never proved the key are anyone's: their drops are
    // rate-limited; an authenticated downstream's always print.
    if (d.state == Down::kHandshake) {
      ++unproven;
      rlog.log("drop", line, mono_ns());
    } else {
      log(line);
    }
    if (d.state == Down::kActive) {
      std::lock_guard<std::mutex> g(smu);
      st.last_error = "downstream " + d.peer + ": " + why;
    }
    leave_pending(d);
    close_data_listener(d);
    d.state = Down::kClosing;
    d.closing_ns = mono_ns();
    if (force || !d.sock.want_write()) d.sock.close();
    if (d.ep && !d.ep_closing) {
      d.ep_closing = true;
      close_ep(lw->get(), d.ep, force, d.id);
    }
    status_dirty = true;
  }

  void refuse(Down& d, const std::string& why) {
    ++refused;
    Writer w(Type::kRefused);
    w.str(why);
    send_down(d, w, false);
    // A connection that never proved the key is anyone's: what it sent (a
    // region name) goes to the rate-limited log, never to the status file's
    // last_error (the refused count says it happened).
    status_dirty = true;
    drop_down(d, "refused: " + why, false);
  }

  // Control channels of downstream relays: reads their messages (only the
  // handshake response is expected), writes what is queued, ends closed
  // ones. A message on a connection's socket is that connection's: a check
  // it fails ends that connection only.
  void service_downs() {
    const std::int64_t now = mono_ns();
    for (auto it = downs.begin(); it != downs.end();) {
      Down& d = *it->second;
      if (d.state == Down::kClosing) {
        if (d.sock.is_open() && (!d.sock.want_write() || !d.sock.flush() || now - d.closing_ns > 1'000'000'000))
          d.sock.close();
        if (!d.sock.is_open() && d.ep == nullptr) {  // and its endpoint closed (Op::kClose)
          it = downs.erase(it);
          status_dirty = true;
          continue;
        }
        ++it;
        continue;
      }
      if (d.sock.want_write() && !d.sock.flush()) {
        drop_down(d, "control channel: " + d.sock.error());
        ++it;
        continue;
      }
      std::vector<std::vector<std::uint8_t>> frames;
      const bool ok = d.sock.receive(wire::kHandshakeBytes, &frames, 256u << 10);
      for (auto& f : frames) {
        if (d.state == Down::kClosing) break;
        on_up_message(d, f);
      }
      if (!ok && d.state != Down::kClosing)
        drop_down(d, d.state == Down::kHandshake ? "handshake: " + d.sock.error() : d.sock.error());
      ++it;
    }
  }

  // A control message on downstream connection `d`: only the handshake
  // response is expected.
  void on_up_message(Down& d, const std::vector<std::uint8_t>& msg) {
    if (d.state != Down::kHandshake) {
      drop_down(d, "a control message after the handshake");
      return;
    }
    try {
      wire::Reader r(msg, false);
      if (r.type() != Type::kResponse) throw wire::ProtocolError(std::string("a ") + wire::type_name(r.type()) +
                                                                 " message, not a response to the challenge");
      r.bytes(&d.tr.client_nonce);
      wire::Mac proof{};
      r.bytes(&proof);
      const std::string region = r.str(256);
      r.expect_done();
      if (region != o.region) {
        refuse(d, "this relay serves region '" + o.region + "', not '" + printable(region) + "'");
        return;
      }
      if (!auth::equal(proof, auth::client_proof(o.key, d.tr))) {
        rlog.log("refuse", "downstream " + d.peer + " did not prove the key: refused", mono_ns());
        refuse(d, "wrong key (the downstream's SHMCAST_RELAY_KEY / --key-file differs from this relay's)");
        return;
      }
      // The key is proven: a UCX listener for this connection's chunk
      // bytes, on the address the downstream reached, any port. It takes
      // one connection, from the downstream's address, and closes.
      sockaddr_storage here{};
      socklen_t hlen = sizeof here;
      if (::getsockname(d.sock.fd(), reinterpret_cast<sockaddr*>(&here), &hlen) != 0) {
        drop_down(d, std::string("getsockname: ") + std::strerror(errno));
        return;
      }
      if (here.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&here)->sin_port = 0;
      else if (here.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&here)->sin6_port = 0;
      d.larg = std::make_unique<ListenArg>(ListenArg{&sink, d.id});
      ucp_listener_params_t lp{};
      lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
      lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&here);
      lp.sockaddr.addrlen = hlen;
      lp.conn_handler.cb = on_data_conn;
      lp.conn_handler.arg = d.larg.get();
      if (const ucs_status_t ls = ucp_listener_create(lw->get(), &lp, &d.listener); ls != UCS_OK) {
        d.listener = nullptr;
        drop_down(d, "cannot open its data listener: " + ucx::status_str(ls));
        return;
      }
      ucp_listener_attr_t la{};
      la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
      std::string data_addr;
      if (ucp_listener_query(d.listener, &la) == UCS_OK) data_addr = ucx::sockaddr_str(la.sockaddr);
      d.session = auth::session_key(o.key, d.tr);
      d.tag_base = auth::data_tag_base(d.session);
      Writer w(Type::kWelcome);
      w.bytes(auth::server_proof(o.key, d.tr)).u64(source ? src_slot_bytes : up.chunk_bytes);
      w.u32(o.checksums ? wire::kFlagChecksums : 0).str(data_addr);
      send_down(d, w);
      if (d.state == Down::kClosing) return;
      leave_pending(d);
      d.state = Down::kJoining;  // until its data connection arrives (same deadline)
      status_dirty = true;
    } catch (const wire::ProtocolError& e) {
      drop_down(d, e.what());
    }
  }

  // Closes a downstream's data listener; connection requests it filed that
  // are not taken yet are refused first. Its connection handler runs inside
  // the worker's progress: with progress held off, none is filed meanwhile.
  void close_data_listener(Down& d) {
    if (!d.listener) return;
    lw->locked([&] {
      std::vector<ucp_conn_request_h> mine;
      {
        std::lock_guard<std::mutex> g(sink.mu);
        for (auto it = sink.conns.begin(); it != sink.conns.end();) {
          if (it->first == d.id) {
            mine.push_back(it->second);
            it = sink.conns.erase(it);
          } else {
            ++it;
          }
        }
      }
      for (ucp_conn_request_h r : mine) ucp_listener_reject(d.listener, r);
      ucp_listener_destroy(d.listener);
    });
    d.listener = nullptr;
  }

  // Data connections: the first from a downstream's own address is its
  // data endpoint; then its listener closes and it joins the next sync.
  void accept_data_conns() {
    std::vector<std::pair<std::uint64_t, ucp_conn_request_h>> list;
    {
      std::lock_guard<std::mutex> g(sink.mu);
      list.swap(sink.conns);
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto [id, req] = list[i];
      if (req == nullptr) continue;  // rejected below, with its listener's first
      auto it = downs.find(id);
      if (it == downs.end() || !it->second->listener) continue;  // its listener is gone, and the request with it
      Down& d = *it->second;
      ucp_conn_request_attr_t attr{};
      attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
      const bool known = ucp_conn_request_query(req, &attr) == UCS_OK;
      if (d.state != Down::kJoining || d.ep != nullptr || !known || source_of(attr.client_address) != d.source) {
        ucp_listener_reject(d.listener, req);
        rlog.log("reject", "data connection for downstream " + std::to_string(d.id) + " from " +
                               (known ? ucx::sockaddr_str(attr.client_address) : std::string("?")) +
                               " refused (not from " + d.source + ", or not awaited)",
                 mono_ns());
        continue;
      }
      d.arg = std::make_unique<EpArg>(EpArg{&sink, d.id, 0});
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.conn_request = req;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = ep_error_cb;
      ep.err_handler.arg = d.arg.get();
      const ucs_status_t st = ucp_ep_create(lw->get(), &ep, &d.ep);
      // Later requests for this connection in the same batch are refused
      // before its listener goes (close_data_listener refuses only those
      // still in the sink): each request is answered, none left dangling.
      for (std::size_t k = i + 1; k < list.size(); ++k)
        if (list[k].first == d.id && list[k].second != nullptr) {
          ucp_listener_reject(d.listener, list[k].second);
          list[k].second = nullptr;
          rlog.log("reject", "data connection for downstream " + std::to_string(d.id) +
                                 " refused (it has its data connection)",
                   mono_ns());
        }
      close_data_listener(d);
      if (st != UCS_OK) {
        d.ep = nullptr;
        drop_down(d, "cannot accept its data connection: " + ucx::status_str(st));
        continue;
      }
      d.state = Down::kReady;
      log("downstream " + std::to_string(d.id) + " (" + d.peer + ") authenticated; it joins at the next sync");
      status_dirty = true;
    }
  }

  // No tagged message comes to the downstream connections' worker: anything
  // there is junk (a peer that reached UCX's own port). Drained, so that it
  // does not pile up in UCX's unexpected queue.
  void drain_lw_junk() {
    while (lw && lw_junk_busy < kJunkBatch) {  // a batch per pass
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h m = ucp_tag_probe_nb(lw->get(), 0, 0, 1, &info);
      if (m == nullptr) return;
      Op* op = new_op(Op::kJunkRecv, lw->get());
      op->msg.resize(64);  // a larger one is received truncated (an error), and dropped all the same
      ucp_request_param_t p = recv_param(op);
      ++lw_junk_busy;
      track(op, ucp_tag_msg_recv_nbx(lw->get(), op->msg.data(), op->msg.size(), m, &p));
      ++ignored;
      status_dirty = true;
      rlog.log("ignored",
               "a tagged message of " + std::to_string(info.length) + " bytes on the downstream worker: dropped",
               mono_ns());
    }
  }

  // What a peer wrote, fit for one log line and for the status file's JSON:
  // control bytes become '?', bytes from 0x80 up "\\xNN" (a peer's bytes
  // need not be UTF-8, which JSON requires).
  static std::string printable(const std::string& s, std::size_t max = 300) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string out;
    for (char ch : s.substr(0, max)) {
      const auto c = static_cast<unsigned char>(ch);
      if (c < 0x20 || c == 0x7f) {
        out += '?';
      } else if (c >= 0x80) {
        out += "\\x";
        out += kHex[c >> 4];
        out += kHex[c & 15];
      } else {
        out += ch;
      }
    }
    if (s.size() > max) out += "...";
    return out;
  }

  // ------------------------------------------------------------ fan-out

  // Starts `plan` on every downstream that is ready; returns how many.
  int forward_begin(const std::shared_ptr<const SyncPlan>& plan) {
    out.plan = plan;
    out.start_ns = mono_ns();
    int n = 0;
    for (auto& [id, d] : downs) {
      if (d->state != Down::kReady) continue;
      Writer w(Type::kSync);
      wire::encode_sync(w, *plan);
      send_down(*d, w);
      d->state = Down::kActive;
      d->version = plan->version;
      d->frags_sent = 0;
      d->serial = wire::data_serial(d->tag_base, ++d->syncs_begun);
      ++n;
    }
    status_dirty = true;
    return n;
  }
  // Posts fragment j of chunk `c` (bytes [p, p + len)) to every active
  // downstream; returns the sends. Fragments go in order (In::fwd_*), so an
  // abort can say how many each downstream was sent.
  int forward_frag(std::uint32_t c, std::uint32_t j, const std::byte* p, std::uint64_t len, ucp_mem_h memh, int buf) {
    int n = 0;
    if (!out.plan) return 0;
    const std::uint64_t ord = ++fan_seq;  // this fragment, for every downstream (lag isolation)
    for (auto& [id, d] : downs) {
      if (d->state != Down::kActive) continue;
      Op* op = new_op(Op::kDataSend, lw->get());
      op->conn = d->id;
      op->buf = buf;
      op->chunk = c;
      op->frag = j;
      op->version = out.plan->version;
      op->bytes = len;
      op->ord = ord;
      if (d->pending_data++ == 0) d->progress_ns = mono_ns();
      ++d->frags_sent;
      d->pend.insert(ord);
      ++fan[ord].pending;
      ucp_request_param_t prm = send_param(op, memh);
      add_ref(buf);
      track(op, ucp_tag_send_nbx(d->ep, p, len, wire::data_tag(d->serial, out.plan->frag_tag(c, j)), &prm));
      ++n;
    }
    return n;
  }
  // Every fragment of chunk `c` at once (the source, from its slot).
  int forward_chunk(std::uint32_t c, const std::byte* p, ucp_mem_h memh) {
    if (!out.plan) return 0;
    int n = 0;
    for (std::uint32_t j = 0, nf = out.plan->frags(c); j < nf; ++j)
      n += forward_frag(c, j, p + static_cast<std::uint64_t>(j) * out.plan->frag_bytes, out.plan->frag_len(c, j),
                        memh, -1);
    return n;
  }
  void forward_sum(std::uint32_t c, std::uint64_t len, std::uint64_t sum) {
    if (!out.plan) return;
    for (auto& [id, d] : downs) {
      if (d->state != Down::kActive) continue;
      Writer w(Type::kChunk);
      w.u64(out.plan->version).u32(c).u64(len).u64(sum);
      send_down(*d, w);
    }
  }
  void forward_end() {
    if (!out.plan) return;
    int n = 0;
    for (auto& [id, d] : downs) {
      if (d->state != Down::kActive) continue;
      Writer w(Type::kEnd);
      w.u64(out.plan->version).u64(d->frags_sent);
      send_down(*d, w);
      d->state = Down::kReady;
      ++d->syncs;
      ++n;
    }
    if (source) {
      const double s = static_cast<double>(mono_ns() - out.start_ns) * 1e-9;
      log("sync " + std::to_string(out.plan->version) + " sent to " + std::to_string(n) + " downstream: " +
          coarse_bytes(out.plan->payload_bytes) + " in " + std::to_string(s) + " s (" +
          fmt_gbs(out.plan->payload_bytes, s) + ")");
      std::lock_guard<std::mutex> g(smu);
      ++st.syncs;
      st.last_version = out.plan->version;
      st.last_bytes = out.plan->payload_bytes;
      st.last_seconds = s;
    }
    out.plan.reset();
    status_dirty = true;
  }
  void forward_abort(const std::string& why) {
    if (!out.plan) return;
    for (auto& [id, d] : downs) {
      if (d->state != Down::kActive) continue;
      Writer w(Type::kAbort);
      w.u64(out.plan->version).u64(d->frags_sent).str(why.substr(0, 1000));
      send_down(*d, w);
      d->state = Down::kReady;
    }
    if (source) {
      std::lock_guard<std::mutex> g(smu);
      ++st.aborted;
    }
    out.plan.reset();
    status_dirty = true;
  }

  // ------------------------------------------------------------ buffers

  Buffer& bref(int b) {
    return b >= kSlotBase ? sbufs[static_cast<std::size_t>(b - kSlotBase)].b : bufs[static_cast<std::size_t>(b)];
  }
  void add_ref(int b) {
    if (b < 0) return;
    Buffer& buf = bref(b);
    ++buf.refs;
    if (b >= kSlotBase) slot_use.add(buf.p, 1);
  }
  void release_buf(int b) {
    if (b < 0) return;
    Buffer& buf = bref(b);
    if (buf.refs <= 0) return;
    --buf.refs;
    if (b >= kSlotBase) slot_use.add(buf.p, -1);
  }
  // The slot buffer for a lent slot at `p` of region generation `gen`
  // (registered with UCX once per generation; older ones are dropped: the
  // writer recreated the region only once none of them was in use).
  int slot_buf(std::byte* p, std::uint64_t gen) {
    if (!sbufs.empty() && sbufs.front().gen != gen &&
        std::all_of(sbufs.begin(), sbufs.end(), [](const SlotBuf& sb) { return sb.b.refs == 0; })) {
      for (SlotBuf& sb : sbufs) ucx::unregister_memory(ctx->get(), &sb.b.reg);
      sbufs.clear();
    }
    for (std::size_t i = 0; i < sbufs.size(); ++i)
      if (sbufs[i].b.p == p && sbufs[i].gen == gen) return kSlotBase + static_cast<int>(i);
    SlotBuf sb;
    sb.gen = gen;
    sb.b.p = p;
    sb.b.cap = region_slot_bytes.load();
    sb.b.reg = ucx::register_memory(ctx->get(), p, sb.b.cap);
    sbufs.push_back(sb);
    return kSlotBase + static_cast<int>(sbufs.size() - 1);
  }
  int free_buf() const {
    for (std::size_t i = 0; i < bufs.size(); ++i)
      if (bufs[i].refs == 0) return static_cast<int>(i);
    return -1;
  }
  bool all_bufs_free() const {
    return std::all_of(bufs.begin(), bufs.end(), [](const Buffer& b) { return b.refs == 0; });
  }
  void free_bufs() {
    for (Buffer& b : bufs) {
      ucx::unregister_memory(ctx->get(), &b.reg);
      if (b.p) ::munmap(b.p, b.cap);
    }
    bufs.clear();
    buf_bytes = 0;
  }
  // (Re)allocates the receive buffers for chunks of `bytes`; false while
  // some are still in use.
  bool ensure_bufs(std::uint64_t bytes) {
    if (buf_bytes == bytes && !bufs.empty()) return true;
    if (!all_bufs_free()) return false;
    free_bufs();
    for (std::uint32_t i = 0; i < o.buffers; ++i) {
      Buffer b;
      b.cap = bytes;
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED)
        throw Error(Errc::kSystem, "cannot allocate " + std::to_string(o.buffers) + " receive buffers of " +
                                       coarse_bytes(bytes) + ": " + std::strerror(errno) + " (lower --buffers)",
                    errno);
      b.p = static_cast<std::byte*>(p);
      b.reg = ucx::register_memory(ctx->get(), p, bytes);
      bufs.push_back(b);
    }
    buf_bytes = bytes;
    log("receive buffers: " + std::to_string(o.buffers) + " x " + coarse_bytes(bytes) + ", registered with UCX");
    return true;
  }

  // ------------------------------------------------------------ upstream side

  // Connects the control channel (TCP) to the upstream; once both sides
  // proved the key, the welcome names the address of a UCX listener the
  // upstream opened for this connection's chunk bytes.
  void connect_upstream() {
    ++up.gen;
    socklen_t len = 0;
    sockaddr_storage ss{};
    try {
      ss = ucx::resolve(from_addr, false, &len);
    } catch (const Error& e) {
      fail_upstream(e.what());  // a name that does not resolve yet (a Service being created): retry
      return;
    }
    up.w = new_worker();
    std::string err;
    const int fd = ctrl_connect(ss, len, &err);
    if (fd < 0) {
      fail_upstream("cannot connect to " + from_addr.str() + ": " + err);
      return;
    }
    up.sock = CtrlSocket(fd);
    up.tcp_up = false;
    up.state = Up::kConnecting;
    up.deadline_ns = mono_ns() + o.handshake_timeout.count();
    up.recv_seq = 0;
    up.session.clear();
    up.syncs_begun = 0;
    up.ctrl.clear();
    up.junk_busy = 0;
    ++up.connects;
    set_state("connecting");
  }

  // Refusals are retried more slowly than a lost connection: from 1 s,
  // doubling up to 5 s (or reconnect_max when that is longer).
  static constexpr std::int64_t kRefusalBackoffMin = 1'000'000'000, kRefusalBackoffMax = 5'000'000'000;

  // Ends the upstream connection: aborts the sync in progress here and
  // downstream, cancels the receives, tears the worker down, and schedules a
  // reconnection (`refusal`: after a refusal, more slowly).
  void fail_upstream(const std::string& why, bool refusal = false) {
    log("upstream " + from_addr.str() + ": " + why);
    up.last_error = why;
    note_error("upstream: " + why);
    if (in.plan) {
      const std::string reason = "upstream relay lost mid-sync: " + why;
      if (!in.discard) {
        push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, reason});
        forward_abort(reason);
        std::lock_guard<std::mutex> g(smu);
        ++st.aborted;
      }
    }
    drop_in();
    teardown_upstream();
    up.state = Up::kIdle;
    if (refusal)
      up.backoff_ns = std::clamp<std::int64_t>(std::max<std::int64_t>(up.backoff_ns * 2, kRefusalBackoffMin),
                                               kRefusalBackoffMin,
                                               std::max<std::int64_t>(kRefusalBackoffMax, o.reconnect_max.count()));
    else
      up.backoff_ns = std::clamp<std::int64_t>(up.backoff_ns * 2, o.reconnect_min.count(), o.reconnect_max.count());
    up.retry_at_ns = mono_ns() + up.backoff_ns;
    set_state(refusal ? "refused" : "reconnecting");
  }

  // The upstream refused this relay, or did not prove the key. No refusal
  // is proven: the upstream proves the key only to a relay that proved the
  // same key first, so a peer without the key (one that took the upstream's
  // port while it restarts) can send any refusal. The relay reports it (log,
  // status file: upstream.refusals, upstream.last_refusal) and retries with
  // a backoff, unless exit_on_refusal asks it to stop (run() throws
  // kPermission: exit code 3).
  void upstream_refused(const std::string& why) {
    ++up.refusals;
    up.last_refusal = why;
    status_dirty = true;
    if (o.exit_on_refusal) throw Error(Errc::kPermission, why);
    fail_upstream(why + " (not proven: a peer without the key can send this too; retrying, --exit-on-refusal to "
                        "exit instead)",
                  true);
    // What the peer wrote stays in upstream.last_refusal (and the log):
    // last_error says what happened in the relay's own words.
    up.last_error = "refused this relay or did not prove the key (unproven: the peer's text is in "
                    "upstream.last_refusal); retrying";
    note_error("upstream " + from_addr.str() + ": " + up.last_error);
  }

  // Forgets the sync being received; buffers of chunks received but not
  // handed on return now, those of receives in flight when they finish.
  void drop_in() {
    for (std::size_t i = in.processed; i < in.posted; ++i)
      if (in.chunks[i].buf >= 0) release_buf(in.chunks[i].buf);  // the chunk's; receives in flight keep theirs
    in = In{};
  }

  // Closes the control channel, cancels the upstream worker's receives and
  // retires the worker: its requests finish through the usual completions
  // (stale generation), then reap_retired() destroys it.
  void teardown_upstream() {
    up.sock.close();
    if (!up.w) return;
    ucp_worker_h w = up.w->get();
    for (auto& [p, op] : ops)
      if (op->worker == w && op->req && !op->done && (op->kind == Op::kDataRecv || op->kind == Op::kJunkRecv)) {
        Op* o2 = op.get();
        up.w->cancel(op->req, [o2] { return !o2->done.load(std::memory_order_acquire); });
      }
    if (up.ep) close_ep(w, up.ep, true, 0);
    up.ep = nullptr;
    ++up.gen;
    retired.push_back(Retired{std::move(up.arg), std::move(up.w), mono_ns()});
    up.ctrl.clear();
    up.junk_busy = 0;
  }

  void reap_retired() {
    for (auto it = retired.begin(); it != retired.end();) {
      ucp_worker_h w = it->w->get();
      it->w->progress();
      const bool busy = std::any_of(ops.begin(), ops.end(), [&](const auto& kv) { return kv.second->worker == w; });
      if (busy && mono_ns() - it->since_ns < 10'000'000'000) {
        ++it;
        continue;
      }
      if (busy) {
        log("an ended upstream connection still has requests after 10 s: leaving its UCX worker behind");
        it->w->stop_progress();
        (void)it->w.release();
        (void)it->arg.release();
        // Its progress is stopped, so nothing lands in their buffers any
        // more: give the buffers (and this node's slots) back.
        for (auto& [p, op] : ops)
          if (op->worker == w) {
            op->worker = nullptr;
            release_buf(op->buf);
            op->buf = -1;
          }
      }
      it = retired.erase(it);
    }
  }

  void send_up(Writer& msg) {
    std::uint64_t dummy = 0;
    if (!up.sock.send(seal(msg, std::string(), &dummy, "up"), kMaxCtrlOut) || !up.sock.flush())
      fail_upstream("control channel: " + up.sock.error());
  }

  // The upstream's control channel: completes the connect, writes what is
  // queued, reads and acts on its messages in order.
  void service_up() {
    if (source || up.state == Up::kIdle || !up.sock.is_open()) return;
    if (!up.tcp_up) {
      pollfd p{up.sock.fd(), POLLOUT, 0};
      if (::poll(&p, 1, 0) <= 0) return;
      if (const std::string why = up.sock.connect_result(); !why.empty()) {
        if (why == "not connected yet") return;
        fail_upstream("cannot connect to " + from_addr.str() + ": " + why);
        return;
      }
      up.tcp_up = true;
    }
    if (up.sock.want_write() && !up.sock.flush()) {
      fail_upstream("control channel: " + up.sock.error());
      return;
    }
    const std::uint64_t gen = up.gen;
    std::vector<std::vector<std::uint8_t>> frames;
    const std::size_t cap =
        up.state == Up::kAuthed ? wire::control_cap(o.region_options.manifest_bytes) : wire::kHandshakeBytes;
    const bool ok = up.sock.receive(cap, &frames);
    for (auto& f : frames) {
      if (up.gen != gen || up.state == Up::kIdle) return;
      try {
        on_down_message(f);
      } catch (const wire::ProtocolError& e) {
        fail_upstream(std::string("protocol error: ") + e.what());
        return;
      }
    }
    if (!ok && up.gen == gen && up.state != Up::kIdle) {
      std::string why = up.sock.error();
      if (why.find("more than the") != std::string::npos)
        why += up.state == Up::kAuthed ? " (a sync's manifest must fit this node's region: raise --manifest-bytes)"
                                       : " (a handshake message)";
      fail_upstream(up.state == Up::kAuthed ? "connection lost: " + why : "during the handshake: " + why);
    }
  }

  // Tagged messages other than chunk bytes on the upstream's worker: junk
  // (a peer that reached UCX's own port), drained a batch per pass. Junk
  // is a tag without bit 63, or (once authenticated) a data tag whose serial
  // is neither the current sync's nor that of a sync the upstream announced
  // and this relay has not begun yet (its sync message still queued in
  // up.ctrl, or the next one: its fragments may come before its message);
  // before that, every tagged message. UCX shows only the first message of
  // a tag and mask: junk queued behind a fragment that is awaited is
  // drained once that fragment is taken.
  void drain_up_junk() {
    if (!up.w || up.state == Up::kIdle) return;
    while (up.junk_busy < kJunkBatch) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h m = ucp_tag_probe_nb(up.w->get(), 0, wire::kDataBit, 1, &info);
      if (m == nullptr) {
        m = ucp_tag_probe_nb(up.w->get(), wire::kDataBit, wire::kDataBit, 0, &info);
        if (m == nullptr) return;
        if (up.state == Up::kAuthed) {
          const std::uint32_t serial = static_cast<std::uint32_t>(info.sender_tag >> 32) & wire::kSerialMask;
          const std::uint32_t cur = wire::data_serial(up.tag_base, up.syncs_begun);
          if (((serial - cur) & wire::kSerialMask) <= up.ctrl.size() + 1) return;  // awaited, or soon
        }
        m = ucp_tag_probe_nb(up.w->get(), info.sender_tag, wire::kFullMask, 1, &info);
        if (m == nullptr) return;
      }
      Op* op = new_op(Op::kJunkRecv, up.w->get());
      op->gen = up.gen;
      op->msg.resize(64);
      ucp_request_param_t p = recv_param(op);
      ++up.junk_busy;
      track(op, ucp_tag_msg_recv_nbx(up.w->get(), op->msg.data(), op->msg.size(), m, &p));
      ++ignored;
      status_dirty = true;
      rlog.log("ignored", "a tagged message that is not chunk bytes of this sync on the upstream's worker: dropped",
               mono_ns());
    }
  }

  // Why chunks of `chunk_bytes` do not fit this node ("" when they do).
  std::string chunk_room_problem(std::uint64_t chunk_bytes) const {
    wire::ChunkRoom room;
    room.buffers = o.buffers;
    room.region_slots = o.region_options.slot_bytes == 0 ? o.region_options.slots : 0;
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) room.memory_bytes = static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page);
    struct statvfs fs {};
    if (::statvfs(region_dir().c_str(), &fs) == 0) room.fs_bytes = static_cast<std::uint64_t>(fs.f_blocks) * fs.f_frsize;
    return wire::chunk_problem(chunk_bytes, room);
  }

  // Connects the data endpoint to `addr` (HOST:PORT); false when it failed
  // the upstream connection.
  bool connect_data(const std::string& addr) {
    sockaddr_storage ss{};
    socklen_t len = 0;
    try {
      ss = ucx::resolve(parse_address(addr), false, &len);
    } catch (const Error& e) {
      fail_upstream(std::string("the upstream's data address: ") + e.what());
      return false;
    }
    up.arg = std::make_unique<EpArg>(EpArg{&sink, 0, up.gen});
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    ep.sockaddr.addrlen = len;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = ep_error_cb;
    ep.err_handler.arg = up.arg.get();
    if (const ucs_status_t s = ucp_ep_create(up.w->get(), &ep, &up.ep); s != UCS_OK) {
      up.ep = nullptr;
      fail_upstream("cannot open the data connection to " + addr + ": " + ucx::status_str(s));
      return false;
    }
    return true;
  }

  // A control message from the upstream, on its control channel.
  void on_down_message(std::vector<std::uint8_t>& msg) {
    const std::string from = "upstream " + from_addr.str();
    switch (up.state) {
      case Up::kConnecting: {
        wire::Reader r(msg, false);
        if (r.type() == Type::kRefused) {
          upstream_refused(from + " refused this relay: " + printable(r.str(wire::kHandshakeBytes)));
          return;
        }
        if (r.type() != Type::kChallenge) throw wire::ProtocolError("expected a challenge");
        const std::uint32_t proto = r.u32();
        if (proto != wire::kProto) {
          upstream_refused(from + " speaks relay protocol " + std::to_string(proto) + ", this relay " +
                           std::to_string(wire::kProto) + ": run the same shmcast version on every node");
          return;
        }
        up.tr.conn = r.u64();
        r.bytes(&up.tr.server_nonce);
        const std::string region = r.str(256);
        r.expect_done();
        if (region != o.region) {
          upstream_refused(from + " serves region '" + printable(region) + "', not '" + o.region + "'");
          return;
        }
        up.tr.region = o.region;
        up.tr.client_nonce = auth::nonce();
        Writer w(Type::kResponse);
        w.bytes(up.tr.client_nonce).bytes(auth::client_proof(o.key, up.tr)).str(o.region);
        send_up(w);
        if (up.state == Up::kIdle) return;
        up.state = Up::kAwaitWelcome;
        set_state("authenticating");
        return;
      }
      case Up::kAwaitWelcome: {
        wire::Reader r0(msg, false);
        if (r0.type() == Type::kRefused) {
          upstream_refused(from + " refused this relay: " + printable(r0.str(wire::kHandshakeBytes)));
          return;
        }
        if (r0.type() != Type::kWelcome) throw wire::ProtocolError("expected a welcome");
        up.session = auth::session_key(o.key, up.tr);
        std::optional<wire::Reader> r;
        try {
          r.emplace(verified(msg));
        } catch (const wire::ProtocolError&) {
          upstream_refused(from + " did not prove the key (its welcome fails the MAC): not accepting its data");
          return;
        }
        wire::Mac proof{};
        r->bytes(&proof);
        const std::uint64_t chunk_bytes = r->u64();
        (void)r->u32();  // flags: the upstream's checksum setting (each hop checks what it receives)
        const std::string data_addr = r->str(256);
        r->expect_done();
        if (!auth::equal(proof, auth::server_proof(o.key, up.tr))) {
          upstream_refused(from + " did not prove the key: not accepting its data");
          return;
        }
        if (chunk_bytes != 0)
          if (const std::string why = chunk_room_problem(chunk_bytes); !why.empty()) {
            fail_upstream("the upstream's " + why);
            return;
          }
        // The data connection, to the listener the upstream opened for it
        // (its address is in the welcome, which the session key covers).
        if (!connect_data(data_addr)) return;
        up.state = Up::kAuthed;
        up.backoff_ns = 0;
        up.since_unix_ns = unix_ns();
        up.last_error.clear();
        up.tag_base = auth::data_tag_base(up.session);
        if (chunk_bytes != 0) {
          up.chunk_bytes = chunk_bytes;
          push_writer(WCmd{WCmd::kOpen, nullptr, -1, 0, nullptr, 0, 0, chunk_bytes, {}});
        }
        log("connected to upstream " + from_addr.str() + " (connection " + std::to_string(up.tr.conn) +
            "): key proven both ways");
        set_state("connected");
        return;
      }
      case Up::kAuthed: {
        (void)verified(msg);  // checks the MAC and the sequence number now, in arrival order
        up.ctrl.push_back(std::move(msg));
        return;
      }
      case Up::kIdle: return;
    }
  }

  // The message checked against the session key; a Reader over its body.
  wire::Reader verified(const std::vector<std::uint8_t>& msg) {
    if (msg.size() < wire::kHeaderBytes + wire::kMacBytes) throw wire::ProtocolError("control message too short");
    wire::Mac got{};
    std::memcpy(got.data(), msg.data() + msg.size() - wire::kMacBytes, wire::kMacBytes);
    const wire::Mac want = auth::message_mac(
        up.session, "down", std::span<const std::uint8_t>(msg.data(), msg.size() - wire::kMacBytes));
    if (!auth::equal(got, want)) throw wire::ProtocolError("control message fails its MAC");
    wire::Reader r(msg, true);
    if (r.seq() != up.recv_seq) throw wire::ProtocolError("control message out of sequence (replayed?)");
    ++up.recv_seq;
    return r;
  }

  // Acts on queued upstream control messages, in order.
  void process_up_ctrl() {
    if (!up.ctrl.empty() && in.plan) in.progress_ns = mono_ns();
    while (!up.ctrl.empty()) {
      std::vector<std::uint8_t>& msg = up.ctrl.front();
      wire::Reader r(msg, true);
      switch (r.type()) {
        case Type::kSync: {
          if (in.plan) return;  // the previous sync is still being received
          auto plan = std::make_shared<SyncPlan>(wire::decode_sync(r));
          if (const std::string why = chunk_room_problem(plan->chunk_bytes); !why.empty()) {
            fail_upstream("cannot take the upstream's sync " + std::to_string(plan->version) + ": its " + why);
            return;
          }
          bool ready = false;
          try {
            ready = ensure_bufs(plan->chunk_bytes);  // false: the chunk size changed, wait for the buffers
          } catch (const Error& e) {  // an upstream's chunk size this node cannot hold
            fail_upstream(std::string("cannot take the upstream's sync: ") + e.what());
            return;
          }
          if (!ready) return;
          begin_in(plan);
          break;
        }
        case Type::kChunk: {
          const std::uint64_t v = r.u64();
          const std::uint32_t c = r.u32();
          const std::uint64_t len = r.u64(), sum = r.u64();
          r.expect_done();
          if (!in.plan || v != in.plan->version) throw wire::ProtocolError("chunk message outside its sync");
          const auto& dc = in.plan->data_chunks;
          const auto it = std::lower_bound(dc.begin(), dc.end(), c);
          if (it == dc.end() || *it != c || len != in.plan->chunk_len(c))
            throw wire::ProtocolError("chunk message for a chunk the sync does not have");
          In::Chunk& ch = in.chunks[static_cast<std::size_t>(it - dc.begin())];
          ch.have_sum = true;
          ch.sum = sum;
          ch.len = len;
          break;
        }
        case Type::kEnd: {
          const std::uint64_t v = r.u64();
          const std::uint64_t sent = r.u64();
          r.expect_done();
          if (!in.plan || v != in.plan->version || sent != in.plan->total_frags())
            throw wire::ProtocolError("end message does not match the sync");
          in.ended = true;
          break;
        }
        case Type::kAbort: {
          const std::uint64_t v = r.u64();
          const std::uint64_t sent = r.u64();
          const std::string why = r.str();
          r.expect_done();
          if (!in.plan || v != in.plan->version || sent > in.plan->total_frags())
            throw wire::ProtocolError("abort message does not match the sync");
          abort_in(sent, "upstream aborted sync " + std::to_string(v) + ": " + printable(why, 1000));
          break;
        }
        default: throw wire::ProtocolError(std::string("unexpected ") + wire::type_name(r.type()) + " message");
      }
      up.ctrl.pop_front();
    }
  }

  void begin_in(const std::shared_ptr<const SyncPlan>& plan) {
    in = In{};
    in.serial = ++in_serial;
    in.tag_serial = wire::data_serial(up.tag_base, ++up.syncs_begun);  // the upstream counts its syncs to us alike
    in.plan = plan;
    in.chunks.resize(plan->data_chunks.size());
    in.limit = plan->data_chunks.size();
    in.limit_frags = plan->total_frags();
    in.direct = o.direct_receive && local_slot_bytes(plan->chunk_bytes) == plan->chunk_bytes;
    in.start_ns = in.progress_ns = mono_ns();
    up.chunk_bytes = plan->chunk_bytes;
    push_writer(WCmd{WCmd::kBegin, plan, -1, 0, nullptr, 0, 0, plan->chunk_bytes, {}});
    const int n = forward_begin(plan);
    set_state("syncing");
    log("sync " + std::to_string(plan->version) + " from upstream: " + std::to_string(plan->specs.size()) +
        " tensors, " + coarse_bytes(plan->payload_bytes) + ", " + std::to_string(plan->data_chunks.size()) +
        " chunks of " + std::to_string(plan->total_frags()) + " fragments; forwarding to " + std::to_string(n) +
        " downstream" + (in.direct ? "; receiving into this node's slots" : ""));
  }

  // The upstream abandoned the sync after sending `sent` fragments: those
  // still arrive (every message sent is received, so that no sender waits on
  // a rendezvous for ever); receives for the others are cancelled.
  void abort_in(std::uint64_t sent, const std::string& why) {
    log(why);
    if (!in.discard) {
      push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, why});
      forward_abort(why);
    }
    {
      std::lock_guard<std::mutex> g(smu);
      ++st.aborted;
      st.last_error = why;
    }
    in.aborted = true;
    in.discard = true;
    const auto& fb = in.plan->frag_base;  // positions with a fragment below `sent`
    in.limit = std::min(in.limit, static_cast<std::size_t>(std::lower_bound(fb.begin(), fb.end() - 1, sent) - fb.begin()));
    in.limit_frags = std::min(in.limit_frags, sent);
    for (std::size_t i = 0; i < in.posted; ++i) {
      In::Chunk& ch = in.chunks[i];
      for (std::size_t j = 0; j < ch.ops.size(); ++j)
        if (Op* op = ch.ops[j]; op && fb[i] + j >= sent && op->req && !op->done)
          up.w->cancel(op->req, [op] { return !op->done.load(std::memory_order_acquire); });
    }
  }

  // Posts receives into free buffers, forwards fragments as they arrive,
  // hands complete chunks on in order.
  void pump_in() {
    if (!in.plan || up.state != Up::kAuthed) return;
    const SyncPlan& p = *in.plan;
    take_lend_replies();
    take_verified();
    // Direct receive: ask the writer to lend the slots of the next chunks,
    // as far ahead as this node's region allows (the writer publishes the
    // chunks handed to it in order, so chunk data_chunks[processed - 1] and
    // all before it are published by the time it reads the request).
    const std::uint64_t K = region_slots.load();
    while (in.direct && !in.discard && in.asked < in.limit && K > 0) {
      const std::uint64_t pub = in.processed > 0 ? p.data_chunks[in.processed - 1] + 1ull : 0;
      if (p.data_chunks[in.asked] >= pub + K) break;
      in.chunks[in.asked].lend = 1;
      push_writer(WCmd{WCmd::kLend, in.plan, -1, p.data_chunks[in.asked], nullptr, 0, 0, 0, {}, in.serial, in.asked});
      ++in.asked;
    }
    while (in.posted < in.limit) {
      const std::size_t pos = in.posted;
      In::Chunk& ch = in.chunks[pos];
      int b = -1;
      if (ch.lend == 1) break;  // the writer has not answered yet
      if (ch.lend == 2) {
        b = slot_buf(ch.slot_p, ch.slot_gen);
      } else {
        if (in.direct && pos >= in.asked && !in.discard) break;  // not asked yet
        b = free_buf();
        if (b < 0) break;
      }
      const std::uint32_t c = p.data_chunks[pos];
      Buffer& buf = bref(b);
      add_ref(b);  // the chunk's
      ch.buf = b;
      ch.len = p.chunk_len(c);
      const std::uint32_t nf = p.frags(c);
      ch.ops.assign(nf, nullptr);
      ch.got.assign(nf, 0);
      ch.left = nf;
      ++in.posted;
      for (std::uint32_t j = 0; j < nf; ++j) {
        if (p.frag_base[pos] + j >= in.limit_frags) {  // never sent (aborted)
          ch.got[j] = 2;
          ch.ok = false;
          --ch.left;
          continue;
        }
        Op* op = new_op(Op::kDataRecv, up.w->get());
        op->gen = up.gen;
        op->serial = in.serial;
        op->buf = b;
        op->pos = pos;
        op->chunk = c;
        op->frag = j;
        op->version = p.version;
        op->bytes = p.frag_len(c, j);
        add_ref(b);  // the receive's
        ch.ops[j] = op;
        ucp_request_param_t prm = recv_param(op, buf.reg.memh);
        track(op, ucp_tag_recv_nbx(up.w->get(), buf.p + static_cast<std::uint64_t>(j) * p.frag_bytes, op->bytes,
                                   wire::data_tag(in.tag_serial, p.frag_tag(c, j)), wire::kFullMask, &prm));
      }
    }
    while (!in.discard && in.fwd_pos < in.posted) {
      In::Chunk& ch = in.chunks[in.fwd_pos];
      if (in.fwd_frag >= ch.got.size()) {
        ++in.fwd_pos;
        in.fwd_frag = 0;
        continue;
      }
      if (ch.got[in.fwd_frag] != 1) break;
      const std::uint32_t c = p.data_chunks[in.fwd_pos];
      const Buffer& b = bref(ch.buf);
      forward_frag(c, in.fwd_frag, b.p + static_cast<std::uint64_t>(in.fwd_frag) * p.frag_bytes,
                   p.frag_len(c, in.fwd_frag), b.reg.memh, ch.buf);
      ++in.fwd_frag;
    }
    // Chunks received into slots are checked off this thread, as they complete.
    if (o.checksums && !in.discard) {
      for (std::size_t i = in.processed; i < in.posted; ++i) {
        In::Chunk& ch = in.chunks[i];
        if (ch.verify != 0 || ch.left > 0 || !ch.have_sum || !ch.ok || ch.buf < kSlotBase) continue;
        if (!verifier) verifier = std::make_unique<Verifier>([this] { wake(); });
        add_ref(ch.buf);  // the check's: the slot stays until its result is taken
        verifier->submit(Verifier::Job{in.serial, i, bref(ch.buf).p, ch.len, ch.sum, ch.buf, false});
        ch.verify = 1;
      }
    }
    while (in.processed < in.posted) {
      In::Chunk& ch = in.chunks[in.processed];
      if (ch.left > 0) break;
      if (!in.discard && !ch.have_sum) break;
      if (!in.discard && ch.verify == 1) break;  // being checked
      const std::uint32_t c = p.data_chunks[in.processed];
      if (!in.discard && ch.ok) {
        const Buffer& b = bref(ch.buf);
        forward_sum(c, ch.len, ch.sum);
        add_ref(ch.buf);  // the writer's
        push_writer(WCmd{WCmd::kChunk, in.plan, ch.buf, c, b.p, ch.len, ch.sum, p.chunk_bytes,
                         ch.verify == 3 ? "bad" : "", in.serial, in.processed, ch.verify == 2});
        std::lock_guard<std::mutex> g(smu);
        st.bytes_in += ch.len;
      }
      release_buf(ch.buf);  // the chunk's
      ch.buf = -1;
      ++in.processed;
    }
    if (in.processed == in.posted && in.posted >= in.limit && (in.ended || in.aborted)) {
      if (in.ended && !in.discard) {
        forward_end();
        push_writer(WCmd{WCmd::kEnd, in.plan, -1, 0, nullptr, 0, 0, 0, {}});
        const double s = static_cast<double>(mono_ns() - in.start_ns) * 1e-9;
        log("sync " + std::to_string(p.version) + " received and forwarded: " + coarse_bytes(p.payload_bytes) + " in " +
            std::to_string(s) + " s (" + fmt_gbs(p.payload_bytes, s) + ")");
        std::lock_guard<std::mutex> g(smu);
        ++st.syncs;
        st.last_version = p.version;
        st.last_bytes = p.payload_bytes;
        st.last_seconds = s;
      }
      in = In{};
      set_state("connected");
    }
  }

  // ------------------------------------------------------------ completions

  void on_complete(Op* op) {
    switch (op->kind) {
      case Op::kDataSend: {
        release_buf(op->buf);
        if (auto f = fan.find(op->ord); f != fan.end()) {
          if (f->second.first_done_ns == 0 && op->status == UCS_OK) f->second.first_done_ns = mono_ns();
          if (--f->second.pending <= 0) fan.erase(f);
        }
        if (auto it = downs.find(op->conn); it != downs.end()) {
          Down& d = *it->second;
          --d.pending_data;
          d.pend.erase(op->ord);
          d.progress_ns = mono_ns();
          if (op->status == UCS_OK) {
            d.bytes_sent += op->bytes;
            std::lock_guard<std::mutex> g(smu);
            st.bytes_out += op->bytes;
          } else {
            drop_down(d, "chunk send failed: " + ucx::status_str(op->status));
          }
        }
        if (source)
          if (auto it = src_chunks.find(op->chunk);
              it != src_chunks.end() && it->second.pending > 0 && it->second.version == op->version) {
            --it->second.pending;
            maybe_release(it);
          }
        return;
      }
      case Op::kDataRecv: {
        release_buf(op->buf);  // the receive's
        if (op->gen != up.gen || !in.plan || op->serial != in.serial || op->pos >= in.chunks.size()) return;
        In::Chunk& ch = in.chunks[op->pos];
        if (op->frag >= ch.ops.size() || ch.ops[op->frag] != op) return;
        ch.ops[op->frag] = nullptr;
        --ch.left;
        if (op->status != UCS_OK) {
          ch.got[op->frag] = 2;
          ch.ok = false;
          // Only an abort (discard) cancels on purpose; anything else loses
          // the chunk, and the sync with it.
          if (op->status != UCS_ERR_CANCELED || !in.discard)
            fail_upstream("chunk receive failed: " + ucx::status_str(op->status));
          return;
        }
        if (op->length != op->bytes) {
          ch.got[op->frag] = 2;
          ch.ok = false;
          fail_upstream("fragment " + std::to_string(op->frag) + " of chunk " + std::to_string(op->chunk) + " has " +
                        std::to_string(op->length) + " bytes, expected " + std::to_string(op->bytes));
          return;
        }
        ch.got[op->frag] = 1;
        in.progress_ns = mono_ns();
        return;
      }
      case Op::kJunkRecv: {
        if (op->worker == (lw ? lw->get() : nullptr)) --lw_junk_busy;
        else if (op->gen == up.gen && up.junk_busy > 0) --up.junk_busy;
        return;
      }
      case Op::kClose: {  // a downstream's data endpoint is closed: service_downs() ends it
        if (op->conn != 0)
          if (auto it = downs.find(op->conn); it != downs.end()) {
            it->second->ep = nullptr;
            it->second->ep_closing = false;
          }
        return;
      }
    }
  }

  // Moves what callbacks filed to the network thread's own lists.
  void take_sink() {
    std::lock_guard<std::mutex> g(sink.mu);
    completed.insert(completed.end(), sink.completed.begin(), sink.completed.end());
    sink.completed.clear();
    ep_failures.insert(ep_failures.end(), sink.failures.begin(), sink.failures.end());
    sink.failures.clear();
  }
  void process_completions() {
    for (;;) {
      take_sink();
      if (completed.empty()) break;
      std::vector<Op*> list;
      list.swap(completed);
      for (Op* op : list) {
        auto it = ops.find(op);
        if (it == ops.end()) continue;
        std::unique_ptr<Op> own = std::move(it->second);
        ops.erase(it);
        try {
          on_complete(op);
        } catch (const wire::ProtocolError& e) {
          if (up.state != Up::kIdle) fail_upstream(std::string("protocol error: ") + e.what());
        }
        if (op->req) ucp_request_free(op->req);
      }
    }
  }

  void process_ep_failures() {
    take_sink();
    auto list = std::move(ep_failures);
    ep_failures.clear();
    for (const EpFailure& f : list) {
      const std::uint64_t conn = f.conn;
      const ucs_status_t status = f.status;
      if (conn == 0) {
        if (f.gen == up.gen && up.state != Up::kIdle)
          fail_upstream(up.state == Up::kAuthed ? "connection lost (" + ucx::status_str(status) + ")"
                                                : "cannot connect (" + ucx::status_str(status) + ")");
        continue;
      }
      if (auto it = downs.find(conn); it != downs.end())
        drop_down(*it->second, "connection lost (" + ucx::status_str(status) + ")");
    }
  }

  void check_timers() {
    const std::int64_t now = mono_ns();
    for (auto& [id, d] : downs) {
      if (d->state == Down::kHandshake && now > d->first_deadline_ns)
        drop_down(*d, "no response to the challenge within " +
                          std::to_string(o.first_response_timeout.count() / 1000000) + " ms (--first-response-timeout)");
      if (d->state == Down::kJoining && now > d->deadline_ns) drop_down(*d, "no data connection in time");
      if (d->state == Down::kActive && d->pending_data > 0 && now - d->progress_ns > o.peer_timeout.count())
        drop_down(*d, "took no chunk for " + std::to_string(o.peer_timeout.count() / 1000000) + " ms (stalled)");
      // Isolation: a downstream that has not taken a fragment which another
      // downstream took more than max_lag ago holds the others back (the
      // fragment's buffer, or the source's slot, waits for it). It is
      // dropped from the sync, reconnects and takes the next one.
      if ((d->state == Down::kActive || d->state == Down::kReady) && !d->pend.empty())
        if (auto f = fan.find(*d->pend.begin());
            f != fan.end() && f->second.first_done_ns != 0 && now - f->second.first_done_ns > o.max_lag.count())
          drop_down(*d, "fell behind the other downstream relays by more than " +
                            std::to_string(o.max_lag.count() / 1000000) +
                            " ms (it has not taken a fragment they took " +
                            std::to_string((now - f->second.first_done_ns) / 1000000) + " ms ago)");
    }
    rlog.flush(now);
    if (!source) {
      // An upstream that sends nothing mid-sync (a stalled or broken relay;
      // the source itself gives up on its trainer after 60 s) is dropped:
      // the sync aborts here and downstream, and the relay reconnects.
      if (in.plan && up.state == Up::kAuthed && now - in.progress_ns > o.upstream_timeout.count())
        fail_upstream("sent nothing for " + std::to_string(o.upstream_timeout.count() / 1000000) +
                      " ms in the middle of sync " + std::to_string(in.plan->version) + " (stalled)");
      if (up.state == Up::kIdle && now >= up.retry_at_ns && !stopping) connect_upstream();
      if ((up.state == Up::kConnecting || up.state == Up::kAwaitWelcome) && now > up.deadline_ns)
        fail_upstream("no handshake from the upstream in time");
    }
  }

  // ------------------------------------------------------------ source reader

  // Network thread: acts on the reader's requests.
  void handle_cmds() {
    std::deque<SrcCmd> list;
    {
      std::lock_guard<std::mutex> g(cmd_mu);
      list.swap(cmds);
    }
    for (SrcCmd& c : list) {
      switch (c.t) {
        case SrcCmd::kOpened:
          src_slot_bytes = c.len;
          reply(c.ticket, 0);
          break;
        case SrcCmd::kBegin: reply(c.ticket, forward_begin(c.plan)); break;
        case SrcCmd::kChunk: {
          ucp_mem_h memh = nullptr;
          try {
            memh = slot_registration(c.base);
          } catch (const Error& e) {
            log(std::string("cannot register a slot with UCX (sending it unregistered): ") + e.what());
          }
          SrcChunk& sc = src_chunks[c.chunk];
          sc = SrcChunk{0, false, out.plan ? out.plan->version : 0, std::move(c.release)};
          sc.pending = forward_chunk(c.chunk, c.base, memh);
          std::lock_guard<std::mutex> g(smu);
          st.bytes_in += c.len;
          break;
        }
        case SrcCmd::kSum:
          forward_sum(c.chunk, c.len, c.sum);
          if (auto it = src_chunks.find(c.chunk); it != src_chunks.end()) {
            it->second.sum_sent = true;
            maybe_release(it);
          }
          break;
        case SrcCmd::kEnd: forward_end(); break;
        case SrcCmd::kAbort: {
          forward_abort(c.why);
          std::lock_guard<std::mutex> g(smu);
          st.last_error = c.why;
          break;
        }
        case SrcCmd::kClosed:
          for (auto& [base, reg] : slot_regs) ucx::unregister_memory(ctx->get(), &reg);
          slot_regs.clear();
          src_slot_bytes = 0;
          reply(c.ticket, 0);
          break;
      }
    }
  }
  ucp_mem_h slot_registration(const std::byte* base) {
    auto it = slot_regs.find(base);
    if (it != slot_regs.end()) return it->second.memh;
    ucx::Registration r = ucx::register_memory(ctx->get(), const_cast<std::byte*>(base), src_slot_bytes);
    slot_regs.emplace(base, r);
    return r.memh;
  }
  void maybe_release(std::map<std::uint32_t, SrcChunk>::iterator it) {
    if (it->second.pending > 0 || !it->second.sum_sent) return;
    if (it->second.release) it->second.release();
    src_chunks.erase(it);
  }
  // Shutdown: whatever is still out (its sends are finished or cancelled).
  void release_src_chunks() {
    for (auto& [c, sc] : src_chunks)
      if (sc.release) sc.release();
    src_chunks.clear();
  }
  void reply(std::uint64_t ticket, std::int64_t value) {
    {
      std::lock_guard<std::mutex> g(cmd_mu);
      replied_ticket = ticket;
      reply_value = value;
    }
    cmd_cv.notify_all();
  }

  // Reader thread: posts a command; with `wait`, blocks for its reply.
  std::int64_t post(SrcCmd c, bool wait) {
    std::unique_lock<std::mutex> g(cmd_mu);
    const std::uint64_t t = next_ticket++;
    c.ticket = wait ? t : 0;
    cmds.push_back(std::move(c));
    g.unlock();
    wake();
    if (!wait) return 0;
    g.lock();
    while (replied_ticket < t) {
      if (net_done) throw Error(Errc::kAborted, "the relay is stopping");
      cmd_cv.wait_for(g, 100ms);
    }
    return reply_value;
  }

  void reader_main() {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    co.open_timeout = 1s;
    // Slots handed to the network stay held until every downstream has them
    // or was dropped (peer_timeout): visit_chunks() must not give them back
    // to the producer (nor the region be unmapped) before.
    co.chunk_timeout = std::max<Duration>(60s, o.peer_timeout + 10s);
    while (!stopping) {
      std::optional<Consumer> cons;
      set_state("attaching");
      try {
        cons.emplace(Consumer::open(o.region, co));
      } catch (const Error& e) {
        if (e.code() == Errc::kNotFound || e.code() == Errc::kPeerDied || e.code() == Errc::kClosed ||
            e.code() == Errc::kTimeout)
          continue;  // the producer is not there (yet): keep waiting
        if (e.code() == Errc::kNoSeat) {
          note_error(e.what());
          std::this_thread::sleep_for(200ms);
          continue;
        }
        set_fatal(e);
        return;
      }
      const std::uint64_t S = cons->slot_bytes();
      log("attached to region " + o.region + " as consumer (seat " + std::to_string(cons->seat()) + ", slots of " +
          coarse_bytes(S) + ")");
      {
        std::lock_guard<std::mutex> g(smu);
        st.region_ready = true;
        st.region_slot_bytes = S;
      }
      try {
        post(SrcCmd{SrcCmd::kOpened, nullptr, 0, nullptr, S, 0, 0, {}, {}}, true);
        set_state("idle");
        read_syncs(*cons, S);
      } catch (const Error& e) {
        if (e.code() != Errc::kAborted || !stopping) log(std::string("source region: ") + e.what());
      }
      {
        std::lock_guard<std::mutex> g(smu);
        st.region_ready = false;
      }
      try {
        post(SrcCmd{SrcCmd::kClosed, nullptr, 0, nullptr, 0, 0, 0, {}, {}}, true);
      } catch (const Error&) {
      }
      cons.reset();
    }
  }

  // Forwards syncs until the consumer must be reopened (an Error escapes).
  void read_syncs(Consumer& cons, std::uint64_t S) {
    while (!stopping) {
      const SyncInfo* info = nullptr;
      try {
        info = &cons.wait_sync(200ms);
      } catch (const Error& e) {
        if (e.code() == Errc::kTimeout) continue;
        throw;  // PeerDied, Closed, Evicted, Corrupt...: reattach
      }
      if (info->world_size > 1) {
        cons.skip();
        log("sync " + std::to_string(info->version) + " skipped: it comes from " +
            std::to_string(info->world_size) + " sharded producer ranks, and the relay forwards syncs of one "
            "producer (publish the full tensors from one rank into the region the relay reads)");
        std::lock_guard<std::mutex> g(smu);
        ++st.skipped;
        continue;
      }
      auto plan = std::make_shared<SyncPlan>();
      plan->version = info->version;
      plan->chunk_bytes = S;
      plan->frag_bytes = o.fragment_bytes;
      plan->stream_bytes = info->stream_bytes;
      plan->payload_bytes = info->payload_bytes;
      for (const TensorInfo& t : info->tensors) {
        plan->specs.push_back(TensorSpec{t.name, t.dtype, t.shape});
        plan->offsets.push_back(t.stream_offset);
        plan->nbytes.push_back(t.nbytes);
      }
      plan->index_chunks();
      const std::int64_t active = post(SrcCmd{SrcCmd::kBegin, plan, 0, nullptr, 0, 0, 0, {}, {}}, true);
      if (active == 0) {
        cons.skip();
        log("sync " + std::to_string(plan->version) + " skipped: no downstream relay is connected and ready");
        std::lock_guard<std::mutex> g(smu);
        ++st.skipped;
        continue;
      }
      set_state("syncing");
      try {
        // Each slot goes whole, straight from the region, and is released
        // once every downstream has it; the next ones go meanwhile.
        cons.visit_chunks([&](std::uint64_t c, const std::byte* base, std::uint64_t, std::function<void()> release) {
          const auto cu = static_cast<std::uint32_t>(c);
          if (!std::binary_search(plan->data_chunks.begin(), plan->data_chunks.end(), cu)) {
            release();  // padding only: not sent
            return;
          }
          if (stopping) {
            release();
            throw Error(Errc::kAborted, "the relay is stopping");
          }
          post_chunk(cu, base, plan->chunk_len(cu), std::move(release));
        });
        post(SrcCmd{SrcCmd::kEnd, plan, 0, nullptr, 0, 0, 0, {}, {}}, false);
        set_state("idle");
      } catch (const Error& e) {
        post(SrcCmd{SrcCmd::kAbort, plan, 0, nullptr, 0, 0, 0, std::string("source sync aborted: ") + e.what(), {}},
             false);
        log("sync " + std::to_string(plan->version) + " aborted at the source: " + e.what());
        if (e.code() == Errc::kAborted || e.code() == Errc::kTimeout || e.code() == Errc::kChecksum) {
          set_state("idle");
          continue;  // the producer lives on: next sync
        }
        throw;
      }
    }
  }
  // Sends chunk c from the slot; the checksum is computed while the bytes
  // travel. The network thread calls `release` once every downstream has
  // them (or at shutdown).
  void post_chunk(std::uint32_t c, const std::byte* base, std::uint64_t len, std::function<void()> release) {
    {
      std::lock_guard<std::mutex> g(cmd_mu);
      if (net_done) {
        release();
        throw Error(Errc::kAborted, "the relay is stopping");
      }
      cmds.push_back(SrcCmd{SrcCmd::kChunk, nullptr, c, base, len, 0, 0, {}, std::move(release)});
    }
    wake();
    const std::uint64_t sum = o.checksums ? XXH3_64bits(base, len) : 0;
    {
      std::lock_guard<std::mutex> g(cmd_mu);
      cmds.push_back(SrcCmd{SrcCmd::kSum, nullptr, c, nullptr, len, sum, 0, {}, {}});
    }
    wake();
  }

  // ------------------------------------------------------------ region writer

  void push_writer(WCmd c) {
    {
      std::lock_guard<std::mutex> g(wmu);
      wq.push_back(std::move(c));
    }
    wcv.notify_one();
  }

  void take_verified() {
    if (!verifier) return;
    for (const Verifier::Job& j : verifier->take()) {
      release_buf(j.buf);
      if (in.plan && j.serial == in.serial && j.pos < in.chunks.size() && in.chunks[j.pos].verify == 1)
        in.chunks[j.pos].verify = j.ok ? 2 : 3;
    }
  }

  void take_lend_replies() {
    std::vector<LendReply> got;
    {
      std::lock_guard<std::mutex> g(wmu);
      got.swap(lend_replies);
    }
    for (const LendReply& r : got) {
      if (!in.plan || r.serial != in.serial || r.pos >= in.chunks.size()) continue;  // a sync that is over
      In::Chunk& ch = in.chunks[r.pos];
      if (ch.lend != 1) continue;
      if (r.p) {
        ch.lend = 2;
        ch.slot_p = r.p;
        ch.slot_gen = r.gen;
      } else {
        ch.lend = 3;  // the local sync failed: receive buffers from here on
        in.direct = false;
      }
    }
  }

  void take_writer_returns() {
    std::vector<int> done;
    {
      std::lock_guard<std::mutex> g(wmu);
      done.swap(wdone);
    }
    for (int b : done) release_buf(b);
  }

  struct WriterState {
    std::optional<Producer> prod;
    std::uint64_t gen = 0;  // regions created
    bool direct = false;    // the sync in progress is received into lent slots
    bool lent = false;      // ...and a slot of it was lent (write_part is refused from then on)
    std::unique_ptr<Hasher> hasher;
    std::shared_ptr<const SyncPlan> plan;
    bool ok = false;  // the local sync is live
    std::size_t cursor = 0;
  };

  void writer_main() {
    WriterState ws;
    for (;;) {
      std::optional<WCmd> c;
      {
        std::unique_lock<std::mutex> g(wmu);
        if (wq.empty() && !writer_exit) wcv.wait_for(g, 200ms);
        if (!wq.empty()) {
          c = std::move(wq.front());
          wq.pop_front();
        } else if (writer_exit) {
          break;
        }
      }
      if (c) {
        try {
          writer_do(ws, *c);
        } catch (const Error& e) {
          set_fatal(e);
        }
        if (c->t == WCmd::kChunk) {
          {
            std::lock_guard<std::mutex> g(wmu);
            wdone.push_back(c->buf);
          }
          wake();
        }
      }
      // Live consumers of this node's region, for the status file.
      if (ws.prod) {
        std::uint32_t n = 0;
        try {
          n = ws.prod->consumers();
        } catch (...) {
        }
        std::lock_guard<std::mutex> g(smu);
        if (st.region_consumers != n) status_dirty = true;
        st.region_consumers = n;
      }
    }
    if (ws.prod) {
      try {
        if (ws.ok) ws.prod->abort_sync("the relay is stopping");
        ws.prod->close();
      } catch (...) {
      }
    }
  }

  std::uint64_t local_slot_bytes(std::uint64_t chunk_bytes) const {
    return align_slot(o.region_options.slot_bytes ? o.region_options.slot_bytes : chunk_bytes);
  }
  void ensure_region(WriterState& ws, std::uint64_t chunk_bytes, bool fresh) {
    const std::uint64_t want = local_slot_bytes(chunk_bytes);
    if (ws.prod && ws.prod->slot_bytes() == want && !fresh) return;
    if (ws.prod) {
      // No receive or forwarding send may still use the old slots.
      if (!slot_use.wait_free(nullptr, std::chrono::steady_clock::now() + o.peer_timeout + std::chrono::seconds(5)))
        throw Error(Errc::kTimeout, "the region cannot be recreated: network operations still use its slots after "
                                    "peer_timeout; restart the relay");
      ws.prod->close();
      ws.prod.reset();
    }
    ProducerOptions po = o.region_options;
    po.slot_bytes = want;
    ws.prod.emplace(Producer::create(o.region, po));
    ++ws.gen;
    region_slot_bytes = ws.prod->slot_bytes();
    region_slots = ws.prod->slots();
    wake();
    log(std::string(fresh ? "region recreated: " : "region created: ") + o.region + " in " + region_dir() + ", " +
        std::to_string(ws.prod->slots()) + " slots of " + coarse_bytes(ws.prod->slot_bytes()));
    std::lock_guard<std::mutex> g(smu);
    st.region_ready = true;
    st.region_slot_bytes = ws.prod->slot_bytes();
    status_dirty = true;
  }

  // Local failures (a stalled consumer here) end the local sync only; the
  // chunks are forwarded regardless. Errors that retrying cannot fix escape.
  void writer_do(WriterState& ws, const WCmd& c) {
    switch (c.t) {
      case WCmd::kOpen: ensure_region(ws, c.chunk_bytes, false); return;
      case WCmd::kBegin: {
        ensure_region(ws, c.chunk_bytes, false);
        if (c.plan->version <= ws.prod->last_version()) {
          log("upstream version " + std::to_string(c.plan->version) + " is not above this region's " +
              std::to_string(ws.prod->last_version()) + " (the source region restarted): recreating the region");
          ensure_region(ws, c.chunk_bytes, true);
        }
        ws.plan = c.plan;
        ws.cursor = 0;
        ws.ok = false;
        ws.direct = o.direct_receive && ws.prod->slot_bytes() == c.plan->chunk_bytes;
        ws.lent = false;
        try {
          ws.prod->begin_sync(c.plan->specs, c.plan->version);
          ws.ok = true;
        } catch (const Error& e) {
          local_failure(e.what());
        }
        return;
      }
      case WCmd::kChunk: {
        if (!ws.ok || ws.plan != c.plan) return;
        const std::string bad = "chunk " + std::to_string(c.chunk) + " of sync " + std::to_string(c.plan->version) +
                                " fails its XXH3 checksum across the hop";
        try {
          if (ws.direct) {
            // Received straight into the slot lend_chunk() gave: verify,
            // then publish (consumers never see a chunk that fails).
            if (c.buf < kSlotBase) throw Error(Errc::kInvalidArgument, "chunk " + std::to_string(c.chunk) +
                                                                           " did not arrive in its slot");
            if (o.checksums && (!c.why.empty() || (!c.verified && XXH3_64bits(c.data, c.len) != c.sum)))
              throw Error(Errc::kChecksum, bad);
            ws.prod->publish_chunks(c.chunk + 1ull);
          } else if (!o.checksums) {
            write_chunk(ws, c, 0, c.len);
          } else if (ws.prod->slot_bytes() == c.plan->chunk_bytes) {
            // This chunk is exactly one slot here, published once the last
            // tensor byte in it is written (or with the next chunk's first).
            // Hash on the hasher thread while copying all but the last 4 KiB
            // of tensor bytes; write those only once the sum matched.
            if (!ws.hasher) ws.hasher = std::make_unique<Hasher>();
            Hasher::Job job(*ws.hasher, c.data, c.len);
            const std::uint64_t held = data_end(ws, c), tail = held > 4096 ? held - 4096 : 0;
            write_chunk(ws, c, 0, tail);
            if (job.sum() != c.sum) throw Error(Errc::kChecksum, bad);
            write_chunk(ws, c, tail, c.len);
          } else {
            if (XXH3_64bits(c.data, c.len) != c.sum) throw Error(Errc::kChecksum, bad);
            write_chunk(ws, c, 0, c.len);
          }
        } catch (const Error& e) {
          if (e.code() == Errc::kChecksum || e.code() == Errc::kInvalidArgument) ws.prod->abort_sync(e.what());
          ws.ok = false;  // write_part() and publish_chunks() aborted the sync already
          local_failure(e.what());
        }
        return;
      }
      case WCmd::kEnd: {
        if (!ws.ok || ws.plan != c.plan) return;
        try {
          const SyncPlan& p = *ws.plan;
          // A sync with no data chunk (only empty tensors) lent nothing.
          if (!ws.lent)
            for (; ws.cursor < p.specs.size(); ++ws.cursor) ws.prod->write_part(ws.cursor, 0, nullptr, 0);
          ws.prod->end_sync();
          std::lock_guard<std::mutex> g(smu);
          ++st.region_syncs;
          st.region_version = p.version;
          status_dirty = true;
        } catch (const Error& e) {
          ws.prod->abort_sync(e.what());  // no sync may stay open: the next begin_sync would be refused
          local_failure(e.what());
        }
        ws.ok = false;
        return;
      }
      case WCmd::kAbort: {
        if (ws.ok && ws.prod) ws.prod->abort_sync(c.why);
        ws.ok = false;
        return;
      }
      case WCmd::kLend: {
        // The network thread receives chunk c.chunk straight into its slot.
        std::byte* got = nullptr;
        if (ws.ok && ws.plan == c.plan && ws.direct) {
          try {
            const std::span<std::byte> sp = ws.prod->lend_chunk(c.chunk);  // waits for this node's consumers
            // ...and for forwarding sends of the slot's previous chunk.
            if (!slot_use.wait_free(sp.data(), std::chrono::steady_clock::now() + o.peer_timeout +
                                                   std::chrono::seconds(5))) {
              const std::string why = "slot of chunk " + std::to_string(c.chunk) +
                                      " is still being forwarded downstream after peer_timeout";
              ws.prod->abort_sync(why);
              throw Error(Errc::kTimeout, why);
            }
            got = sp.data();
            ws.lent = true;
          } catch (const Error& e) {
            ws.ok = false;  // lend_chunk() aborted the sync already
            local_failure(e.what());
          }
        }
        {
          std::lock_guard<std::mutex> g(wmu);
          lend_replies.push_back(LendReply{c.serial, c.pos, got, ws.gen});
        }
        wake();
        return;
      }
    }
  }

  // Where the tensor bytes in chunk c.chunk end, relative to its start.
  std::uint64_t data_end(const WriterState& ws, const WCmd& c) const {
    const SyncPlan& p = *ws.plan;
    const std::uint64_t base = static_cast<std::uint64_t>(c.chunk) * p.chunk_bytes, end = base + c.len;
    std::uint64_t last = 0;
    for (std::size_t j = ws.cursor; j < p.specs.size() && p.offsets[j] < end; ++j)
      if (p.nbytes[j] > 0) last = std::min(p.offsets[j] + p.nbytes[j], end) - base;
    return last;
  }
  // Writes bytes [from, to) of chunk c.chunk (pieces of it in order).
  void write_chunk(WriterState& ws, const WCmd& c, std::uint64_t from, std::uint64_t to) {
    const SyncPlan& p = *ws.plan;
    const std::uint64_t base = static_cast<std::uint64_t>(c.chunk) * p.chunk_bytes;
    const std::uint64_t start = base + from, end = base + to;
    if (end <= start) return;
    for (std::size_t j = ws.cursor; j < p.specs.size(); ++j) {
      const std::uint64_t n = p.nbytes[j];
      if (n == 0) {
        ws.prod->write_part(j, 0, nullptr, 0);
        ws.cursor = j + 1;
        continue;
      }
      const std::uint64_t a = p.offsets[j], b = a + n;
      if (a >= end) break;
      const std::uint64_t lo = std::max(a, start), hi = std::min(b, end);
      ws.prod->write_part(j, lo - a, c.data + (lo - base), hi - lo);
      if (hi < b) break;  // the tensor goes on in the next chunk
      ws.cursor = j + 1;
    }
  }

  void local_failure(const std::string& why) {
    log("this node's region: sync failed: " + why);
    std::lock_guard<std::mutex> g(smu);
    ++st.region_failed;
    st.region_error = why;
    status_dirty = true;
  }

  // ------------------------------------------------------------ status

  void write_status(bool force) {
    if (status_path.empty()) return;
    const std::int64_t now = mono_ns();
    // At most one write per 100 ms however often the state changes (a flood
    // of connections changes it on every pass), and one a second at least.
    if (!force && (now < next_status_write_ns || (!status_dirty && now < next_status_ns))) return;
    next_status_ns = now + 1'000'000'000;
    next_status_write_ns = now + 100'000'000;
    status_dirty = false;
    nlohmann::json j;
    {
      std::lock_guard<std::mutex> g(smu);
      j["region"] = o.region;
      j["role"] = source ? "source" : "relay";
      j["pid"] = ::getpid();
      j["state"] = st.state;
      j["updated_unix_ns"] = unix_ns();
      j["listen"] = listen_str;
      j["checksums"] = o.checksums;
      j["syncs"] = st.syncs;
      j["syncs_aborted"] = st.aborted;
      j["syncs_skipped"] = st.skipped;
      j["bytes_in"] = st.bytes_in;
      j["bytes_out"] = st.bytes_out;
      j["last_sync"] = {{"version", st.last_version},
                        {"bytes", st.last_bytes},
                        {"seconds", st.last_seconds},
                        {"gbps", st.last_seconds > 0 ? static_cast<double>(st.last_bytes) / st.last_seconds / 1e9 : 0}};
      j["last_error"] = st.last_error;
      j["region_state"] = {{"ready", st.region_ready},
                           {"slot_bytes", st.region_slot_bytes},
                           {"version", st.region_version},
                           {"syncs", st.region_syncs},
                           {"failed", st.region_failed},
                           {"consumers", st.region_consumers},
                           {"last_error", st.region_error}};
    }
    if (!source) {
      static const char* names[] = {"idle", "connecting", "authenticating", "connected"};
      j["upstream"] = {{"address", from_addr.str()},
                       {"state", names[up.state]},
                       {"connection", up.tr.conn},
                       {"since_unix_ns", up.state == Up::kAuthed ? up.since_unix_ns : 0},
                       {"connects", up.connects},
                       {"refusals", up.refusals},
                       {"last_refusal", up.last_refusal},
                       {"last_error", up.last_error}};
    }
    nlohmann::json ds = nlohmann::json::array();
    int ready = 0;
    for (const auto& [id, d] : downs) {
      if (d->state == Down::kReady || d->state == Down::kActive) ++ready;
      ds.push_back({{"connection", id},
                    {"peer", d->peer},
                    {"state", state_name(d->state)},
                    {"since_unix_ns", d->since_unix_ns},
                    {"syncs", d->syncs},
                    {"bytes_sent", d->bytes_sent}});
    }
    j["downstream"] = ds;
    j["downstream_ready"] = ready;
    j["refused"] = refused;
    j["rejected"] = rejected;
    j["evicted"] = admission.evicted();
    j["ignored"] = ignored;
    j["unproven"] = unproven;
    // A new file under a fresh name, then renamed over the status file
    // (shmcast/files.hpp): a link or another user's file planted in the
    // region directory is replaced, never written through or chmodded.
    // Strings a peer sent are printable() already; replace keeps any other
    // invalid UTF-8 from making dump() throw (it would end the relay).
    try {
      replace_file(status_path, j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", 0600);
      status_failed = false;
    } catch (const std::exception& e) {
      if (!status_failed) log(std::string("cannot write the status file (will retry): ") + e.what());
      status_failed = true;
    }
  }
  bool status_failed = false;  // the last write failed (logged once until one succeeds)

  // ------------------------------------------------------------ main loop

  // A worker of its own for each direction; with progress threads, each is
  // progressed by a thread of its own, which wakes this one.
  std::unique_ptr<ucx::Worker> new_worker() {
    auto w = std::make_unique<ucx::Worker>(*ctx, o.progress_threads);
    if (w->threaded()) w->start_progress([this] { wake(); });
    return w;
  }
  void check_workers() {
    for (ucx::Worker* w : {lw.get(), up.w.get()})
      if (w)
        if (std::string f = w->failure(); !f.empty())
          throw Error(Errc::kSystem, "UCX progress thread: " + f);
  }
  void kick_workers() {
    if (kick_lw && lw) lw->kick();
    if (kick_up && up.w) up.w->kick();
    kick_lw = kick_up = false;
  }

  void wait_events() {
    std::vector<pollfd> fds;
    fds.push_back({wake_fd, POLLIN, 0});
    if (lw && !lw->threaded()) {
      if (!lw->arm()) return;
      fds.push_back({lw->fd(), POLLIN, 0});
    }
    if (up.w && !up.w->threaded()) {
      if (!up.w->arm()) return;
      fds.push_back({up.w->fd(), POLLIN, 0});
    }
    // The control channels.
    if (listen_fd >= 0 && mono_ns() >= accept_paused_until_ns) fds.push_back({listen_fd, POLLIN, 0});
    for (const auto& [id, d] : downs)
      if (d->sock.is_open())
        fds.push_back({d->sock.fd(), static_cast<short>(POLLIN | (d->sock.want_write() ? POLLOUT : 0)), 0});
    if (up.sock.is_open())
      fds.push_back({up.sock.fd(), static_cast<short>(POLLIN | (up.sock.want_write() || !up.tcp_up ? POLLOUT : 0)), 0});
    ::poll(fds.data(), fds.size(), 50);
    if (fds[0].revents & POLLIN) {
      std::uint64_t v;
      [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof v);
    }
  }

  bool has_cmds() {
    std::lock_guard<std::mutex> g(cmd_mu);
    return !cmds.empty();
  }

  void loop() {
    while (!stopping) {
      unsigned events = 0;
      if (lw && !lw->threaded()) events += lw->progress();
      if (up.w && !up.w->threaded()) events += up.w->progress();
      check_workers();
      take_sink();
      const bool had = !completed.empty() || !ep_failures.empty();
      service_downs();
      accept_data_conns();
      drain_lw_junk();
      service_up();
      drain_up_junk();
      process_completions();
      process_ep_failures();
      process_completions();
      accept_conns();
      if (source) handle_cmds();
      else {
        take_writer_returns();
        try {
          process_up_ctrl();
        } catch (const wire::ProtocolError& e) {
          fail_upstream(std::string("protocol error: ") + e.what());
        }
        pump_in();
      }
      process_completions();
      if (!retired.empty()) reap_retired();
      check_timers();
      write_status(false);
      kick_workers();
      if (events == 0 && !had && completed.empty() && sink.empty() && !(source && has_cmds())) wait_events();
    }
  }

  void shutdown() {
    stopping = true;
    // Abort what is in flight, close every connection, and let UCX finish
    // (or cancel) every request before memory goes away.
    if (!source && in.plan && !in.discard) {
      push_writer(WCmd{WCmd::kAbort, in.plan, -1, 0, nullptr, 0, 0, 0, "the relay is stopping"});
      forward_abort("the upstream relay is stopping");
    }
    if (source) {
      handle_cmds();
      if (out.plan) forward_abort("the source relay is stopping");
    }
    // The aborts went on the control channels: let them out (at most 1 s),
    // then close the channels and the data endpoints.
    for (auto& [id, d] : downs)
      if (d->state != Down::kClosing) drop_down(*d, "the relay is stopping", false);
    const std::int64_t deadline = mono_ns() + 3'000'000'000;
    while (!downs.empty() && mono_ns() < deadline) {
      unsigned n = lw ? lw->progress() : 0;
      process_completions();
      service_downs();
      if (n == 0) std::this_thread::sleep_for(1ms);
    }
    if (listen_fd >= 0) ::close(listen_fd);
    listen_fd = -1;
    // The source's reader waits for its slots: what is still out, and what
    // it posted that this thread will not take any more.
    release_src_chunks();
    {
      std::lock_guard<std::mutex> g(cmd_mu);
      net_done = true;
      for (SrcCmd& c : cmds)
        if (c.release) c.release();
      cmds.clear();
    }
    cmd_cv.notify_all();
    if (reader.joinable()) reader.join();
    if (source) {
      for (auto& [base, reg] : slot_regs) ucx::unregister_memory(ctx->get(), &reg);
      slot_regs.clear();
    }
    teardown_upstream();
    while (!retired.empty()) {
      process_completions();
      reap_retired();
      if (!retired.empty()) std::this_thread::sleep_for(1ms);
    }
    // No callback may run once the ops are gone: stop the progress thread,
    // destroy the worker (which may still call back for requests it drops),
    // then free the ops. All before the writer closes this node's region:
    // a forwarding send may read from its slots until its worker is gone.
    if (lw) lw->stop_progress();
    for (auto& [p, op] : ops)
      if (op->done && op->req) {
        ucp_request_free(op->req);
        op->req = nullptr;
      }
    lw.reset();
    ops.clear();
    completed.clear();
    {
      std::lock_guard<std::mutex> g(sink.mu);
      sink.completed.clear();
    }
    if (verifier) {
      verifier.reset();  // no check may read a slot once the region can go
    }
    slot_use.stop();   // a lend waiting on a forwarding send that is gone
    {
      std::lock_guard<std::mutex> g(wmu);
      writer_exit = true;
    }
    wcv.notify_all();
    if (writer.joinable()) writer.join();
    take_writer_returns();
    if (ctx) {
      free_bufs();
      for (SlotBuf& sb : sbufs) ucx::unregister_memory(ctx->get(), &sb.b.reg);
      sbufs.clear();
    }
    ctx.reset();
    rlog.flush(mono_ns(), true);
    set_state(fatal ? "failed" : "stopped");
    write_status(true);
  }

  void run() {
    if (o.limit_ucx_log) limit_ucx_log();
    // UCX's own TCP listeners (one per worker and interface) bind only to
    // the interfaces this relay was asked to use, unless UCX_NET_DEVICES
    // says otherwise.
    std::string devices;
    if (std::getenv("UCX_NET_DEVICES") == nullptr) {
      const ucx::NetDevices nd = ucx::relay_net_devices(o.listen, o.from);
      devices = nd.devices;
      if (devices.empty())
        log("UCX may use every network interface (" + nd.why + "); set UCX_NET_DEVICES to restrict it");
      else
        log("UCX uses the network devices " + devices + " (UCX_NET_DEVICES to change)");
    }
    ctx = std::make_unique<ucx::Context>(devices);
    if (!o.listen.empty()) {
      lw = new_worker();
      start_listener();
    }
    if (source) {
      reader = std::thread([this] { reader_main(); });
    } else {
      writer = std::thread([this] { writer_main(); });
      set_state("connecting");
    }
    try {
      loop();
    } catch (const Error& e) {
      set_fatal(e);
    } catch (const std::exception& e) {
      set_fatal(Error(Errc::kSystem, e.what()));
    }
    shutdown();
    std::lock_guard<std::mutex> g(fatal_mu);
    if (fatal) {
      note_error(fatal->what());
      write_status(true);
      throw *fatal;
    }
  }
};

Relay::Relay(RelayOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Relay::~Relay() = default;
void Relay::run() { impl_->run(); }
void Relay::stop() noexcept {
  impl_->stopping = true;
  impl_->wake();
}

}  // namespace shmcast::relay
