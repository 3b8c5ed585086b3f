// The bench's named manifests (bench.hpp, manifest_by_name): the shapes of
// real models, for shmcast-bench --mode cuda and shmcast-delta-sync-bench.
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.hpp"

namespace bench {

// Qwen3-30B-A3B, bf16, from its published config.json: 48 layers, hidden
// 2048, 32 query heads and 4 KV heads of 128, 128 experts of
// moe_intermediate 768 (gate/up 768 x 2048, down 2048 x 768), a router of
// 128 x 2048, vocabulary 151,936, untied lm_head: 18,867 tensors with the
// first `layers` layers (48: 61,064,245,248 bytes). `dense`: the same
// bytes, each layer's experts as three stacked tensors (128 * 768 x 2048,
// ..., 2048 x 128 * 768): 579 tensors at 48 layers.
std::vector<shmcast::TensorSpec> qwen3_30b_a3b(bool dense, int layers) {
  using shmcast::DType;
  std::vector<shmcast::TensorSpec> v;
  const std::int64_t H = 2048, E = 128, I = 768, Q = 32 * 128, KV = 4 * 128, V = 151936;
  auto add = [&](std::string n, std::vector<std::int64_t> shape) { v.push_back({std::move(n), DType::kBF16, std::move(shape)}); };
  add("model.embed_tokens.weight", {V, H});
  for (int l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {Q, H});
    add(p + "self_attn.k_proj.weight", {KV, H});
    add(p + "self_attn.v_proj.weight", {KV, H});
    add(p + "self_attn.o_proj.weight", {H, Q});
    add(p + "self_attn.q_norm.weight", {128});
    add(p + "self_attn.k_norm.weight", {128});
    add(p + "mlp.gate.weight", {E, H});
    if (dense) {
      add(p + "mlp.experts.gate_proj.weight", {E * I, H});
      add(p + "mlp.experts.up_proj.weight", {E * I, H});
      add(p + "mlp.experts.down_proj.weight", {H, E * I});
    } else {
      for (int e = 0; e < E; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        add(x + "gate_proj.weight", {I, H});
        add(x + "up_proj.weight", {I, H});
        add(x + "down_proj.weight", {H, I});
      }
    }
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
  }
  add("model.norm.weight", {H});
  add("lm_head.weight", {V, H});
  return v;
}

std::vector<shmcast::TensorSpec> manifest_by_name(const std::string& name) {
  using shmcast::DType;
  std::vector<shmcast::TensorSpec> v;
  // "qwen3-30b-a3b:N" (or "-dense:N"): the first N of the 48 layers, for a
  // GPU that cannot hold the whole model plus the consumer's copy.
  const std::size_t colon = name.find(':');
  const std::string base = name.substr(0, colon);
  if (base == "qwen3-30b-a3b" || base == "qwen3-30b-a3b-dense") {
    int layers = 48;
    if (colon != std::string::npos) {
      const std::string n = name.substr(colon + 1);
      std::size_t used = 0;
      try {
        layers = std::stoi(n, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (n.empty() || used != n.size() || layers < 1 || layers > 48)
        throw std::invalid_argument("manifest '" + name + "': the layer count after ':' must be 1..48");
    }
    return qwen3_30b_a3b(base == "qwen3-30b-a3b-dense", layers);
  }
  if (name != "qwen2.5-3b")
    throw std::invalid_argument("unknown manifest '" + name +
                                "' (known: qwen2.5-3b, qwen3-30b-a3b[:layers], qwen3-30b-a3b-dense[:layers])");
  // Qwen2.5-3B, bf16, tied embeddings: 434 tensors, 6,171,877,376 bytes.
  const std::int64_t H = 2048, I = 11008, KV = 256, V = 151936;
  auto add = [&](std::string n, std::vector<std::int64_t> shape) { v.push_back({std::move(n), DType::kBF16, std::move(shape)}); };
  add("model.embed_tokens.weight", {V, H});
  for (int l = 0; l < 36; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "self_attn.q_proj.weight", {H, H});
    add(p + "self_attn.q_proj.bias", {H});
    add(p + "self_attn.k_proj.weight", {KV, H});
    add(p + "self_attn.k_proj.bias", {KV});
    add(p + "self_attn.v_proj.weight", {KV, H});
    add(p + "self_attn.v_proj.bias", {KV});
    add(p + "self_attn.o_proj.weight", {H, H});
    add(p + "mlp.gate_proj.weight", {I, H});
    add(p + "mlp.up_proj.weight", {I, H});
    add(p + "mlp.down_proj.weight", {H, I});
    add(p + "input_layernorm.weight", {H});
    add(p + "post_attention_layernorm.weight", {H});
  }
  add("model.norm.weight", {H});
  return v;
}

std::vector<ManifestSize> manifest_sizes(const std::vector<std::string>& names) {
  std::vector<ManifestSize> out;
  for (const std::string& m : names) {
    ManifestSize z{m, 0, 0};
    const std::vector<shmcast::TensorSpec> specs = manifest_by_name(m);
    z.tensors = specs.size();
    for (const auto& t : specs) z.bytes += t.nbytes();
    std::printf("manifest %s: %zu tensors, %llu bytes (bf16)\n", m.c_str(), z.tensors,
                static_cast<unsigned long long>(z.bytes));
    out.push_back(z);
  }
  return out;
}

}  // namespace bench
