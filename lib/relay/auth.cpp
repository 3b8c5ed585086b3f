#include "auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "base/sys.hpp"

namespace shmcast::relay::auth {

namespace {
std::span<const std::uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
}  // namespace

void random_bytes(std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    const ssize_t got = detail::retry_eintr([&] { return ::getrandom(p, n, 0); });
    if (got < 0) {
      throw Error(Errc::kSystem, std::string("getrandom: ") + std::strerror(errno), errno);
    }
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

wire::Mac hmac(std::string_view key, std::initializer_list<std::span<const std::uint8_t>> parts) {
  std::vector<std::uint8_t> in;
  for (const auto& part : parts) {
    const std::uint64_t n = part.size();
    const auto* np = reinterpret_cast<const std::uint8_t*>(&n);
    in.insert(in.end(), np, np + 8);
    in.insert(in.end(), part.begin(), part.end());
  }
  wire::Mac out{};
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), in.data(), in.size(), out.data(), &len) == nullptr ||
      len != out.size())
    throw Error(Errc::kSystem, "HMAC-SHA256 failed (OpenSSL)");
  return out;
}

bool equal(const wire::Mac& a, const wire::Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

namespace {
wire::Mac proof(std::string_view key, std::string_view label, const Transcript& t) {
  const std::uint64_t conn = t.conn;
  const std::uint32_t proto = wire::kProto;
  return hmac(key, {bytes_of(label), bytes_of(t.region), {reinterpret_cast<const std::uint8_t*>(&proto), 4},
                    {reinterpret_cast<const std::uint8_t*>(&conn), 8}, t.server_nonce, t.client_nonce});
}
}  // namespace

wire::Mac client_proof(std::string_view key, const Transcript& t) { return proof(key, "shmcast-relay client", t); }
wire::Mac server_proof(std::string_view key, const Transcript& t) { return proof(key, "shmcast-relay server", t); }
std::string session_key(std::string_view key, const Transcript& t) {
  const wire::Mac m = proof(key, "shmcast-relay session", t);
  return std::string(reinterpret_cast<const char*>(m.data()), m.size());
}

std::uint32_t data_tag_base(std::string_view session) {
  const wire::Mac m = hmac(session, {bytes_of("shmcast-relay data tags")});
  std::uint32_t base = 0;
  std::memcpy(&base, m.data(), sizeof base);
  return base & wire::kSerialMask;
}

wire::Mac data_proof(std::string_view session, std::uint64_t conn) {
  return hmac(session, {bytes_of("shmcast-relay data connection"), {reinterpret_cast<const std::uint8_t*>(&conn), 8}});
}

wire::Mac message_mac(std::string_view session, std::string_view dir, std::span<const std::uint8_t> msg) {
  return hmac(session, {bytes_of(dir), msg});
}

}  // namespace shmcast::relay::auth
