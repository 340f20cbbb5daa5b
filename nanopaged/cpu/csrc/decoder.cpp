// The decoder layers, one after another, in one call: the layer loop of the fused path, over the
// description in decoder.h. It calls each kernel file once per layer (through ops.h); nothing in
// a row's inner loop crosses a file.
//
// Between the kernels, a decode step of a small model on a CPU spent time in Python: looking up
// modules, calling them, slicing the projection's output (measured: docs/05, "Fused CPU
// kernels"). So the fused path hands the whole stack of layers to C++ once per step. Each layer
// is the reference's DecoderLayer in eight calls: (add_)rms_norm, q/k/v projection,
// rotary_and_store, paged_attention, o projection, add_rms_norm, the gate/up projection with
// SiLU(gate) * up as its epilogue (linear_bf16_silu_mul), the down projection. Nine where the
// epilogue cannot run (another linear kernel, or an intermediate size not a multiple of 64): the
// projection, then silu_and_mul. The MLP's output joins the residual in the next layer's first
// norm (add_rms_norm, vLLM's fused_add_rms_norm), the last layer's in one add after the loop.
#include "decoder.h"
#include "ops.h"
#include "vec16.h"

torch::Tensor Linear::operator()(const torch::Tensor& x, const LoraGroups& groups) const {
  torch::Tensor y;
  if (kind == LinearKind::DPBF16) {
    y = linear_bf16(x, packed, bias, out_features);
  } else if (kind == LinearKind::QUANTIZED) {
    y = linear_quantized(x, packed, out_features, group, bits);
    if (bias.defined() && bias.numel()) y.add_(bias);
  } else {
    y = fn(x).cast<torch::Tensor>();
  }
  if (lora) lora->add(y, x, groups);
  return y;
}

// a gate_up projection followed by SiLU(gate) * up: in one kernel where it can be (no LoRA update between)
torch::Tensor Linear::silu_mul(const torch::Tensor& x, const LoraGroups& groups) const {
  if (NP_HAS_AVX512_BF16 && kind == LinearKind::DPBF16 && out_features % (2 * 64) == 0 &&
      !(lora && lora->active(groups)))
    return linear_bf16_silu_mul(x, packed, bias, out_features / 2);
  return silu_and_mul((*this)(x, groups));
}

void LoraSlots::set(int64_t slot, torch::Tensor a_packed, torch::Tensor b_packed, int64_t rows, double s) {
  TORCH_CHECK(slot >= 0 && slot < int64_t(a.size()), "LoraSlots.set: slot ", slot, " out of range");
  a[slot] = a_packed, b[slot] = b_packed, a_rows[slot] = rows, scaling[slot] = s;
}

bool LoraSlots::active(const LoraGroups& groups) const {
  for (const auto& group : groups)
    if (a[group.first].defined() && a[group.first].numel()) return true;
  return false;
}

// Each slot's rows gathered, shrunk to the adapter's rank, expanded, scaled, added: LoRALinear.forward's ops.
void LoraSlots::add(torch::Tensor& y, const torch::Tensor& x, const LoraGroups& groups) const {
  for (const auto& [slot, rows] : groups) {
    if (!a[slot].defined() || !a[slot].numel()) continue;
    auto shrunk = linear_bf16(x.index_select(0, rows), a[slot], torch::Tensor(), a_rows[slot]);
    y.index_add_(0, rows, linear_bf16(shrunk, b[slot], torch::Tensor(), y.size(1)).mul_(scaling[slot]));
  }
}

// x (tokens, hidden): the embeddings, the residual stream through every layer (updated in place);
// cos, sin (tokens, head_dim); kv_cache (layers, 2, blocks, block_size, kv_heads, head_dim); the
// step's slot mapping, block tables, lengths and query starts, and whether rows that share blocks
// read them once (AttentionMetadata's).
torch::Tensor decoder_forward(const Decoder& dec, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc, bool share_prefixes) {
  TORCH_CHECK(kv_cache.size(0) == int64_t(dec.layers.size()), "decoder_forward: one KV cache per layer");
  const int64_t n = x.size(0), q_width = dec.heads * dec.head_dim;
  torch::Tensor mlp;     // the layer before's MLP output, added to x by the next norm (vLLM's fused_add_rms_norm)
  for (size_t i = 0; i < dec.layers.size(); ++i) {
    const Layer& layer = dec.layers[i];
    auto k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
    auto nx = mlp.defined() ? add_rms_norm(x, mlp, layer.input_norm, dec.eps) : rms_norm(x, layer.input_norm, dec.eps);
    const LoraGroups& loras = dec.lora_groups;
    auto qkv = layer.qkv(nx, loras);
    rotary_and_store(qkv, cos, sin, layer.q_norm, layer.k_norm, dec.qk_eps, dec.heads, dec.kv_heads, k_cache, v_cache,
                     slot_mapping);
    auto q = qkv.narrow(1, 0, q_width).view({n, dec.heads, dec.head_dim});
    auto o = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dec.scale,
                             share_prefixes);
    auto h = add_rms_norm(x, layer.o(o.view({n, q_width}), loras), layer.post_norm, dec.eps);   // x += o
    mlp = layer.down(layer.gate_up.silu_mul(h, loras), loras);
  }
  return mlp.defined() ? x.add_(mlp) : x;
}

