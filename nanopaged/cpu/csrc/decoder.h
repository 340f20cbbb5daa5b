// What the fused path describes to C++ once, after loading (nanopaged/cpu/fused.py builds it from
// the model's own modules): each layer's norms and linears, and the attention's shape. decoder.cpp
// runs it once per step; bindings.cpp makes each struct a Python class, and LinearKind an enum.
#pragma once

#include <torch/extension.h>
#include <memory>
#include <tuple>
#include <vector>

// A linear is one of: nanopaged's bfloat16 kernels (DPBF16, AMX); a quantized weight, at every row count
// (QUANTIZED; W8A8 on AMX's int8 tiles: AMX_INT8); anything else, a Python callable
// (CALLBACK: oneDNN's packed linear, nn.Linear, torch's int4 kernel), called back with the GIL the
// caller holds.
enum class LinearKind { DPBF16, AMX, QUANTIZED, AMX_INT8, CALLBACK };

// LoRA (lora/layers.py): each slot's y[rows] += B (A x[rows]) * scaling, for linear_bf16: the parts' A stacked,
// a B per part the adapter has, into its columns (start, width) of y. No A: the projection left alone.
using LoraGroups = std::vector<std::pair<int64_t, torch::Tensor>>;      // (slot, its rows)
using LoraPart = std::tuple<torch::Tensor, int64_t, int64_t>;            // (packed B, start, width)
struct LoraSlots {
  std::vector<torch::Tensor> a;
  std::vector<int64_t> rank;
  std::vector<double> scaling;
  std::vector<std::vector<LoraPart>> parts;
  explicit LoraSlots(int64_t slots) : a(slots), rank(slots), scaling(slots), parts(slots) {}
  void set(int64_t slot, torch::Tensor a_packed, int64_t r, double s, std::vector<LoraPart> b_parts) {
    a.at(slot) = a_packed, rank[slot] = r, scaling[slot] = s, parts[slot] = std::move(b_parts);   // at: checked
  }
  void add(torch::Tensor& y, const torch::Tensor& x, const LoraGroups& groups) const;
};

struct Linear {
  LinearKind kind = LinearKind::CALLBACK;
  int64_t out_features = 0;
  torch::Tensor packed, bias;                        // DPBF16, AMX, QUANTIZED: pack_bf16_weight's, pack_amx_weight's, pack_quantized's
  int64_t group = 0, bits = 0;                       // QUANTIZED
  pybind11::object fn;                               // CALLBACK
  std::shared_ptr<LoraSlots> lora;                   // with enable_lora: the adapters' updates, else none

  torch::Tensor operator()(const torch::Tensor& x, const LoraGroups& groups = {}) const;   // x W^T + b (+ LoRA)
  torch::Tensor silu_mul(const torch::Tensor& x, const LoraGroups& groups) const;  // gate_up, SiLU(gate) * up
};

// A mixture of experts' experts (moe.cpp): each expert's gate/up and down projections; called with
// the step's routing, the weighted sum of every token's chosen experts.
struct Experts {
  std::vector<Linear> gate_up, down;
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& chosen, const torch::Tensor& weights) const;
};

struct Layer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;     // q_norm, k_norm: Qwen3's, else empty
  Linear qkv, o, gate_up, down;
  pybind11::object moe;              // a mixture of experts' MLP (nanopaged/cpu/moe.py), called back; else None
};

struct Decoder {
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double eps = 1e-6, qk_eps = 1e-6, scale = 1.0;
  LoraGroups lora_groups;                            // set before each step by nanopaged/lora/manager.py
};

torch::Tensor decoder_forward(const Decoder& dec, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, bool share_prefixes);
