// Who may connect: a pre-shared key, proven both ways with HMAC-SHA256 over
// fresh nonces before any region byte moves, then a per-connection session
// key that authenticates every control message (docs/relay.md, "Security").
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "wire.hpp"

namespace shmcast::relay::auth {

// Fresh random bytes (getrandom). Throws Error(kSystem) on failure.
void random_bytes(std::uint8_t* p, std::size_t n);
inline wire::Nonce nonce() {
  wire::Nonce n;
  random_bytes(n.data(), n.size());
  return n;
}

// HMAC-SHA256 of the length-prefixed concatenation of `parts` (so no two
// different part lists give the same input).
wire::Mac hmac(std::string_view key, std::initializer_list<std::span<const std::uint8_t>> parts);
// Constant-time comparison.
bool equal(const wire::Mac& a, const wire::Mac& b);

// What each side proves. The labels keep a proof from being reflected as
// the other side's, or as a session key.
struct Transcript {
  std::string region;
  std::uint64_t conn = 0;
  wire::Nonce server_nonce{}, client_nonce{};
};
wire::Mac client_proof(std::string_view key, const Transcript& t);
wire::Mac server_proof(std::string_view key, const Transcript& t);
std::string session_key(std::string_view key, const Transcript& t);

// The base of the connection's data tag serials (wire::data_serial): from
// the session key, so a peer without it cannot guess the tags of a sync.
std::uint32_t data_tag_base(std::string_view session);

// What a data connection proves (wire::kDataProofBytes): the holder of
// this attachment's session key (fresh: both handshake nonces are in it)
// opened it, for connection `conn`. The listener sends no chunk on a data
// connection before it checked this.
wire::Mac data_proof(std::string_view session, std::uint64_t conn);

// The MAC of an authenticated control message (its bytes so far: header
// with the sequence number, then body); `dir` is "down" or "up".
wire::Mac message_mac(std::string_view session, std::string_view dir, std::span<const std::uint8_t> msg);

}  // namespace shmcast::relay::auth
