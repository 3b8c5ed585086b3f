// Helpers for the file I/O tests: safetensors files made the way the
// reference writer makes them, hand-written headers, scratch directories.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shmcast/safetensors.hpp"
#include "support.hpp"

namespace st_test {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> data;
};

// A tensor of `dtype` and `shape` filled with deterministic bytes.
inline Tensor make_tensor(const std::string& name, const std::string& dtype, std::vector<std::int64_t> shape,
                          std::uint64_t seed) {
  Tensor t{name, dtype, shape, {}};
  std::uint64_t elems = 1;
  for (auto d : shape) elems *= static_cast<std::uint64_t>(d);
  const unsigned bits = shmcast::safetensors::dtype_bits(dtype);
  t.data.resize(elems * bits / 8);
  shmcast_test::fill_pattern(t.data.data(), t.data.size(), seed);
  return t;
}

// The file bytes: tensors' data in the order given, header padded with
// spaces to a multiple of 8 (as the reference writer does).
inline std::vector<std::uint8_t> file_bytes(const std::vector<Tensor>& ts,
                                            const std::map<std::string, std::string>& meta = {}) {
  json h = json::object();
  if (!meta.empty()) h["__metadata__"] = meta;
  std::uint64_t off = 0;
  for (const Tensor& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.data.size()}}};
    off += t.data.size();
  }
  std::string text = h.dump();
  while (text.size() % 8) text.push_back(' ');
  std::vector<std::uint8_t> out(8);
  const std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), text.begin(), text.end());
  for (const Tensor& t : ts) out.insert(out.end(), t.data.begin(), t.data.end());
  return out;
}

// A file made of a hand-written header and `data_bytes` zero bytes.
inline std::vector<std::uint8_t> raw_file(const std::string& header, std::uint64_t data_bytes) {
  std::vector<std::uint8_t> out(8);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}

inline void write_file(const fs::path& p, const std::vector<std::uint8_t>& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << p;
}

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

inline std::vector<std::uint8_t> read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<std::uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// A scratch directory on a disk file system ($SHMCAST_TEST_TMPDIR, else
// /var/tmp, else /tmp), removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    const char* env = std::getenv("SHMCAST_TEST_TMPDIR");
    std::string base = env && *env ? env : (::access("/var/tmp", W_OK) == 0 ? "/var/tmp" : "/tmp");
    std::string tmpl = base + "/shmcast-fileio-XXXXXX";
    if (!::mkdtemp(tmpl.data())) std::abort();
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path operator/(const std::string& name) const { return path / name; }
};

// Whether the file system holding `dir` accepts O_DIRECT opens.
inline bool supports_direct(const fs::path& dir) {
  const fs::path p = dir / ".direct-probe";
  write_text(p, std::string(4096, 'x'));
  const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECT);
  if (fd >= 0) ::close(fd);
  fs::remove(p);
  return fd >= 0;
}

// Drops the file's pages from the page cache (clean pages only: fsync first).
inline void evict(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// A sharded checkpoint: `shards` files and model.safetensors.index.json.
inline std::vector<Tensor> make_sharded(const fs::path& dir, int shards, int per_shard, std::uint64_t seed) {
  std::vector<Tensor> all;
  json wm = json::object();
  for (int s = 0; s < shards; ++s) {
    std::vector<Tensor> ts;
    const std::string file =
        "model-" + std::to_string(100001 + s).substr(1) + "-of-" + std::to_string(100000 + shards).substr(1) +
        ".safetensors";
    for (int i = 0; i < per_shard; ++i) {
      const std::string name = "layers." + std::to_string(s * per_shard + i) + ".weight";
      ts.push_back(make_tensor(name, i % 2 ? "BF16" : "F32", {static_cast<std::int64_t>(7 + i), 33 + s},
                               seed + static_cast<std::uint64_t>(s * 100 + i)));
      wm[name] = file;
    }
    write_file(dir / file, file_bytes(ts));
    all.insert(all.end(), ts.begin(), ts.end());
  }
  write_text(dir / "model.safetensors.index.json", json{{"metadata", {{"total_size", 0}}}, {"weight_map", wm}}.dump());
  return all;
}

}  // namespace st_test
