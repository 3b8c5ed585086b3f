// shmcast-relay: carries region REGION's syncs to other nodes over UCX.
//
//   source node:  shmcast-relay REGION --listen HOST:PORT
//   other nodes:  shmcast-relay REGION --from UPSTREAM:PORT [--listen HOST:PORT]
//
// docs/relay.md: what it does, the options, the status file, a Kubernetes
// example and the numbers.
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "shmcast/relay.hpp"
#include "shmcast/shmcast.hpp"

namespace {

shmcast::relay::Relay* g_relay = nullptr;
void on_signal(int) {
  if (g_relay) g_relay->stop();
}

const char* kFooter = R"(The key: --key-file FILE (owned by this user or root, mode 0600, or 0440
with a group), else the environment variable SHMCAST_RELAY_KEY; the same
secret, at least 16 bytes, on every node. Peers prove it to each other
(HMAC-SHA256 over fresh nonces) before any region byte moves; a relay with
another key is refused, and retries (--exit-on-refusal to exit instead).

UCX picks the transport (RDMA where there is a NIC for it, else TCP); UCX_TLS
and UCX_NET_DEVICES steer it, e.g. UCX_TLS=tcp. By default UCX uses only the
interfaces of --listen and of the route to --from (and RDMA devices);
UCX_NET_DEVICES=all (or a list) widens it.

State: a JSON file next to the region, <region dir>/shmcast-relay.REGION.json
(--status to move it, --status - for none), rewritten every second.

Exit codes:
  0    stopped by SIGINT or SIGTERM
  1    failure (see the message)
  2    usage error (also: no key, a key shorter than 16 bytes, a key file
       someone else owns or may write, or others may read, a key file that
       is a FIFO or a link someone else may have planted, a status file
       another user created first)
  3    with --exit-on-refusal: the upstream refused this relay (a wrong key,
       another region or version), or did not prove the key
  4    this node's region is held by another live producer)";

std::uint64_t parse_size(const std::string& s) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (end == s.c_str()) throw CLI::ValidationError("size", "'" + s + "' is not a size");
  std::uint64_t mul = 1;
  const std::string suf(end);
  if (suf == "" || suf == "B") mul = 1;
  else if (suf == "K" || suf == "KiB") mul = 1ull << 10;
  else if (suf == "M" || suf == "MiB") mul = 1ull << 20;
  else if (suf == "G" || suf == "GiB") mul = 1ull << 30;
  else throw CLI::ValidationError("size", "'" + s + "': use a number with an optional K, M or G suffix");
  return static_cast<std::uint64_t>(v) * mul;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shmcast-relay: carry a region's syncs to other nodes over UCX (docs/relay.md)"};
  app.footer(kFooter);
  std::string region, from, listen, key_file, status, slot_bytes_s, frag_s = "1M", stall = "fail";
  std::string manifest_s = "1M";
  bool no_checksums = false, region_checksums = false, group_access = false, inline_progress = false,
       direct = false, exit_on_refusal = false;
  std::uint32_t slots = 4, max_consumers = 8, buffers = 4, max_pending = 64, max_pending_per_source = 8;
  double consumer_timeout = 60, peer_timeout = 20, handshake_timeout = 10, first_response_timeout = 2, upstream_timeout = 90, max_lag = 0.3;
  app.add_option("region", region, "Region name (the same on every node)")->required();
  app.add_option("--from", from, "Upstream relay HOST:PORT (omit on the source node)");
  app.add_option("--listen", listen, "Accept downstream relays on HOST:PORT (port 0: any free port)");
  app.add_option("--key-file", key_file, "File holding the pre-shared key (else $SHMCAST_RELAY_KEY)");
  app.add_flag("--no-checksums", no_checksums, "Do not send and check an XXH3 checksum per chunk across hops");
  app.add_option("--buffers", buffers,
                 "Receive buffers of one chunk each, used when a chunk cannot go straight into its slot")
      ->check(CLI::Range(2, 1024));
  app.add_option("--fragment-bytes", frag_s,
                 "Source node: size of the messages a chunk travels in, a power of two from 64K to 2M (default 1M)");
  app.add_flag("--direct-receive", direct,
               "Receive chunks straight into this node's region's slots instead of into buffers that are then "
               "copied (needs the source's slot size)");
  app.add_flag("--no-progress-threads", inline_progress,
               "Progress UCX on the relay's own thread instead of one thread per direction");
  app.add_option("--peer-timeout", peer_timeout, "Seconds a downstream may take no chunk before it is dropped")
      ->check(CLI::Range(0.1, 86400.0));
  app.add_option("--upstream-timeout", upstream_timeout,
                 "Seconds the upstream may send nothing in the middle of a sync before it is dropped")
      ->check(CLI::Range(0.1, 86400.0));
  app.add_option("--handshake-timeout", handshake_timeout, "Seconds for a connection's key handshake")
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--first-response-timeout", first_response_timeout,
                 "Seconds a connection to the listener may take to answer the challenge (default 2)")
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--max-lag", max_lag,
                 "Seconds a downstream may take no fragment while it holds the source back (a slot or receive "
                 "buffer the others are done with waits for it) before it is dropped from the sync; one that is "
                 "only slower than the others keeps its own pace (default 0.3)")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--max-pending", max_pending,
                 "Connections that have not proven the key yet, at most; more are refused at once (default 64)")
      ->check(CLI::Range(1, 65536));
  app.add_option("--max-pending-per-source", max_pending_per_source,
                 "...of them from one source address (default 8)")
      ->check(CLI::Range(1, 65536));
  app.add_flag("--exit-on-refusal", exit_on_refusal,
               "Exit (code 3) when the upstream refuses this relay or does not prove the key, instead of retrying");
  app.add_option("--status", status, "Status file (default: next to the region; - for none)");
  auto* g = "This node's region (with --from)";
  app.add_option("--slot-bytes", slot_bytes_s, "Slot size, e.g. 256M (default: the source region's)")->group(g);
  app.add_option("--slots", slots, "Slots: the chunks in flight on the hop into this node (default 4)")->check(CLI::Range(2, 4096))->group(g);
  app.add_option("--max-consumers", max_consumers, "Consumer seats")->check(CLI::Range(1, 64))->group(g);
  app.add_option("--manifest-bytes", manifest_s,
                 "Room for one sync's manifest (default 1M); also bounds the control messages taken from the upstream")
      ->group(g);
  app.add_option("--stall-policy", stall, "A local consumer that stalls: fail the local sync, or evict it")
      ->check(CLI::IsMember({"fail", "evict"}))
      ->group(g);
  app.add_option("--consumer-timeout", consumer_timeout, "Seconds a local consumer may hold a slot")
      ->check(CLI::Range(0.01, 86400.0))
      ->group(g);
  app.add_flag("--region-checksums", region_checksums, "XXH3 slot checksums in this node's region")->group(g);
  app.add_flag("--group-access", group_access, "Create the region mode 0660 (consumers of the group)")->group(g);
  try {
    app.parse(argc, argv);
    if (from.empty() && listen.empty())
      throw CLI::ValidationError("--listen", "the source node (no --from) needs --listen HOST:PORT");
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  // A relay restarted on its fixed port must listen again while the old
  // connections linger in TIME_WAIT (SO_REUSEADDR); an explicit setting wins.
  ::setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  // Every connection, and every handshake in progress, holds descriptors:
  // take what the hard limit allows (the soft limit is often 1024).
  if (rlimit rl{}; ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &rl);
  }
  shmcast::relay::RelayOptions o;
  o.region = region;
  o.from = from;
  o.listen = listen;
  o.checksums = !no_checksums;
  o.buffers = buffers;
  o.status_path = status;
  auto secs = [](double s) { return std::chrono::nanoseconds(static_cast<std::int64_t>(s * 1e9)); };
  o.peer_timeout = secs(peer_timeout);
  o.handshake_timeout = secs(handshake_timeout);
  o.first_response_timeout = secs(first_response_timeout);
  o.max_lag = secs(max_lag);
  o.max_pending = max_pending;
  o.max_pending_per_source = max_pending_per_source;
  o.exit_on_refusal = exit_on_refusal;
  o.upstream_timeout = secs(upstream_timeout);
  o.region_options.slots = slots;
  o.region_options.max_consumers = max_consumers;
  o.region_options.stall_policy = stall == "evict" ? shmcast::StallPolicy::kEvict : shmcast::StallPolicy::kFail;
  o.region_options.consumer_timeout = secs(consumer_timeout);
  o.region_options.checksums = region_checksums;
  o.region_options.group_access = group_access;
  try {
    if (!slot_bytes_s.empty()) o.region_options.slot_bytes = parse_size(slot_bytes_s);
    o.region_options.manifest_bytes = parse_size(manifest_s);
    o.fragment_bytes = parse_size(frag_s);
    o.progress_threads = !inline_progress;
    o.direct_receive = direct;
    try {
      o.key = shmcast::relay::load_key(key_file);
    } catch (const shmcast::Error& e) {
      std::fprintf(stderr, "shmcast-relay %s: %s\n", region.c_str(), e.what());
      return 2;
    }
    // What the constructor refuses is the setup's (the options, a status
    // file another user holds): exit 2, as for a key file.
    std::optional<shmcast::relay::Relay> relay;
    try {
      relay.emplace(std::move(o));
    } catch (const shmcast::Error& e) {
      std::fprintf(stderr, "shmcast-relay %s: %s\n", region.c_str(), e.what());
      return e.code() == shmcast::Errc::kSystem ? 1 : 2;
    }
    g_relay = &*relay;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    signal(SIGPIPE, SIG_IGN);
    relay->run();
    g_relay = nullptr;
  } catch (const CLI::ValidationError& e) {
    std::fprintf(stderr, "shmcast-relay: %s\n", e.what());
    return 2;
  } catch (const shmcast::Error& e) {
    g_relay = nullptr;
    std::fprintf(stderr, "shmcast-relay %s: %s\n", region.c_str(), e.what());
    switch (e.code()) {
      case shmcast::Errc::kPermission: return 3;
      case shmcast::Errc::kExists: return 4;
      case shmcast::Errc::kInvalidArgument:
      case shmcast::Errc::kBadName: return 2;
      default: return 1;
    }
  }
  return 0;
}
