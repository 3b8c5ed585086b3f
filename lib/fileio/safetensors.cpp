// The safetensors format, read defensively: dtype tables, the header length,
// the header itself and model.safetensors.index.json. Pure functions of
// bytes (no file access): the fuzzer (tests/fuzz/fuzz_safetensors.cpp)
// calls them directly.
//
// Format: 8 bytes N (u64, little-endian), N bytes of JSON, then the data
// section. The JSON is an object: "__metadata__" (an object of strings,
// optional) and one entry per tensor, {"dtype": "BF16", "shape": [..],
// "data_offsets": [begin, end]}, offsets relative to the data section.
// Sorted by offset, the tensors cover the data section exactly, and it ends
// at the end of the file (as the reference implementation requires).
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "shmcast/safetensors.hpp"

namespace shmcast::safetensors {

namespace {

using json = nlohmann::json;

struct DtypeRow {
  const char* name;
  unsigned bits;
  DType shmcast;  // kRaw: none
};

constexpr DtypeRow kDtypes[] = {
    {"BOOL", 8, DType::kBool},       {"U8", 8, DType::kU8},          {"I8", 8, DType::kI8},
    {"I16", 16, DType::kI16},        {"I32", 32, DType::kI32},       {"I64", 64, DType::kI64},
    {"U16", 16, DType::kU16},        {"U32", 32, DType::kU32},       {"U64", 64, DType::kU64},
    {"F16", 16, DType::kF16},        {"BF16", 16, DType::kBF16},     {"F32", 32, DType::kF32},
    {"F64", 64, DType::kF64},        {"F8_E4M3", 8, DType::kF8E4M3FN}, {"F8_E5M2", 8, DType::kF8E5M2},
    {"F8_E8M0", 8, DType::kF8E8M0FNU}, {"C64", 64, DType::kC64},
    {"F4", 4, DType::kRaw},          {"F6_E2M3", 6, DType::kRaw},    {"F6_E3M2", 6, DType::kRaw},
};

const DtypeRow* find_dtype(std::string_view name) {
  for (const DtypeRow& r : kDtypes)
    if (name == r.name) return &r;
  return nullptr;
}

constexpr const char* kRemedy = " The file is damaged, truncated or not a safetensors file: download it again or save it again.";

// A name for a message: JSON-quoted (so control bytes and quotes are
// visible), cut at 200 bytes.
std::string show_name(std::string_view s) {
  std::string out;
  try {
    out = json(std::string(s.substr(0, 200))).dump(-1, ' ', true, json::error_handler_t::replace);
  } catch (...) {
    out = "\"?\"";
  }
  if (s.size() > 200) out += "...";
  return out;
}

[[noreturn]] void bad(std::string_view what, const std::string& why) {
  throw Error(Errc::kCorrupt, std::string(what) + ": not a valid safetensors file: " + why + "." + kRemedy);
}

[[noreturn]] void bad_index(std::string_view what, const std::string& why) {
  throw Error(Errc::kCorrupt, std::string(what) + ": not a valid safetensors index: " + why +
                                  ". Regenerate model.safetensors.index.json from the shards, or download it again.");
}

// Thrown from the parser callback; turned into a message by the caller.
struct Reject {
  std::string why;
};

// Parses `text` into a DOM, rejecting any key that occurs twice in one object
// and any object or array nested deeper than `max_depth` (the top level is
// depth 1). Returns false with *why on a syntax error.
bool parse_strict(std::string_view text, int max_depth, json* out, std::string* why) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto cb = [&](int depth, json::parse_event_t ev, json& parsed) -> bool {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth + 1 > max_depth)
          throw Reject{"JSON nested deeper than " + std::to_string(max_depth) + " levels"};
        if (ev == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty()) {
          const std::string& k = parsed.get_ref<const std::string&>();
          if (!keys.back().insert(k).second) throw Reject{"the key " + show_name(k) + " twice in one object"};
        }
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    *out = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    // e.what() is "[json.exception.parse_error.101] parse error at line 1, column 7: ..."
    std::string w = e.what();
    const auto at = w.find("] ");
    *why = "malformed JSON (" + (at == std::string::npos ? w : w.substr(at + 2)) + ")";
    return false;
  } catch (const json::exception& e) {
    *why = std::string("malformed JSON (") + e.what() + ")";
    return false;
  }
  return true;
}

// A JSON integer >= 0 that fits u64, else false.
bool as_u64(const json& v, std::uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    const std::int64_t x = v.get<std::int64_t>();
    if (x < 0) return false;
    *out = static_cast<std::uint64_t>(x);
    return true;
  }
  return false;
}

std::uint64_t le64(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

}  // namespace

unsigned dtype_bits(std::string_view name) noexcept {
  const DtypeRow* r = find_dtype(name);
  return r ? r->bits : 0;
}

bool to_shmcast(std::string_view name, DType* out) noexcept {
  const DtypeRow* r = find_dtype(name);
  if (!r || r->shmcast == DType::kRaw) return false;
  if (out) *out = r->shmcast;
  return true;
}

std::string_view from_shmcast(DType d) noexcept {
  for (const DtypeRow& r : kDtypes)
    if (r.shmcast == d && d != DType::kRaw) return r.name;
  return {};
}

std::uint64_t header_length(std::span<const std::byte> first8, std::uint64_t file_bytes, std::string_view what) {
  if (first8.size() < 8 || file_bytes < 8)
    bad(what, "it is " + std::to_string(std::min<std::uint64_t>(file_bytes, first8.size())) +
                  " bytes long, shorter than the 8-byte header length");
  const std::uint64_t n = le64(first8.data());
  if (n > kMaxHeaderBytes)
    bad(what, "its header length says " + std::to_string(n) + " bytes, more than the " +
                  std::to_string(kMaxHeaderBytes) + "-byte limit");
  if (n > file_bytes - 8)
    bad(what, "its header length says " + std::to_string(n) + " bytes but only " + std::to_string(file_bytes - 8) +
                  " bytes follow it");
  if (n < 2) bad(what, "its header is " + std::to_string(n) + " bytes long, too short for a JSON object");
  return n;
}

FileHeader parse_header(std::span<const std::byte> bytes, std::uint64_t file_bytes, std::string_view what) {
  const std::uint64_t n = header_length(bytes.first(std::min<std::size_t>(bytes.size(), 8)), file_bytes, what);
  if (bytes.size() < 8 + n)
    throw Error(Errc::kInvalidArgument, std::string(what) + ": parse_header needs the first " + std::to_string(8 + n) +
                                            " bytes of the file, got " + std::to_string(bytes.size()));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()) + 8, n);
  if (text[0] != '{') bad(what, "its header does not start with '{'");
  // The JSON parser would take a NUL byte for the end of its input and
  // ignore what follows; JSON text never holds one (strings escape it).
  if (const auto z = text.find('\0'); z != std::string_view::npos)
    bad(what, "its header holds a NUL byte at offset " + std::to_string(8 + z));

  json doc;
  std::string why;
  try {
    if (!parse_strict(text, 3, &doc, &why)) bad(what, "its header is " + why);
  } catch (const Reject& r) {
    bad(what, "its header has " + r.why);
  }
  if (!doc.is_object()) bad(what, "its header is not a JSON object");

  FileHeader h;
  h.header_bytes = n;
  h.data_start = 8 + n;
  const std::uint64_t data_bytes = file_bytes - h.data_start;

  struct Span {
    std::uint64_t begin, end;
    std::size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(doc.size());
  std::vector<TensorEntry> tensors;
  tensors.reserve(doc.size());
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad(what, "__metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          bad(what, "__metadata__ value " + show_name(m.key()) + " is not a string (it must map strings to strings)");
        h.metadata.emplace(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    const std::string t = "tensor " + show_name(name);
    if (!v.is_object()) bad(what, t + " is not an object");
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        bad(what, t + " has an unknown field " + show_name(f.key()) + " (only dtype, shape, data_offsets)");
    const auto dt = v.find("dtype");
    const auto sh = v.find("shape");
    const auto of = v.find("data_offsets");
    if (dt == v.end() || sh == v.end() || of == v.end())
      bad(what, t + " lacks " + std::string(dt == v.end() ? "dtype" : sh == v.end() ? "shape" : "data_offsets"));
    if (!dt->is_string()) bad(what, t + ": dtype is not a string");
    const std::string& dtype = dt->get_ref<const std::string&>();
    const DtypeRow* row = find_dtype(dtype);
    if (!row) bad(what, t + " has the unknown dtype " + show_name(dtype));
    if (!sh->is_array()) bad(what, t + ": shape is not an array");
    TensorEntry e;
    e.name = name;
    e.dtype = dtype;
    std::uint64_t elems = 1;
    for (const json& d : *sh) {
      std::uint64_t x = 0;
      if (!as_u64(d, &x)) bad(what, t + ": shape " + sh->dump() + " holds something other than integers >= 0");
      if (x > static_cast<std::uint64_t>(INT64_MAX) || __builtin_mul_overflow(elems, x, &elems))
        bad(what, t + ": shape " + sh->dump() + " has more elements than 2^64");
      e.shape.push_back(static_cast<std::int64_t>(x));
    }
    std::uint64_t bits = 0;
    if (__builtin_mul_overflow(elems, std::uint64_t{row->bits}, &bits))
      bad(what, t + ": shape " + sh->dump() + " of " + dtype + " is larger than 2^64 bits");
    if (bits % 8 != 0)
      bad(what, t + ": " + std::to_string(elems) + " elements of " + dtype + " are not a whole number of bytes");
    e.nbytes = bits / 8;
    if (!of->is_array() || of->size() != 2) bad(what, t + ": data_offsets is not [begin, end]");
    std::uint64_t b = 0, en = 0;
    if (!as_u64((*of)[0], &b) || !as_u64((*of)[1], &en))
      bad(what, t + ": data_offsets " + of->dump() + " are not integers >= 0");
    if (en < b) bad(what, t + ": data_offsets " + of->dump() + " end before they begin");
    if (en > data_bytes)
      bad(what, t + ": data_offsets " + of->dump() + " end past the data section (" + std::to_string(data_bytes) +
                    " bytes after the header)");
    if (en - b != e.nbytes)
      bad(what, t + ": data_offsets " + of->dump() + " span " + std::to_string(en - b) + " bytes but shape " +
                    sh->dump() + " of " + dtype + " needs " + std::to_string(e.nbytes));
    e.offset = h.data_start + b;
    spans.push_back({b, en, tensors.size()});
    tensors.push_back(std::move(e));
  }

  // Sorted by offset (the JSON may list them in any order), the tensors tile
  // the data section: no gap, no overlap, nothing after the last.
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  std::uint64_t at = 0;
  for (const Span& s : spans) {
    const std::string t = "tensor " + show_name(tensors[s.index].name);
    if (s.begin < at) {
      // Find the one it overlaps, for the message.
      std::string other;
      for (const Span& o : spans)
        if (o.index != s.index && o.begin < s.end && s.begin < o.end) {
          other = tensors[o.index].name;
          break;
        }
      bad(what, t + " [" + std::to_string(s.begin) + ", " + std::to_string(s.end) + ") overlaps " +
                    (other.empty() ? std::string("another tensor") : "tensor " + show_name(other)));
    }
    if (s.begin > at)
      bad(what, "bytes [" + std::to_string(at) + ", " + std::to_string(s.begin) + ") of the data section before " + t +
                    " belong to no tensor");
    at = s.end;
  }
  if (at != data_bytes)
    bad(what, "the tensors cover " + std::to_string(at) + " bytes of the data section but it holds " +
                  std::to_string(data_bytes) + " (the file is longer than its header says)");
  h.file_bytes = file_bytes;
  h.tensors.reserve(tensors.size());
  for (const Span& s : spans) h.tensors.push_back(std::move(tensors[s.index]));
  return h;
}

std::map<std::string, std::string> parse_index(std::string_view text, std::string_view what) {
  if (text.size() > kMaxIndexBytes)
    bad_index(what, "it is " + std::to_string(text.size()) + " bytes, more than the " + std::to_string(kMaxIndexBytes) +
                        "-byte limit");
  if (const auto z = text.find('\0'); z != std::string_view::npos)
    bad_index(what, "it holds a NUL byte at offset " + std::to_string(z));
  json doc;
  std::string why;
  try {
    if (!parse_strict(text, 8, &doc, &why)) bad_index(what, "it is " + why);
  } catch (const Reject& r) {
    bad_index(what, "it has " + r.why);
  }
  if (!doc.is_object()) bad_index(what, "it is not a JSON object");
  if (const auto m = doc.find("metadata"); m != doc.end() && !m->is_object() && !m->is_null())
    bad_index(what, "\"metadata\" is not an object");
  const auto wm = doc.find("weight_map");
  if (wm == doc.end()) bad_index(what, "it has no \"weight_map\"");
  if (!wm->is_object()) bad_index(what, "\"weight_map\" is not an object");
  std::map<std::string, std::string> out;
  std::set<std::string> shards;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string())
      bad_index(what, "weight_map entry " + show_name(it.key()) + " does not name a shard file (not a string)");
    const std::string& shard = it.value().get_ref<const std::string&>();
    if (shard.empty() || shard == "." || shard == ".." || shard.size() > 255 ||
        shard.find('/') != std::string::npos || shard.find('\0') != std::string::npos)
      bad_index(what, "weight_map entry " + show_name(it.key()) + " names the shard " + show_name(shard) +
                          ", which is not a plain file name (no '/', not '.' or '..', 1..255 bytes): shards must lie "
                          "in the checkpoint's directory");
    shards.insert(shard);
    if (shards.size() > kMaxShards)
      bad_index(what, "it names more than " + std::to_string(kMaxShards) + " shard files");
    out.emplace(it.key(), shard);
  }
  return out;
}

}  // namespace shmcast::safetensors
