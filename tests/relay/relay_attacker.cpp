// A peer without the relay key, for the attack tests (tests/relay,
// test_relay_attack.cpp). It speaks the relay's wire as a stranger would,
// from its own code (not the relay's): protocol 3 (framed control messages
// on a TCP connection of the relay's own) and protocol 2 (a UCX connection
// to the relay's UCX listener, control messages as tagged messages: kind <<
// 56 | connection id << 32), so that the same attacks run against the relay
// before and after its fixes. Loopback addresses only (127.0.0.0/8), and
// every attack is bounded in connections and time.
//
//   relay_attacker forge --to 127.0.0.1:PORT --seconds S --report FILE
//     Connects again and again, both ways. Protocol 2: it learns its own id
//     from the challenge, then sprays forged "response" messages on the
//     tags of the connections around it (ids were sequential: its
//     neighbours are the victims), active messages of ids nothing handles,
//     and junk tags, for about 100 ms. Protocol 3: a forged response (a
//     wrong proof), other message types, garbage and a frame that announces
//     4 GiB. Reports "round N id I" per round, "sent M", "done".
//   relay_attacker flood --to 127.0.0.1:PORT --conns N [--raw M] [--sustain 1] [--sources K] --seconds S --report FILE
//     Opens N UCX connections (at most 1000) that never answer the
//     challenge, and M plain TCP connections (at most 1000) that never send
//     a byte, holds them for S seconds, then closes them. With --sustain 1,
//     every connection the relay closes is opened again (at most N + M open
//     at once) until the S seconds are over. With --sources K the plain TCP
//     connections come from 127.0.0.2 ... 127.0.0.(K+1) in turn. The UCX
//     connections are made by child processes, 50 each: UCX's client side
//     can die of an assertion when a relay closes a connection that is
//     still connecting, and a group that dies is started again (its
//     connections with it) instead of ending the whole flood. Reports
//     "opened N", "raw M", "flooding", then "crashed C" (groups started
//     again), "rejected R" (UCX connections the relay refused or closed),
//     "reopened K", "done".
//   relay_attacker fake-upstream --listen 127.0.0.1:PORT [--proto 2|3|4|5] --report FILE
//     Listens where a relay's upstream would (port 0: any), reports
//     "listening PORT", and answers every connection with "refused" (in
//     protocol 3 on a TCP socket, the default, or 2 on a UCX listener), then
//     closes it, until killed. Reports "refused N". With --bytes 1 (protocol
//     3) its text is not UTF-8: every other connection gets a refusal whose
//     text holds bytes 0x80-0xff, the others a challenge for a region whose
//     name does.
//   relay_attacker bad-response --to 127.0.0.1:PORT --seconds S --report FILE
//     Protocol 3. Connects again and again for S seconds (at most 200
//     times), and answers each challenge with a response for a region whose
//     name is not UTF-8 (bytes 0x80-0xff). Reports "sent N", "done".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <array>
#include <csignal>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

constexpr std::uint32_t kMagic = 0x594c5253;
constexpr std::uint16_t kAmId = 1;
enum : std::uint16_t { kChallenge = 1, kResponse, kWelcome, kRefused, kSync, kChunk, kEnd, kAbort };

std::string g_report;
void report(const std::string& line) {
  std::ofstream f(g_report, std::ios::app);
  f << line << "\n";
}

bool g_in_group = false;  // a flood group's child process: it ends with _exit, never exit

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "relay_attacker: %s\n", what.c_str());
  if (g_in_group) ::_exit(2);
  std::exit(2);
}

std::mt19937_64& rng() {
  static std::mt19937_64 r(std::random_device{}());
  return r;
}

// A control message: header (magic, type, 0, sequence) and body.
struct Msg {
  std::vector<std::uint8_t> b;
  explicit Msg(std::uint16_t type, std::uint64_t seq = 0) {
    u32(kMagic);
    u16(type);
    u16(0);
    u64(seq);
  }
  Msg& raw(const void* p, std::size_t n) {
    const auto* c = static_cast<const std::uint8_t*>(p);
    b.insert(b.end(), c, c + n);
    return *this;
  }
  Msg& u16(std::uint16_t v) { return raw(&v, 2); }
  Msg& u32(std::uint32_t v) { return raw(&v, 4); }
  Msg& u64(std::uint64_t v) { return raw(&v, 8); }
  Msg& str(const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return raw(s.data(), s.size());
  }
  Msg& random(std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(rng()()));
    return *this;
  }
};

std::uint64_t v2_tag(std::uint64_t kind, std::uint64_t middle) { return (kind << 56) | ((middle & 0xffffff) << 32); }

sockaddr_in loopback(const std::string& hostport) {
  const auto colon = hostport.rfind(':');
  if (colon == std::string::npos) die("bad address " + hostport);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(std::stoul(hostport.substr(colon + 1))));
  if (::inet_pton(AF_INET, hostport.substr(0, colon).c_str(), &a.sin_addr) != 1) die("bad address " + hostport);
  if ((ntohl(a.sin_addr.s_addr) >> 24) != 127) die("loopback addresses only (127.0.0.0/8): " + hostport);
  return a;
}

void check(ucs_status_t s, const char* what) {
  if (s != UCS_OK) die(std::string(what) + ": " + ucs_status_string(s));
}

ucp_context_h make_context() {
  ucp_config_t* cfg = nullptr;
  check(ucp_config_read(nullptr, nullptr, &cfg), "ucp_config_read");
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_TAG | UCP_FEATURE_AM;
  ucp_context_h ctx = nullptr;
  check(ucp_init(&p, cfg, &ctx), "ucp_init");
  ucp_config_release(cfg);
  return ctx;
}

ucp_worker_h make_worker(ucp_context_h ctx) {
  ucp_worker_params_t p{};
  p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  p.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h w = nullptr;
  check(ucp_worker_create(ctx, &p, &w), "ucp_worker_create");
  return w;
}

struct EpState {
  std::atomic<bool> failed{false};
};
void ep_err(void* arg, ucp_ep_h, ucs_status_t) { static_cast<EpState*>(arg)->failed = true; }

ucp_ep_h connect_to(ucp_worker_h w, const sockaddr_in& to, EpState* st) {
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&to);
  p.sockaddr.addrlen = sizeof to;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = ep_err;
  p.err_handler.arg = st;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(w, &p, &ep) != UCS_OK) return nullptr;
  return ep;
}

// Sends and forgets: the copy is freed when the send completes.
void send_cb(void* req, ucs_status_t, void* user) {
  delete static_cast<std::vector<std::uint8_t>*>(user);
  ucp_request_free(req);
}
void finish(void* r, std::vector<std::uint8_t>* copy) {
  if (r == nullptr || UCS_PTR_IS_ERR(r)) delete copy;
}
void send_tag(ucp_ep_h ep, std::uint64_t tag, const std::vector<std::uint8_t>& b) {
  auto* copy = new std::vector<std::uint8_t>(b);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = send_cb;
  p.user_data = copy;
  finish(ucp_tag_send_nbx(ep, copy->data(), copy->size(), tag, &p), copy);
}
void send_am(ucp_ep_h ep, const std::vector<std::uint8_t>& b, bool reply) {
  auto* copy = new std::vector<std::uint8_t>(b);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = copy;
  p.flags = reply ? UCP_AM_SEND_FLAG_REPLY : 0;
  finish(ucp_am_send_nbx(ep, kAmId, nullptr, 0, copy->data(), copy->size(), &p), copy);
}

void send_am_id(ucp_ep_h ep, std::uint16_t id, const std::vector<std::uint8_t>& b) {
  auto* copy = new std::vector<std::uint8_t>(b);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = send_cb;
  p.user_data = copy;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  finish(ucp_am_send_nbx(ep, id, nullptr, 0, copy->data(), copy->size(), &p), copy);
}

// What a challenge told us.
struct Challenge {
  bool got = false;
  std::uint32_t proto = 0;
  std::uint64_t id = 0;
  std::array<std::uint8_t, 32> nonce{};
};
Challenge g_am_challenge;

ucs_status_t am_cb(void*, const void*, size_t, void* data, size_t length, const ucp_am_recv_param_t* param) {
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;
  const auto* b = static_cast<const std::uint8_t*>(data);
  std::uint16_t type = 0;
  if (length >= 16 + 4 + 8 + 32) {
    std::memcpy(&type, b + 4, 2);
    if (type == kChallenge) {
      std::memcpy(&g_am_challenge.proto, b + 16, 4);
      std::memcpy(&g_am_challenge.id, b + 20, 8);
      std::memcpy(g_am_challenge.nonce.data(), b + 28, 32);
      g_am_challenge.got = true;
    }
  }
  return UCS_OK;
}

void set_am(ucp_worker_h w) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = kAmId;
  p.cb = am_cb;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  check(ucp_worker_set_am_recv_handler(w, &p), "ucp_worker_set_am_recv_handler");
}

void close_ep(ucp_worker_h w, ucp_ep_h ep) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void* r = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(r)) {
    const auto end = std::chrono::steady_clock::now() + 2s;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < end)
      ucp_worker_progress(w);
    ucp_request_free(r);
  }
}

// Progresses until `done` or the deadline.
template <class F>
void progress_until(ucp_worker_h w, F done, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done() && std::chrono::steady_clock::now() < end)
    if (ucp_worker_progress(w) == 0) std::this_thread::sleep_for(50us);
}

// Protocol 2's challenge, if one came as a tagged message: (proto, id).
bool v2_challenge(ucp_worker_h w, Challenge* c) {
  ucp_tag_recv_info_t info{};
  ucp_tag_message_h m = ucp_tag_probe_nb(w, v2_tag(1, 0), 0xffull << 56, 1, &info);
  if (m == nullptr) return false;
  std::vector<std::uint8_t> b(std::min<std::size_t>(info.length, 4096));
  ucp_request_param_t p{};
  ucp_tag_recv_info_t got{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
  p.recv_info.tag_info = &got;
  void* r = ucp_tag_msg_recv_nbx(w, b.data(), b.size(), m, &p);
  if (UCS_PTR_IS_PTR(r)) {
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(w);
    ucp_request_free(r);
  }
  std::uint16_t type = 0;
  if (b.size() < 16 + 8 + 32) return false;
  std::memcpy(&type, b.data() + 4, 2);
  if (type != kChallenge) return false;
  std::uint32_t id32 = 0;
  std::memcpy(&c->proto, b.data() + 16, 4);
  std::memcpy(&id32, b.data() + 20, 4);
  std::memcpy(c->nonce.data(), b.data() + 24, 32);
  c->id = id32;
  c->got = true;
  return true;
}

// ---- protocol 3: framed messages on a TCP connection

// --sources N: raw TCP connections come from 127.0.0.2 ... 127.0.0.(N+1) in
// turn (0: the kernel's choice, 127.0.0.1).
int g_sources = 0, g_next_source = 0;
void bind_source(int fd) {
  if (g_sources <= 0) return;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl((127u << 24) | static_cast<std::uint32_t>(2 + g_next_source++ % g_sources));
  (void)::bind(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a);
}

int tcp_connect(const sockaddr_in& to) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  bind_source(fd);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}
void tcp_frame(int fd, const std::vector<std::uint8_t>& b) {
  const std::uint32_t n = static_cast<std::uint32_t>(b.size());
  std::vector<std::uint8_t> f(4 + b.size());
  std::memcpy(f.data(), &n, 4);
  std::memcpy(f.data() + 4, b.data(), b.size());
  (void)::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}
// One frame, within `ms` (empty: none).
std::vector<std::uint8_t> tcp_read_frame(int fd, int ms) {
  std::vector<std::uint8_t> in;
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10) <= 0) continue;
    std::uint8_t buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return {};
    in.insert(in.end(), buf, buf + n);
    if (in.size() >= 4) {
      std::uint32_t len = 0;
      std::memcpy(&len, in.data(), 4);
      if (len > (1u << 20)) return {};
      if (in.size() >= 4 + len) return std::vector<std::uint8_t>(in.begin() + 4, in.begin() + 4 + len);
    }
  }
  return {};
}

// One protocol-3 round: returns the messages sent.
std::uint64_t forge_v3(const sockaddr_in& to, int round) {
  std::uint64_t sent = 0;
  const int fd = tcp_connect(to);
  if (fd < 0) return 0;
  const std::vector<std::uint8_t> ch = tcp_read_frame(fd, 2000);
  std::uint64_t id = 0;
  std::uint16_t type = 0;
  std::string region;
  if (ch.size() >= 16 + 4 + 8 + 32 + 4) {
    std::memcpy(&type, ch.data() + 4, 2);
    std::memcpy(&id, ch.data() + 20, 8);
    std::uint32_t n = 0;
    std::memcpy(&n, ch.data() + 60, 4);
    if (64 + static_cast<std::size_t>(n) <= ch.size()) region.assign(reinterpret_cast<const char*>(ch.data()) + 64, n);
  }
  report("round " + std::to_string(round) + " id " + std::to_string(id) +
         (type == kChallenge ? " (tcp)" : " (tcp, no challenge)"));
  if (type == kChallenge) {
    // A response that cannot prove the key, then anything else.
    Msg resp(kResponse);
    resp.random(32).random(32).str(region);
    tcp_frame(fd, resp.b);
    for (std::uint16_t t : {kChallenge, kWelcome, kRefused, kSync, kChunk, kEnd, kAbort}) {
      Msg m(t, rng()() % 4);
      m.random(64);
      tcp_frame(fd, m.b);
    }
    sent += 8;
  }
  ::close(fd);
  // A connection that sends garbage, and one that announces 4 GiB.
  if (const int g = tcp_connect(to); g >= 0) {
    (void)tcp_read_frame(g, 200);
    std::vector<std::uint8_t> junk(100, 0x5A);
    tcp_frame(g, junk);
    ++sent;
    ::close(g);
  }
  if (const int g = tcp_connect(to); g >= 0) {
    const std::uint32_t huge = 0xffffffffu;
    (void)::send(g, &huge, 4, MSG_NOSIGNAL);
    ++sent;
    std::this_thread::sleep_for(5ms);
    ::close(g);
  }
  return sent;
}

int forge(const sockaddr_in& to, int seconds) {
  ucp_context_h ctx = make_context();
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int round = 0;
  std::uint64_t sent = 0;
  while (std::chrono::steady_clock::now() < end) {
    ucp_worker_h w = make_worker(ctx);
    set_am(w);
    EpState st;
    g_am_challenge = Challenge{};
    sent += forge_v3(to, ++round);
    ucp_ep_h ep = connect_to(w, to, &st);
    if (ep == nullptr) {
      ucp_worker_destroy(w);
      std::this_thread::sleep_for(10ms);
      continue;
    }
    Challenge v2;
    progress_until(w, [&] { return g_am_challenge.got || v2_challenge(w, &v2) || st.failed; }, 500ms);
    const Challenge& c = g_am_challenge.got ? g_am_challenge : v2;
    if (c.got) report("round " + std::to_string(round) + " id " + std::to_string(c.id) + " (ucx)");
    const auto spray_end = std::chrono::steady_clock::now() + 100ms;
    while (c.got && !st.failed && std::chrono::steady_clock::now() < spray_end) {
      const std::uint64_t lo = c.id > 8 ? c.id - 8 : 1;
      for (std::uint64_t id = lo; id <= c.id + 24; ++id) {
        if (id == c.id) continue;
        // Protocol 2: a "response" on another connection's tag, as its
        // handshake answer (a wrong proof), and after its handshake.
        Msg resp(kResponse);
        resp.random(32).random(32).str("whatever");
        send_tag(ep, v2_tag(2, id), resp.b);
        ++sent;
      }
      // Protocol 3: responses on our own endpoint with another
      // connection's nonce (a random one: we cannot know theirs) and with
      // ours, messages without a reply endpoint, other types, junk tags.
      Msg forged(kResponse);
      forged.random(32).random(32).random(32).str("whatever");
      send_am(ep, forged.b, true);
      send_am(ep, forged.b, false);
      for (std::uint16_t t : {kWelcome, kRefused, kSync, kChunk, kEnd, kAbort}) {
        Msg m(t, rng()() % 4);
        m.random(64);
        send_am(ep, m.b, true);
      }
      Msg garbage(0);
      garbage.b.assign(40, 0xA5);
      send_am(ep, garbage.b, true);
      // Active messages of ids the relay has no handler for, up to the
      // highest (UCX 1.13 reads its handler table at the id before it checks
      // the id).
      for (std::uint16_t id : {std::uint16_t{2}, std::uint16_t{1000}, std::uint16_t{40000}, std::uint16_t{65534}})
        send_am_id(ep, id, garbage.b);
      send_tag(ep, rng()(), garbage.b);
      send_tag(ep, rng()() | (1ull << 63), garbage.b);
      sent += 15;
      for (int i = 0; i < 20; ++i) ucp_worker_progress(w);
      std::this_thread::sleep_for(1ms);
    }
    if (c.got && !st.failed) {
      Msg own(kResponse);
      own.raw(c.nonce.data(), 32).random(32).random(32).str("whatever");
      send_am(ep, own.b, true);  // ours: refused, our connection only
      for (int i = 0; i < 100; ++i) ucp_worker_progress(w);
    }
    close_ep(w, ep);
    ucp_worker_destroy(w);
  }
  report("sent " + std::to_string(sent));
  report("done");
  ucp_cleanup(ctx);
  return 0;
}

// One group of the flood's UCX connections, in a child process of its own
// with its own UCX context: UCX 1.13's client side can die of an assertion
// (tcp_sockcm_ep.c:80, `cep->comm_ctx.offset == 0`) when a server closes a
// connection that is still connecting, which is what a relay under flood
// does. A group that dies so takes only its own connections with it, and
// the parent opens them again (a flood that reconnects). Writes "opened N"
// on `out` once its connections are made, and "rejected R reopened K" when
// its time is over.
[[noreturn]] void flood_group(int out, const sockaddr_in& to, int n, std::chrono::steady_clock::time_point end,
                              bool sustain) {
  ucp_context_h ctx = make_context();
  ucp_worker_h w = make_worker(ctx);
  set_am(w);
  std::vector<std::unique_ptr<EpState>> states;
  std::vector<ucp_ep_h> eps;
  for (int i = 0; i < n; ++i) {
    states.push_back(std::make_unique<EpState>());
    ucp_ep_h ep = connect_to(w, to, states.back().get());
    if (ep) eps.push_back(ep);
    else states.pop_back();
    ucp_worker_progress(w);
  }
  const auto say = [out](const std::string& line) {
    const std::string l = line + "\n";
    (void)!::write(out, l.data(), l.size());
  };
  say("opened " + std::to_string(eps.size()));
  std::uint64_t reopened = 0, rejected = 0;
  while (std::chrono::steady_clock::now() < end) {
    const unsigned progressed = ucp_worker_progress(w);
    if (sustain) {
      // UCX connections the relay refused or closed: again (a few per round,
      // so the loop keeps progressing).
      int budget = 8;
      for (std::size_t i = 0; i < eps.size() && budget > 0; ++i) {
        if (!states[i]->failed) continue;
        if (eps[i] != nullptr) {
          ++rejected;
          close_ep(w, eps[i]);
          eps[i] = nullptr;
        }
        states[i] = std::make_unique<EpState>();
        ucp_ep_h ep = connect_to(w, to, states[i].get());
        if (ep == nullptr) {
          states[i]->failed = true;  // retried next round (nothing left to close)
          continue;
        }
        eps[i] = ep;
        ++reopened;
        --budget;
      }
    }
    if (progressed == 0) std::this_thread::sleep_for(1ms);
  }
  for (std::size_t i = 0; i < eps.size(); ++i) rejected += eps[i] != nullptr && states[i]->failed ? 1 : 0;
  say("rejected " + std::to_string(rejected) + " reopened " + std::to_string(reopened));
  for (ucp_ep_h ep : eps)
    if (ep != nullptr) close_ep(w, ep);
  ucp_worker_destroy(w);
  ucp_cleanup(ctx);
  ::_exit(0);
}

struct Group {
  pid_t pid = -1;
  int fd = -1;  // the read end of its pipe
  int size = 0;
  int opened = -1;  // -1: not reported yet
  std::uint64_t rejected = 0, reopened = 0;
  std::string buf;
};

void start_group(Group& g, const sockaddr_in& to, std::chrono::steady_clock::time_point end, bool sustain) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) die(std::string("pipe2: ") + std::strerror(errno));
  (void)::fcntl(p[0], F_SETFL, O_NONBLOCK);  // the parent polls every group's pipe, a restarted one too
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) die(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    // Only the pipe: the parent's TCP connections stay the parent's.
    if (::dup2(p[1], 3) != 3) ::_exit(2);
    ::close_range(4, ~0u, 0);
    (void)::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a flood killed with -9 takes its groups along
    if (::getppid() != parent) ::_exit(0);
    g_in_group = true;
    try {
      flood_group(3, to, g.size, end, sustain);
    } catch (...) {
      ::_exit(4);
    }
  }
  ::close(p[1]);
  if (g.fd >= 0) ::close(g.fd);
  g.pid = pid;
  g.fd = p[0];
  g.opened = -1;
  g.buf.clear();
}

// Reads what a group wrote; false once its pipe is closed.
bool read_group(Group& g) {
  char b[256];
  const ssize_t n = ::read(g.fd, b, sizeof b);
  if (n <= 0) return n < 0 && (errno == EAGAIN || errno == EINTR);
  g.buf.append(b, static_cast<std::size_t>(n));
  for (std::size_t nl; (nl = g.buf.find('\n')) != std::string::npos;) {
    const std::string line = g.buf.substr(0, nl);
    g.buf.erase(0, nl + 1);
    unsigned long long a = 0, c = 0;
    if (std::sscanf(line.c_str(), "opened %llu", &a) == 1) {
      g.opened = static_cast<int>(a);
    } else if (std::sscanf(line.c_str(), "rejected %llu reopened %llu", &a, &c) == 2) {
      g.rejected += a;
      g.reopened += c;
    }
  }
  return true;
}

// What an ended group wrote last (its pipe is at its end: bounded).
void drain_group(Group& g) {
  for (int i = 0; i < 64 && g.fd >= 0; ++i) {
    pollfd p{g.fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0 || !read_group(g)) break;
  }
}

int flood(const sockaddr_in& to, int conns, int raw, int seconds, bool sustain) {
  if (conns < 0 || conns > 1000 || raw < 0 || raw > 1000) die("--conns and --raw: 0..1000");
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  constexpr int kPerGroup = 50;
  std::vector<Group> groups((conns + kPerGroup - 1) / kPerGroup);
  for (std::size_t i = 0; i < groups.size(); ++i) {
    groups[i].size = std::min(kPerGroup, conns - static_cast<int>(i) * kPerGroup);
    start_group(groups[i], to, end, sustain);
  }
  // A group that died of a signal (a UCX assertion on its side) is started
  // again, its connections with it; "crashed" counts them.
  std::uint64_t crashed = 0;
  const auto reap = [&] {
    for (Group& g : groups) {
      if (g.fd >= 0) (void)read_group(g);
      int status = 0;
      if (g.pid <= 0 || ::waitpid(g.pid, &status, WNOHANG) != g.pid) continue;
      drain_group(g);
      g.pid = -1;
      // Ended early (a signal, or an error exit) with time left: again, a
      // bounded number of times in all.
      const bool early = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
      if (early && crashed < 100 && std::chrono::steady_clock::now() + 2s < end) {
        ++crashed;
        start_group(g, to, end, sustain);
      }
    }
  };
  // Plain TCP connections, all at once and without blocking: a relay slow
  // to accept fills its listen backlog, and a blocking connect() then waits
  // for the kernel's SYN retries (minutes). Those not connected within 10 s
  // are left out (counted in "raw").
  std::vector<int> fds;
  {
    std::vector<int> pending;
    for (int i = 0; i < raw; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) break;
      bind_source(fd);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0) {
        fds.push_back(fd);
      } else if (errno == EINPROGRESS) {
        pending.push_back(fd);
      } else {
        ::close(fd);
      }
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!pending.empty() && std::chrono::steady_clock::now() < until) {
      std::vector<pollfd> ps;
      for (int fd : pending) ps.push_back({fd, POLLOUT, 0});
      if (::poll(ps.data(), ps.size(), 10) <= 0) continue;
      std::vector<int> still;
      for (const pollfd& p : ps) {
        if (p.revents == 0) {
          still.push_back(p.fd);
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        if (::getsockopt(p.fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0)
          fds.push_back(p.fd);
        else
          ::close(p.fd);
      }
      pending.swap(still);
    }
    for (int fd : pending) ::close(fd);
  }
  // Every group has made its connections (within 60 s).
  const auto opened_by = std::chrono::steady_clock::now() + 60s;
  const auto all_opened = [&] {
    for (const Group& g : groups)
      if (g.opened < 0) return false;
    return true;
  };
  while (!all_opened() && std::chrono::steady_clock::now() < opened_by) {
    reap();
    std::this_thread::sleep_for(5ms);
  }
  int opened = 0;
  for (const Group& g : groups) opened += std::max(g.opened, 0);
  report("opened " + std::to_string(opened));
  report("raw " + std::to_string(fds.size()));
  report("flooding");
  std::uint64_t reopened = 0;
  while (std::chrono::steady_clock::now() < end) {
    reap();
    if (sustain) {
      // TCP connections the relay closed: again (a few per round).
      int budget = 32;
      for (int& fd : fds) {
        if (budget <= 0) break;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 0) <= 0) continue;
        char c;
        if (::recv(fd, &c, 1, MSG_DONTWAIT) > 0) continue;  // a challenge: left unanswered
        ::close(fd);
        fd = tcp_connect(to);
        if (fd < 0) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // a placeholder, retried
        ++reopened;
        --budget;
      }
    }
    std::this_thread::sleep_for(1ms);
  }
  // The groups end on their own at the same deadline.
  const auto wait_by = std::chrono::steady_clock::now() + 10s;
  for (Group& g : groups) {
    while (g.pid > 0 && std::chrono::steady_clock::now() < wait_by) {
      int status = 0;
      if (::waitpid(g.pid, &status, WNOHANG) == g.pid) {
        g.pid = -1;
        break;
      }
      (void)read_group(g);
      std::this_thread::sleep_for(5ms);
    }
    if (g.pid > 0) {
      ::kill(g.pid, SIGKILL);
      ::waitpid(g.pid, nullptr, 0);
    }
    drain_group(g);
  }
  std::uint64_t rejected = 0;
  for (const Group& g : groups) {
    rejected += g.rejected;
    reopened += g.reopened;
  }
  report("crashed " + std::to_string(crashed));
  report("rejected " + std::to_string(rejected));
  report("reopened " + std::to_string(reopened));
  for (int fd : fds) ::close(fd);
  report("done");
  return 0;
}

// fake-upstream: a listener that refuses everyone.
std::mutex g_conn_mu;
std::vector<ucp_conn_request_h> g_conns;
void on_conn(ucp_conn_request_h req, void*) {
  std::lock_guard<std::mutex> g(g_conn_mu);
  g_conns.push_back(req);
}

// A string of bytes that is not UTF-8.
const std::string kNotUtf8 = std::string("\xff\xfe\xc3\x28 region \x80\xbf");

int bad_response(const sockaddr_in& to, int seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  int sent = 0;
  for (int i = 0; i < 200 && std::chrono::steady_clock::now() < end; ++i) {
    const int fd = tcp_connect(to);
    if (fd < 0) {
      std::this_thread::sleep_for(20ms);
      continue;
    }
    const std::vector<std::uint8_t> ch = tcp_read_frame(fd, 2000);
    std::uint16_t type = 0;
    if (ch.size() >= 16) std::memcpy(&type, ch.data() + 4, 2);
    if (type == kChallenge) {
      Msg resp(kResponse);
      resp.random(32).random(32).str(kNotUtf8);
      tcp_frame(fd, resp.b);
      report("sent " + std::to_string(++sent));
      (void)tcp_read_frame(fd, 1000);  // the refusal
    }
    ::close(fd);
    std::this_thread::sleep_for(20ms);
  }
  report("done");
  return 0;
}

int fake_upstream_v3(const sockaddr_in& at, bool bad_bytes, int proto) {
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (lfd < 0 || ::bind(lfd, reinterpret_cast<const sockaddr*>(&at), sizeof at) != 0 || ::listen(lfd, 64) != 0)
    die(std::string("cannot listen: ") + std::strerror(errno));
  sockaddr_in bound{};
  socklen_t blen = sizeof bound;
  ::getsockname(lfd, reinterpret_cast<sockaddr*>(&bound), &blen);
  report("listening " + std::to_string(ntohs(bound.sin_port)));
  int refused = 0;
  for (;;) {
    const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Msg m(kRefused);
    m.str("wrong key (the downstream's SHMCAST_RELAY_KEY / --key-file differs from this relay's) [sent by "
          "relay_attacker, which holds no key]");
    if (bad_bytes && refused % 2 == 0) {
      m = Msg(kRefused);
      m.str("wrong key " + kNotUtf8);
    } else if (bad_bytes) {
      m = Msg(kChallenge);
      std::array<std::uint8_t, 32> nonce{};
      m.u32(static_cast<std::uint32_t>(proto)).u64(1).raw(nonce.data(), nonce.size()).str(kNotUtf8);
    }
    tcp_frame(fd, m.b);
    report("refused " + std::to_string(++refused));
    std::this_thread::sleep_for(50ms);
    ::close(fd);
  }
}

int fake_upstream(const sockaddr_in& at) {
  ucp_context_h ctx = make_context();
  ucp_worker_h w = make_worker(ctx);
  set_am(w);
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&at);
  lp.sockaddr.addrlen = sizeof at;
  lp.conn_handler.cb = on_conn;
  ucp_listener_h l = nullptr;
  check(ucp_listener_create(w, &lp, &l), "ucp_listener_create");
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  check(ucp_listener_query(l, &la), "ucp_listener_query");
  report("listening " + std::to_string(ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port)));
  std::vector<std::pair<ucp_ep_h, std::chrono::steady_clock::time_point>> open;
  std::vector<std::unique_ptr<EpState>> states;
  int refused = 0;
  for (;;) {
    ucp_worker_progress(w);
    std::vector<ucp_conn_request_h> reqs;
    {
      std::lock_guard<std::mutex> g(g_conn_mu);
      reqs.swap(g_conns);
    }
    for (ucp_conn_request_h req : reqs) {
      states.push_back(std::make_unique<EpState>());
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.conn_request = req;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = ep_err;
      ep.err_handler.arg = states.back().get();
      ucp_ep_h e = nullptr;
      if (ucp_ep_create(w, &ep, &e) != UCS_OK) continue;
      Msg m(kRefused);
      m.str("wrong key (the downstream's SHMCAST_RELAY_KEY / --key-file differs from this relay's) [sent by "
            "relay_attacker, which holds no key]");
      send_am(e, m.b, true);           // protocol 3
      send_tag(e, v2_tag(1, 0), m.b);  // protocol 2
      open.emplace_back(e, std::chrono::steady_clock::now() + 1s);
      report("refused " + std::to_string(++refused));
    }
    const auto now = std::chrono::steady_clock::now();
    for (auto it = open.begin(); it != open.end();) {
      if (it->second > now) {
        ++it;
        continue;
      }
      close_ep(w, it->first);
      it = open.erase(it);
    }
    std::this_thread::sleep_for(1ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) die("usage: relay_attacker forge|flood|fake-upstream|bad-response [options]");
  const std::string mode = argv[1];
  std::string to, listen;
  int seconds = 5, conns = 0, raw = 0, proto = 5, sustain = 0, bad_bytes = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--to") to = v;
    else if (k == "--listen") listen = v;
    else if (k == "--seconds") seconds = std::stoi(v);
    else if (k == "--conns") conns = std::stoi(v);
    else if (k == "--raw") raw = std::stoi(v);
    else if (k == "--proto") proto = std::stoi(v);
    else if (k == "--sustain") sustain = std::stoi(v);
    else if (k == "--bytes") bad_bytes = std::stoi(v);
    else if (k == "--sources") g_sources = std::stoi(v);
    else if (k == "--report") g_report = v;
    else die("unknown option " + k);
  }
  if (g_report.empty()) die("--report FILE is required");
  if (seconds < 0 || seconds > 600) die("--seconds: 0..600");
  // Many connections need many descriptors.
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
  if (mode == "forge") return forge(loopback(to), seconds);
  if (mode == "flood") return flood(loopback(to), conns, raw, seconds, sustain != 0);
  if (mode == "fake-upstream")
    return proto == 2 ? fake_upstream(loopback(listen)) : fake_upstream_v3(loopback(listen), bad_bytes != 0, proto);
  if (mode == "bad-response") return bad_response(loopback(to), seconds);
  die("unknown mode " + mode);
}
