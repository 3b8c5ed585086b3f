// The fd channel's messages; see fd_channel.hpp and docs/protocol.md ("The
// fd channel"). The server is fd_server.cpp, the client fd_client.cpp.
#include "protocol/fd_channel.hpp"

#include <unistd.h>
#include <xxhash.h>

#include <bit>
#include <cstdio>
#include <cstring>
#include <utility>

#include "base/checks.hpp"
#include "base/sys.hpp"

namespace shmcast::detail {

static_assert(std::endian::native == std::endian::little, "the fd message is little-endian, like the region");

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

namespace {

template <class T>
void put(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T get(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Header offsets (docs/protocol.md, "The fd channel").
constexpr std::size_t kOffMagic = 0, kOffVersion = 4, kOffHeaderBytes = 6, kOffFdCount = 8, kOffKind = 12,
                      kOffNonce = 16, kOffUuid = 24, kOffReserved = 40, kOffSizes = 64;
// The refusal's.
constexpr std::size_t kOffReason = 8, kOffHeld = 12, kOffLimit = 16, kOffTopPid = 20, kOffTopUid = 24,
                      kOffTopHeld = 28, kOffRefusalReserved = 32;

bool known_kind(std::uint32_t k) { return k == 1 || k == 2; }

}  // namespace



std::vector<std::byte> encode_fd_message(const FdSetInfo& info) {
  const std::size_t n = info.sizes.size();
  if (n == 0 || n > kMaxChannelFds)
    throw Error(Errc::kInvalidArgument, "an fd channel message carries 1.." + std::to_string(kMaxChannelFds) +
                                            " fds, not " + std::to_string(n));
  if (!known_kind(static_cast<std::uint32_t>(info.kind)))
    throw Error(Errc::kInvalidArgument, "unknown fd kind " + std::to_string(static_cast<std::uint32_t>(info.kind)));
  if (info.region_nonce == 0) throw Error(Errc::kInvalidArgument, "the region nonce of an fd channel must not be 0");
  for (std::size_t i = 0; i < n; ++i)
    if (info.sizes[i] == 0 || info.sizes[i] > kMaxChannelFdBytes)
      throw Error(Errc::kInvalidArgument, "fd " + std::to_string(i) + " has size " + std::to_string(info.sizes[i]) +
                                              "; each must be 1 byte to 64 TiB");
  std::vector<std::byte> m(kFdMessageHeaderBytes + 8 * n);  // zeros: reserved bytes
  put<std::uint32_t>(&m[kOffMagic], kFdMessageMagic);
  put<std::uint16_t>(&m[kOffVersion], kFdMessageVersion);
  put<std::uint16_t>(&m[kOffHeaderBytes], static_cast<std::uint16_t>(kFdMessageHeaderBytes));
  put<std::uint32_t>(&m[kOffFdCount], static_cast<std::uint32_t>(n));
  put<std::uint32_t>(&m[kOffKind], static_cast<std::uint32_t>(info.kind));
  put<std::uint64_t>(&m[kOffNonce], info.region_nonce);
  std::memcpy(&m[kOffUuid], info.device_uuid.data(), 16);
  for (std::size_t i = 0; i < n; ++i) put<std::uint64_t>(&m[kOffSizes + 8 * i], info.sizes[i]);
  return m;
}

std::string decode_fd_message(std::span<const std::byte> m, FdSetInfo* out) {
  if (m.size() < kFdMessageHeaderBytes)
    return "the message has " + std::to_string(m.size()) + " bytes, less than its 64-byte header";
  const auto magic = get<std::uint32_t>(&m[kOffMagic]);
  if (magic != kFdMessageMagic) return printf_u64("bad magic 0x%08llx (not an fd channel message)", magic);
  const auto version = get<std::uint16_t>(&m[kOffVersion]);
  if (version != kFdMessageVersion)
    return "message version " + std::to_string(version) + ", this shmcast reads version " +
           std::to_string(kFdMessageVersion) + " (producer and consumer run different shmcast versions)";
  const auto hb = get<std::uint16_t>(&m[kOffHeaderBytes]);
  if (hb != kFdMessageHeaderBytes) return "header size " + std::to_string(hb) + ", not 64";
  const auto n = get<std::uint32_t>(&m[kOffFdCount]);
  if (n == 0 || n > kMaxChannelFds) return "fd count " + std::to_string(n) + " is outside 1.." + std::to_string(kMaxChannelFds);
  if (m.size() != kFdMessageHeaderBytes + 8ull * n)
    return "the message has " + std::to_string(m.size()) + " bytes; " + std::to_string(n) + " fds make " +
           std::to_string(kFdMessageHeaderBytes + 8ull * n);
  const auto kind = get<std::uint32_t>(&m[kOffKind]);
  if (!known_kind(kind)) return "unknown fd kind " + std::to_string(kind);
  const auto nonce = get<std::uint64_t>(&m[kOffNonce]);
  if (nonce == 0) return "region nonce 0";
  for (std::size_t i = kOffReserved; i < kFdMessageHeaderBytes; ++i)
    if (m[i] != std::byte{0}) return "reserved header byte " + std::to_string(i) + " is not zero";
  FdSetInfo info;
  info.kind = static_cast<FdKind>(kind);
  info.region_nonce = nonce;
  std::memcpy(info.device_uuid.data(), &m[kOffUuid], 16);
  info.sizes.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    info.sizes[i] = get<std::uint64_t>(&m[kOffSizes + 8 * i]);
    if (info.sizes[i] == 0 || info.sizes[i] > kMaxChannelFdBytes)
      return "fd " + std::to_string(i) + " has size " + std::to_string(info.sizes[i]) + " (1 byte to 64 TiB)";
  }
  *out = std::move(info);
  return {};
}

std::vector<std::byte> encode_fd_refusal(const FdRefusalInfo& r) {
  std::vector<std::byte> m(kFdMessageHeaderBytes);  // zeros: reserved bytes
  put<std::uint32_t>(&m[kOffMagic], kFdRefusalMagic);
  put<std::uint16_t>(&m[kOffVersion], kFdMessageVersion);
  put<std::uint16_t>(&m[kOffHeaderBytes], static_cast<std::uint16_t>(kFdMessageHeaderBytes));
  put<std::uint32_t>(&m[kOffReason], static_cast<std::uint32_t>(r.reason));
  put<std::uint32_t>(&m[kOffHeld], r.held);
  put<std::uint32_t>(&m[kOffLimit], r.limit);
  put<std::int32_t>(&m[kOffTopPid], r.top_pid);
  put<std::uint32_t>(&m[kOffTopUid], r.top_uid);
  put<std::uint32_t>(&m[kOffTopHeld], r.top_held);
  return m;
}

std::string decode_fd_refusal(std::span<const std::byte> m, FdRefusalInfo* out) {
  if (m.size() != kFdMessageHeaderBytes)
    return "the refusal has " + std::to_string(m.size()) + " bytes, not 64";
  if (get<std::uint32_t>(&m[kOffMagic]) != kFdRefusalMagic) return "bad magic (not a refusal)";
  const auto version = get<std::uint16_t>(&m[kOffVersion]);
  if (version != kFdMessageVersion)
    return "refusal version " + std::to_string(version) + ", this shmcast reads version " +
           std::to_string(kFdMessageVersion);
  if (get<std::uint16_t>(&m[kOffHeaderBytes]) != kFdMessageHeaderBytes) return "refusal header size is not 64";
  const auto reason = get<std::uint32_t>(&m[kOffReason]);
  if (reason < 1 || reason > 5) return "unknown refusal reason " + std::to_string(reason);
  for (std::size_t i = kOffRefusalReserved; i < kFdMessageHeaderBytes; ++i)
    if (m[i] != std::byte{0}) return "reserved refusal byte " + std::to_string(i) + " is not zero";
  FdRefusalInfo r;
  r.reason = static_cast<FdRefusal>(reason);
  r.held = get<std::uint32_t>(&m[kOffHeld]);
  r.limit = get<std::uint32_t>(&m[kOffLimit]);
  r.top_pid = get<std::int32_t>(&m[kOffTopPid]);
  r.top_uid = get<std::uint32_t>(&m[kOffTopUid]);
  r.top_held = get<std::uint32_t>(&m[kOffTopHeld]);
  *out = r;
  return {};
}

std::string slot_socket_name(std::string_view name) {
  constexpr std::size_t kPlain = 64, kKept = 48;
  std::string f = "shmcast-slots.";
  if (name.size() <= kPlain) return f.append(name);
  char h[17];
  std::snprintf(h, sizeof h, "%016llx", static_cast<unsigned long long>(XXH3_64bits(name.data(), name.size())));
  return f.append(name.substr(0, kKept)).append("~").append(h);
}

std::string slot_socket_file(std::string_view dir, std::string_view name) {
  return trim_dir(dir) + "/" + slot_socket_name(name);
}

}  // namespace shmcast::detail
