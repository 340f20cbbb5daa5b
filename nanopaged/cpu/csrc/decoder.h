// What the fused path describes to C++ once, after loading (nanopaged/cpu/fused.py builds it from
// the model's own modules): each layer's norms and linears, and the attention's shape. decoder.cpp
// runs it once per step; bindings.cpp makes each struct a Python class, and LinearKind an enum.
#pragma once

#include <torch/extension.h>
#include <memory>
#include <vector>

// A linear is one of: nanopaged's bfloat16 kernel (DPBF16); a quantized weight, at every row count
// (QUANTIZED); anything else, a Python callable
// (CALLBACK: oneDNN's packed linear, nn.Linear, torch's int4 kernel), called back with the GIL the
// caller holds.
enum class LinearKind { DPBF16, QUANTIZED, CALLBACK };

struct Linear {
  LinearKind kind = LinearKind::CALLBACK;
  int64_t out_features = 0;
  torch::Tensor packed, bias;                        // DPBF16: pack_bf16_weight's; QUANTIZED: pack_quantized's
  int64_t group = 0, bits = 0;                       // QUANTIZED
  pybind11::object fn;                               // CALLBACK

  torch::Tensor operator()(const torch::Tensor& x) const;     // x W^T + b, by `kind`
  torch::Tensor silu_mul(const torch::Tensor& x) const;       // a gate_up projection, then SiLU(gate) * up
};

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;     // q_norm, k_norm: Qwen3's, else empty
  Linear qkv, o, gate_up, down;
};

struct Decoder {
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, qk_eps = 1e-6, scale = 1.0;
};

torch::Tensor decoder_forward(const Decoder& dec, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, bool share_prefixes);
