// The relay's private header: Relay::Impl, the state of one shmcast-relay
// process, and the small types its threads share. Included by the relay's
// own .cpp files only (lib/relay), which are split by thread and role:
//
//   relay.cpp     lifecycle: construction, run(), the network thread's main
//                 loop and its timers, shutdown
//   net.cpp       UCX requests, their callbacks (on a worker's progress
//                 thread, or the network thread), completions, workers
//   listener.cpp  downstream relays: accept, key handshake, admission, their
//                 data listeners (network thread)
//   fanout.cpp    the outgoing sync, sent to every ready downstream (network
//                 thread)
//   upstream.cpp  the connection to the upstream relay: connect, handshake,
//                 control messages, reconnection (network thread)
//   receive.cpp   the incoming sync: receives, forwarding, receive buffers,
//                 hand-off to the writer (network thread)
//   source.cpp    a source relay's reader thread (the Consumer of the source
//                 region) and the network thread's side of its commands
//   writer.cpp    the region writer thread (the Producer of this node's region)
//   status.cpp    the log and the status file (any thread; the file is
//                 written by the network thread)
//   options.cpp   the public helpers: addresses, the key file, the status path
//
// Every field group of Impl says which threads may touch it.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "admission.hpp"
#include "auth.hpp"
#include "base/clock.hpp"
#include "ctrl.hpp"
#include "held.hpp"
#include "ratelog.hpp"
#include "shmcast/relay.hpp"
#include "shmcast/shmcast.hpp"
#include "ucx.hpp"
#include "verifier.hpp"
#include "wire.hpp"

namespace shmcast::relay {

using namespace std::chrono_literals;
using detail::mono_ns;
using detail::unix_ns;
using wire::SyncPlan;
using wire::Type;
using wire::Writer;

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
  // Connection requests to the data listener, for the network thread.
  std::vector<ucp_conn_request_h> conns;
  bool empty() {
    std::lock_guard<std::mutex> g(mu);
    return completed.empty() && failures.empty() && conns.empty();
  }
};
// The data listener's argument; outlives the listener.
struct ListenArg {
  Sink* sink;
};
// Its connection handler (net.cpp): files the request for the network thread.
void on_data_conn(ucp_conn_request_h req, void* arg);

// One UCX request and what the network thread needs to finish it.
struct Op {
  // kProofRecv: a data connection's proof (listener side, a stream
  // receive); kProofSend: ours (downstream side, a stream send).
  enum Kind : std::uint8_t { kDataSend, kDataRecv, kJunkRecv, kClose, kProofRecv, kProofSend };
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

// An Op's completion callbacks (net.cpp): file it in its sink.
void op_send_cb(void*, ucs_status_t st, void* user);
void op_recv_cb(void*, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user);
void op_stream_recv_cb(void*, ucs_status_t st, std::size_t length, void* user);

// Every endpoint's error handler argument; freed after the endpoint.
struct EpArg {
  Sink* sink;
  std::uint64_t conn;
  std::uint64_t gen;
};
// The endpoints' error handler (net.cpp): files the failure in the sink.
void ep_error_cb(void* arg, ucp_ep_h, ucs_status_t st);

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
  // Its data connection (to the relay's data listener), once it proved
  // this connection's session key on it (Impl::DataConn until then).
  ucp_ep_h ep = nullptr;
  bool ep_closing = false;
  std::int64_t closing_ns = 0;
  std::unique_ptr<EpArg> arg;
  std::string peer;
  std::string source;    // the peer's address without the port (its data connection must come from it)
  bool pending = false;  // counted by the listener's Admission (handshake not done)
  State state = kHandshake;
  auth::Transcript tr;
  std::string session;
  std::uint64_t send_seq = 0;
  std::uint64_t recv_seq = 0;  // of its authenticated messages (kWantFull)
  std::uint64_t want_full = 0; // full-sync requests it sent
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

// Installs the UCX log limiter (net.cpp): at most a few of UCX's warnings
// per source line and 10 s. Process-wide, once.
void limit_ucx_log();

// "1.234 GB/s" (status.cpp).
std::string fmt_gbs(std::uint64_t bytes, double seconds);

struct Relay::Impl {
  // ---- set by the constructor, read-only afterwards (every thread)
  RelayOptions o;
  bool source = false;
  std::string status_path;
  // ---- any thread
  std::atomic<bool> stopping{false};
  int wake_fd = -1;  // wake(): tells the network thread to look (eventfd)

  // fatal error that ends run() (any thread, under fatal_mu)
  std::mutex fatal_mu;
  std::optional<Error> fatal;

  // ---- UCX (network thread only; `sink` and the ops' status fields are
  // written by the UCX callbacks, under sink.mu: net.cpp)
  std::unique_ptr<ucx::Context> ctx;
  std::unique_ptr<ucx::Worker> lw;  // the downstream connections' worker (their data endpoints)
  int listen_fd = -1;               // the control channels' listening socket
  std::string listen_str;
  // The data listener (on lw): one for the relay's life, destroyed only
  // in shutdown() right before lw. UCX 1.13's TCP connection manager keeps
  // a pointer to its listener in every connection it accepted and has not
  // handed on yet (a peer that connected and sent nothing holds one as
  // long as it likes); destroying the listener then crashed the relay in
  // UCX's async thread once that peer wrote (issue 41, item 4).
  ucp_listener_h data_listener = nullptr;
  std::unique_ptr<ListenArg> data_larg;
  std::uint16_t data_port = 0;
  // Data connections that have not proven a session key yet (listener.cpp,
  // accept_data_conns): ids with kDataConnBit set, never a Down's. Each has
  // a stream receive for its proof; no chunk goes to it. One that proves
  // the key of a joining downstream from its address becomes that
  // downstream's data endpoint; the others are closed (a wrong proof, none
  // before the deadline, evicted by a newer one from the same address).
  struct DataConn {
    ucp_ep_h ep = nullptr;
    std::unique_ptr<EpArg> arg;  // freed after the endpoint (Op::kClose)
    std::string source, peer;
    std::int64_t since_ns = 0, deadline_ns = 0;
    bool closing = false;
  };
  static constexpr std::uint64_t kDataConnBit = 1ull << 63;
  std::map<std::uint64_t, DataConn> data_conns;
  std::uint64_t next_data_conn = 1;
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

  // ---- fan-out progress per fragment sent downstream (lag isolation;
  // network thread only)
  struct FanFrag {
    int pending = 0;                  // sends of it in flight
    std::int64_t first_done_ns = 0;   // when the first downstream took it
    int buf = -1;                     // where it is sent from: a buffer or slot (Buffer), -1 a source slot
  };
  std::uint64_t fan_seq = 0;
  std::map<std::uint64_t, FanFrag> fan;

  // ---- outgoing sync (fan-out to the downstream relays; network thread only)
  struct Out {
    std::shared_ptr<const SyncPlan> plan;  // null: none in progress
    std::int64_t start_ns = 0;
  } out;

  // ---- upstream connection (nodes with `from`; network thread only)
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
    std::uint64_t send_seq = 0;     // of our authenticated messages (kWantFull)
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

  // ---- incoming sync (nodes with `from`): the network thread's, except
  // slot_use (its own lock; the writer waits on it), lend_replies (under
  // wmu; the writer appends) and region_slots/region_slot_bytes (atomics the
  // writer sets)
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

  // ---- source reader <-> network thread: cmds, the tickets, reply_value
  // and net_done under cmd_mu; src_slot_bytes, src_chunks and slot_regs the
  // network thread's only; `reader` is started and joined by it
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

  // ---- delta syncs: full-sync requests travel upstream (docs/relay.md,
  // "Delta syncs"). want_full_up: this node (its writer, or a downstream)
  // wants the source producer's next sync full; the network thread sends
  // kWantFull to the upstream once it is connected. src_want_full: a
  // downstream asked the source relay; its reader asks the source region.
  // Each request says after which version a full sync answers it (0: any
  // later sync), so that the source asks its region again only for a
  // request that the full syncs it already asked for do not answer.
  WantFull want_full_up;
  WantFull src_want_full;
  void send_want_full();

  // ---- region writer (nodes with `from`): wq, wdone and writer_exit under
  // wmu; `writer` is started and joined by the network thread. The writer's
  // own state (WriterState, writer.cpp) lives on its stack.
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
  struct WriterState;  // writer.cpp

  // ---- status: st under smu (any thread); next_status_* and
  // status_failed the network thread's (write_status); status_dirty any
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
    // Delta syncs: received or sent as deltas, let go (a base this node's
    // region does not hold), full-sync requests sent upstream (or, at the
    // source, made of the source region); the last sync's kind and sizes.
    std::uint64_t delta_syncs = 0, delta_skipped = 0, full_requests = 0;
    std::string last_kind;
    std::uint64_t last_logical = 0, last_payload = 0;
    // Under smu: a sync sent (source) or received whole (other nodes).
    void count(const SyncPlan& p) {
      if (p.delta()) ++delta_syncs;
      last_kind = p.delta() ? "delta" : "full";
      last_logical = p.payload_bytes;
      last_payload = 0;
      for (std::uint64_t n : p.nbytes) last_payload += n;
    }
    std::uint32_t region_consumers = 0;
    std::string region_error;
  } st;
  std::int64_t next_status_ns = 0, next_status_write_ns = 0;
  std::atomic<bool> status_dirty{true};
  bool status_failed = false;  // the last write failed (logged once until one succeeds)

  // Most bytes of control messages a downstream may leave unread: a sync
  // message (its manifest) and the chunk messages behind it.
  static constexpr std::size_t kMaxCtrlOut = wire::kMaxControlBytes + (16u << 20);
  // Refusals are retried more slowly than a lost connection: from 1 s,
  // doubling up to 5 s (or reconnect_max when that is longer).
  static constexpr std::int64_t kRefusalBackoffMin = 1'000'000'000, kRefusalBackoffMax = 5'000'000'000;

  // ---- relay.cpp: lifecycle and the main loop (network thread; wake(), set_fatal() any thread)
  explicit Impl(RelayOptions opts);
  ~Impl();
  void wake() noexcept;
  void set_fatal(const Error& e);
  void run();
  void loop();
  void wait_events();
  bool has_cmds();
  void check_timers();
  void check_lag(std::int64_t now);
  void shutdown();

  // ---- net.cpp: UCX requests and completions, workers (network thread)
  Op* new_op(Op::Kind k, ucp_worker_h w);
  void track(Op* op, ucs_status_ptr_t r);
  ucp_request_param_t send_param(Op* op, ucp_mem_h memh = nullptr);
  ucp_request_param_t recv_param(Op* op, ucp_mem_h memh = nullptr);
  void close_ep(ucp_worker_h w, ucp_ep_h ep, bool force, std::uint64_t conn);
  void on_complete(Op* op);
  void take_sink();
  void process_completions();
  void process_ep_failures();
  std::unique_ptr<ucx::Worker> new_worker();
  void check_workers();
  void kick_workers();

  // ---- listener.cpp: downstream connections (network thread)
  static std::vector<std::uint8_t>& seal(Writer& msg, const std::string& session, std::uint64_t* seq,
                                         std::string_view dir);
  void send_down(Down& d, Writer& msg, bool authenticated = true);
  void start_listener();
  static std::string source_of(const sockaddr_storage& ss);
  void accept_conns();
  void leave_pending(Down& d);
  void drop_down(Down& d, const std::string& why, bool force = true);
  void refuse(Down& d, const std::string& why);
  void service_downs();
  void on_up_message(Down& d, const std::vector<std::uint8_t>& msg);
  void start_data_listener(const sockaddr_storage& at, socklen_t len);
  void accept_data_conns();
  void on_data_proof(Op* op);
  void close_data_conn(std::uint64_t id, const std::string& why);
  void stop_data_listener();
  void drain_lw_junk();

  // ---- fanout.cpp: the outgoing sync (network thread)
  int forward_begin(const std::shared_ptr<const SyncPlan>& plan);
  int forward_frag(std::uint32_t c, std::uint32_t j, const std::byte* p, std::uint64_t len, ucp_mem_h memh, int buf);
  int forward_chunk(std::uint32_t c, const std::byte* p, ucp_mem_h memh);
  void forward_sum(std::uint32_t c, std::uint64_t len, std::uint64_t sum);
  void forward_end();
  void forward_abort(const std::string& why);

  // ---- upstream.cpp: the upstream connection (network thread)
  void connect_upstream();
  void fail_upstream(const std::string& why, bool refusal = false);
  void upstream_refused(const std::string& why);
  void teardown_upstream();
  void reap_retired();
  void send_up(Writer& msg);
  void service_up();
  void drain_up_junk();
  std::string chunk_room_problem(std::uint64_t chunk_bytes) const;
  bool connect_data(const std::string& addr);
  void on_down_message(std::vector<std::uint8_t>& msg);
  wire::Reader verified(const std::vector<std::uint8_t>& msg);

  // ---- receive.cpp: the incoming sync and the receive buffers (network thread)
  void process_up_ctrl();
  void begin_in(const std::shared_ptr<const SyncPlan>& plan);
  void abort_in(std::uint64_t sent, const std::string& why);
  void drop_in();
  void pump_in();
  void take_verified();
  void take_lend_replies();
  void take_writer_returns();
  Buffer& bref(int b);
  void add_ref(int b);
  void release_buf(int b);
  int slot_buf(std::byte* p, std::uint64_t gen);
  int free_buf() const;
  bool all_bufs_free() const;
  void free_bufs();
  bool ensure_bufs(std::uint64_t bytes);

  // ---- source.cpp: the source reader (reader thread: reader_main, read_syncs, post, post_chunk) and its
  // commands (network thread)
  void handle_cmds();
  ucp_mem_h slot_registration(const std::byte* base);
  void maybe_release(std::map<std::uint32_t, SrcChunk>::iterator it);
  void release_src_chunks();
  void reply(std::uint64_t ticket, std::int64_t value);
  std::int64_t post(SrcCmd c, bool wait);
  void reader_main();
  void read_syncs(Consumer& cons, std::uint64_t S);
  void post_chunk(std::uint32_t c, const std::byte* base, std::uint64_t len, std::function<void()> release);

  // ---- writer.cpp: the region writer (writer thread; push_writer from the network thread)
  void push_writer(WCmd c);
  void writer_main();
  std::uint64_t local_slot_bytes(std::uint64_t chunk_bytes) const;
  void ensure_region(WriterState& ws, std::uint64_t chunk_bytes, bool fresh);
  void writer_do(WriterState& ws, const WCmd& c);
  std::uint64_t data_end(const WriterState& ws, const WCmd& c) const;
  void write_chunk(WriterState& ws, const WCmd& c, std::uint64_t from, std::uint64_t to);
  void local_failure(const std::string& why);
  // Asks the upstream for a full sync of a version after `after` (0: any).
  void ask_full(WriterState& ws, const std::string& why, std::uint64_t after);

  // ---- status.cpp: the log and the status file (log, set_state, note_error: any thread; write_status: network thread)
  void log(const std::string& line);
  void set_state(const std::string& s);
  void note_error(const std::string& e);
  static std::string printable(const std::string& s, std::size_t max = 300);
  void write_status(bool force);
  void first_status();  // at construction: throws kPermission when the status name is another user's
};

}  // namespace shmcast::relay
