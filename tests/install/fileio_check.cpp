// Built against an installed shmcast::fileio: parse a safetensors header
// held in memory through the public header shmcast/safetensors.hpp.
#include <shmcast/safetensors.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

int main() {
  const std::string json = R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})";
  std::vector<std::byte> file(8 + json.size() + 4);
  for (int i = 0; i < 8; ++i) file[i] = static_cast<std::byte>(json.size() >> (8 * i));
  std::memcpy(file.data() + 8, json.data(), json.size());
  const auto h = shmcast::safetensors::parse_header(file, file.size());
  shmcast::DType d{};
  const bool ok = h.tensors.size() == 1 && shmcast::safetensors::to_shmcast(h.tensors[0].dtype, &d) &&
                  d == shmcast::DType::kBF16;
  std::printf("%s\n", ok ? "fileio installed" : "fileio broken");
  return ok ? 0 : 1;
}
