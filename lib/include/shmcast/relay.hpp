// shmcast relay: carries a region's syncs to other nodes over UCX.
//
// Separate from the core library (target shmcast_relay, which links UCX and
// OpenSSL; users of shmcast.hpp alone link neither). The tool shmcast-relay
// is a thin command line around it; docs/relay.md has the design, the wire
// protocol and a Kubernetes example.
//
//   source node    (region R has a producer, e.g. the trainer)
//     Relay({.region = "R", .listen = "0.0.0.0:7000", .key = key}).run();
//   other nodes    (the relay is the producer of this node's region R)
//     Relay({.region = "R", .from = "trainer-0:7000", .listen = "0.0.0.0:7000", .key = key}).run();
//
// On the source node the relay is a consumer of R and sends each slot
// straight from the region (no copy). Every other node receives each chunk
// into a registered buffer, forwards it at once to its own downstream
// relays (a pipelined chain, or a tree of chains), and writes it into its
// region R with the upstream's version and manifest, so the same Consumer
// code works on every node.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "shmcast/shmcast.hpp"

namespace shmcast::relay {

struct Address {
  std::string host;  // a name or a numeric IPv4/IPv6 address
  std::uint16_t port = 0;
  SHMCAST_API std::string str() const;  // "host:port" ("[v6]:port")
};
// Parses "HOST:PORT" or "[V6]:PORT". Throws Error(kInvalidArgument).
SHMCAST_API Address parse_address(std::string_view host_port);

// The pre-shared key: the bytes of `key_file` (one trailing newline
// stripped) when it is not empty, else the value of $SHMCAST_RELAY_KEY.
// Throws Error(kInvalidArgument) when neither is set or the key is shorter
// than 16 bytes, and Error(kPermission) when someone else controls the file:
// it is owned by a uid other than this process's effective uid or root, or
// the group or others may write it, or others may read it (use 0600, or
// 0440 with a group), or it is a symbolic link that someone else may have
// planted (owned by another uid, or in a directory others may write without
// the sticky bit). Opened O_NOFOLLOW | O_NONBLOCK: anything but a regular
// file (a FIFO) is refused at once (kInvalidArgument).
SHMCAST_API std::string load_key(const std::string& key_file);

struct RelayOptions {
  std::string region;
  // Upstream relay "HOST:PORT". Empty: this is the source node, where the
  // region has its own producer and the relay attaches as a consumer.
  std::string from;
  // Where downstream relays connect, "HOST:PORT" (port 0: any free port,
  // reported in the status file). Empty: no downstream (a leaf).
  std::string listen;
  // Pre-shared key (load_key). Peers prove it with HMAC-SHA256 over fresh
  // nonces, both ways, before a region byte moves.
  std::string key;
  // XXH3-64 of every chunk sent along each hop, verified before a chunk is
  // written into a region.
  bool checksums = true;
  // This node's region (nodes with `from`). slot_bytes 0: the source
  // region's slot size, so tensors sit at the same stream offsets.
  ProducerOptions region_options = {.slot_bytes = 0, .pin = Pin::kNo, .engine = CopyEngine::kHost};
  // Receive buffers of one chunk (one source slot) each: chunks in flight
  // per hop on nodes with `from`.
  std::uint32_t buffers = 4;
  // A chunk travels as messages of this size (a power of two from 64 KiB to
  // 2 MiB; the source's choice holds for the whole chain): several are in
  // flight on a link at once, and a relay forwards each one as soon as it
  // has it, before the rest of its chunk.
  std::uint64_t fragment_bytes = 1ull << 20;
  // One thread per UCX worker progresses it (the upstream connection's and
  // the downstream ones'), apart from the relay's own thread. Over TCP, UCX
  // copies between the sockets and memory inside progress: a middle relay
  // then receives and sends on two cores instead of one. False: the relay's
  // network thread progresses both.
  bool progress_threads = true;
  // Nodes with `from`: receive each chunk straight into its slot of this
  // node's region (Producer::lend_chunk), verify it there and publish it, so
  // no byte is copied on the way in. Needs the region's slot size to equal
  // the source's (region_options.slot_bytes 0); otherwise, and after a
  // local sync failed, chunks go through the receive buffers and are copied.
  // Off by default: on the 16-core bench machine (docs/benchmarks.md) it
  // saved a core per node but did not raise the rate over TCP.
  bool direct_receive = false;
  Duration handshake_timeout = std::chrono::seconds(10);
  // A connection to the listener must send its response to the challenge
  // within this (the rest of the handshake has handshake_timeout): a peer
  // that sends nothing holds a pending slot this long at most.
  Duration first_response_timeout = std::chrono::seconds(2);
  // Connections that have not proven the key yet: at most max_pending at
  // once, and at most max_pending_per_source from one source address (an
  // IPv6 /64 counts as one). A newcomer beyond either takes the place of
  // the oldest pending connection of its own source when that cap is full,
  // else of the oldest of the source holding the most; that one is closed.
  // A flood of connections without the key holds a bounded number of
  // descriptors, and cannot keep keyed peers on other addresses out.
  std::uint32_t max_pending = 64;
  std::uint32_t max_pending_per_source = 8;
  // A downstream relay that holds the source back is dropped from the sync
  // (it reconnects and takes the next one): it has taken no fragment for
  // max_lag while it holds one that another downstream took, in a slot the
  // source needs back (a source relay's slots of the source region, this
  // node's slots with direct_receive) or in a receive buffer when none is
  // free. The others wait for a stopped one at most this long. One that is
  // only slower than its siblings keeps taking fragments and stays: it
  // receives at its own pace (the others keep theirs as long as it keeps up
  // with the syncs). A lone downstream is judged by peer_timeout only.
  Duration max_lag = std::chrono::milliseconds(300);
  // What the upstream's refusal does. A refusal (a wrong key, another
  // region or protocol, an upstream that does not prove the key) is never
  // proven, since a peer without the key can send one: by default the relay
  // reports it (log, status file) and retries with a backoff (1 s doubling
  // to 5 s). True: run() throws Error(kPermission) instead.
  bool exit_on_refusal = false;
  // Rate-limit UCX's own warnings and errors (at most 5 per source line and
  // 10 s), which a peer can cause at will. Process-wide (a UCX log handler),
  // installed once by the first run().
  bool limit_ucx_log = true;
  // A downstream relay that takes no byte of a chunk for this long is
  // dropped (it rejoins at a later sync), so it cannot hold the others, nor
  // the source region's producer, past its consumer_timeout.
  Duration peer_timeout = std::chrono::seconds(20);
  // An upstream relay that sends nothing (no fragment, no control message)
  // for this long in the middle of a sync is dropped: the sync aborts here
  // and downstream, and the relay reconnects. Longer than the 60 s a source
  // relay waits for its trainer's next chunk.
  Duration upstream_timeout = std::chrono::seconds(90);
  // Reconnecting to the upstream: first delay, doubled up to the maximum.
  Duration reconnect_min = std::chrono::milliseconds(100);
  Duration reconnect_max = std::chrono::seconds(2);
  // JSON state for operators and tools; "" = <region dir>/shmcast-relay.<region>.json,
  // "-" = none. Rewritten (atomically) on every change and every second.
  std::string status_path;
  // One line per event (connections, syncs, faults); default: stderr.
  std::function<void(const std::string&)> log;
};

// Where the relay of region `name` writes its state by default.
SHMCAST_API std::string default_status_path(std::string_view name);

class SHMCAST_API Relay {
 public:
  explicit Relay(RelayOptions options);
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;
  ~Relay();

  // Forwards syncs until stop(): reconnects to the upstream after faults
  // and refusals, reattaches to the source region when its producer
  // restarts. Returns normally after stop(). Throws Error for what retrying
  // cannot fix: bad options (kInvalidArgument), the local region held by
  // another live producer (kExists); with exit_on_refusal, also a refusal by
  // the upstream or an upstream that does not prove the key (kPermission).
  void run();
  // Makes run() return soon. Async-signal-safe: call it from a handler.
  void stop() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shmcast::relay
