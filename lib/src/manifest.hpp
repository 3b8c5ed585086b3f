// The manifest: what a sync holds (name, dtype, shape, size, place in the
// stream), in a binary format (layout.hpp: ManifestHeader, ManifestEntry,
// then the names blob). Never pickle. The decoder treats its input as
// hostile: every count, offset and size is bounds-checked, and the result
// must describe a consistent packing.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "layout.hpp"
#include "shmcast/shmcast.hpp"

namespace shmcast::detail {

// Packing rule: each tensor starts at a multiple of kTensorAlign; a tensor no
// larger than a slot never straddles a slot boundary (it moves to the next
// one), so a consumer can view it in place; a larger one is split.
// Fills stream offsets; returns the stream length.
std::uint64_t pack(std::span<const TensorSpec> specs, std::uint64_t slot_bytes, std::vector<std::uint64_t>* offsets,
                   std::uint64_t* payload_bytes);

// Bytes the encoded manifest takes.
std::uint64_t manifest_size(std::span<const TensorSpec> specs);

// Encodes into `out` (which has `capacity` bytes). Returns the bytes used.
std::uint64_t encode_manifest(std::span<const TensorSpec> specs, std::span<const std::uint64_t> offsets,
                              std::uint64_t sync_version, std::uint64_t stream_bytes, std::uint64_t payload_bytes,
                              std::byte* out, std::uint64_t capacity);

// Decodes a private copy of the manifest. Returns an empty string on success
// or why the bytes are not a valid manifest for (version, stream_bytes,
// slot_bytes).
// `check_names` false skips the name rules (UTF-8, NUL, duplicates) and
// leaves the names empty: for a reader that validates windows of entries
// with placeholder names (shmcast-inspect show --limit).
std::string decode_manifest(std::span<const std::byte> bytes, std::uint64_t expect_version,
                            std::uint64_t expect_stream_bytes, std::uint64_t slot_bytes, SyncInfo* out,
                            bool check_names = true);
// The rules every tensor name follows; empty when `name` is valid.
std::string name_problem(std::string_view name);

// Checks a tensor spec (name, dtype, shape); empty string when valid.
std::string validate_spec(const TensorSpec& spec);

}  // namespace shmcast::detail
