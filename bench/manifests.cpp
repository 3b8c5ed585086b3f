// The bench's named manifests (bench.hpp, manifest_by_name): the shapes of
// real models, for shmcast-bench --mode cuda and shmcast-delta-sync-bench.
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.hpp"

namespace bench {

std::vector<shmcast::TensorSpec> manifest_by_name(const std::string& name) {
  using shmcast::DType;
  std::vector<shmcast::TensorSpec> v;
  if (name != "qwen2.5-3b")
    throw std::invalid_argument("unknown manifest '" + name + "' (known: qwen2.5-3b)");
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

}  // namespace bench
