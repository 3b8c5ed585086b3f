// libFuzzer target: the safetensors header and index parsers, which read a
// checkpoint's untrusted bytes before any tensor data is touched.
//
// Input: one selector byte, then the bytes.
//   selector bit 0 clear: the bytes are a whole .safetensors file
//                         (parse_header with file size = their length)
//   selector bit 0 set:   the bytes are model.safetensors.index.json
//                         (parse_index)
//
// Contract: the parser returns or throws shmcast::Error (kCorrupt; never
// anything else), promptly. An accepted header describes a consistent file:
// every dtype known, nbytes = elements * bits / 8 without overflow, the
// tensors sorted by offset tile the data section exactly and end at the end
// of the file, names unique, data_start = 8 + header length. An accepted
// index maps names to plain file names.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <span>
#include <string>

#include "shmcast/safetensors.hpp"

namespace sf = shmcast::safetensors;

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what);
  std::fflush(stderr);
  __builtin_trap();
}

void outcome(const char* what) {
  static const bool on = std::getenv("SHMCAST_FUZZ_VERBOSE") != nullptr;
  if (on) std::printf("  %s\n", what);
}

void check_header(const sf::FileHeader& h, std::uint64_t size) {
  if (h.data_start != 8 + h.header_bytes || h.file_bytes != size || h.data_start > size)
    finding("header geometry disagrees with the file");
  std::uint64_t at = h.data_start;
  std::set<std::string> names;
  for (const sf::TensorEntry& t : h.tensors) {
    const unsigned bits = sf::dtype_bits(t.dtype);
    if (bits == 0) finding("unknown dtype accepted");
    std::uint64_t elems = 1;
    for (std::int64_t d : t.shape) {
      if (d < 0) finding("negative dimension accepted");
      if (__builtin_mul_overflow(elems, static_cast<std::uint64_t>(d), &elems)) finding("element count overflow accepted");
    }
    std::uint64_t b = 0;
    if (__builtin_mul_overflow(elems, std::uint64_t{bits}, &b)) finding("bit count overflow accepted");
    if (b % 8 != 0 || b / 8 != t.nbytes) finding("nbytes disagrees with dtype x shape");
    if (t.offset != at) finding("tensors do not tile the data section");
    if (t.offset + t.nbytes < t.offset || t.offset + t.nbytes > size) finding("tensor outside the file accepted");
    at += t.nbytes;
    if (!names.insert(t.name).second) finding("a name twice accepted");
    if (t.name == "__metadata__") finding("__metadata__ taken for a tensor");
  }
  if (at != size) finding("data section not covered exactly");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  try {
    if (data[0] & 1) {
      const auto m = sf::parse_index(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
      for (const auto& [name, shard] : m)
        if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
            shard.find('\0') != std::string::npos)
          finding("a shard name that is not a plain file name accepted");
      outcome("index accepted");
    } else {
      const sf::FileHeader h = sf::parse_header(bytes, bytes.size(), "fuzz.safetensors");
      check_header(h, bytes.size());
      outcome("header accepted");
    }
  } catch (const shmcast::Error& e) {
    if (e.code() != shmcast::Errc::kCorrupt) finding("an error other than kCorrupt");
    outcome(e.what());
  }
  return 0;
}
