// Small rules more than one layer needs, written once: errno to Errc, the
// region's fixed-size error-text fields, overflow-checked sizes, and the
// sanity rules of a sync record read from the region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "base/layout.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

// ---- names and messages

// Throws kBadName with validate_name()'s reason when `name` is not a valid
// region name.
void require_valid_name(std::string_view name);
// snprintf of one or two numbers into a message: printf_u64("%llu of %llu", a, b).
std::string printf_u64(const char* format, unsigned long long a, unsigned long long b = 0);

// ---- errors

// The Errc for an errno: EEXIST Exists, ENOENT NotFound, EACCES/EPERM
// Permission, ENOSPC/ENOMEM RegionFull, anything else System.
Errc errc_for_errno(int e) noexcept;
// Throws Error(errc_for_errno(e)) with "what: strerror(e)" (and, for
// EACCES/EPERM, what to do about a region's mode).
[[noreturn]] void throw_errno(int e, const std::string& what);

// ---- error text (Header::error_text, Seat::error_text: kErrorTextBytes,
// NUL-terminated, written by one side and read by anyone)

// Copies at most kErrorTextBytes - 1 bytes of `text` and a NUL.
void write_error_text(char (&dst)[kErrorTextBytes], std::string_view text) noexcept;
// The text up to its NUL, never past the field (hostile bytes may have none).
std::string read_error_text(const char (&src)[kErrorTextBytes]);

// ---- sizes

// a * b and a + b, false on overflow.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t* out) noexcept {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool checked_add(std::uint64_t a, std::uint64_t b, std::uint64_t* out) noexcept {
  return !__builtin_add_overflow(a, b, out);
}
// dtype_size(dt) * every dimension: false for an unknown dtype, a negative
// dimension or an overflow.
bool shape_bytes(DType dt, const std::int64_t* shape, std::size_t ndim, std::uint64_t* out) noexcept;
// The sum of the bytes this producer holds of the tensors (local_nbytes():
// a shard's, else the whole tensor's): false when it overflows or exceeds
// kMaxStreamBytes (one sync's limit). Throws like TensorSpec::nbytes().
bool payload_bytes(std::span<const TensorSpec> tensors, std::uint64_t* out);

// ---- the sync record

// Snapshot of the sync record taken under its seqlock (read_record in
// protocol/ring.hpp takes it; the rules below check it).
struct RecordSnapshot {
  std::uint32_t word;  // even
  std::uint64_t version, first_seq, chunks, stream_bytes, manifest_used, manifest_hash;
  bool aborted;
};
// Every field of `r` into *out (relaxed loads, the word included): the
// caller decides whether the copy is consistent (read_record's seqlock).
void copy_record(const SyncRecord& r, RecordSnapshot* out) noexcept;
// Empty when the record's manifest size, first chunk, chunk count and stream
// size are consistent with each other and with the region's geometry `g`;
// else why not. Everything a reader locates with the record is still
// bounds-checked where it is used.
std::string record_problem(const RecordSnapshot& rec, const Geometry& g);

}  // namespace shmcast::detail
