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
// norm (add_rms_norm, vLLM's fused_add_rms_norm), the last layer's in one add after the loop. A
// mixture of experts' layer calls its block back instead of the MLP (nanopaged/cpu/moe.py routes in
// torch, then runs its experts grouped, moe.cpp).
#include <c10/util/ParallelGuard.h>
#include "decoder.h"
#include "ops.h"
#include "vec16.h"

// A Python layer, called back: with the GIL, which every kernel lets go while it runs (bindings.cpp)
static torch::Tensor call_python(const pybind11::object& fn, const torch::Tensor& x) {
  pybind11::gil_scoped_acquire gil;
  return fn(x).cast<torch::Tensor>();
}

torch::Tensor Linear::operator()(const torch::Tensor& x, const LoraGroups& groups) const {
  torch::Tensor y;
  if (kind == LinearKind::DPBF16) {
    y = linear_bf16(x, packed, bias, out_features);
  } else if (kind == LinearKind::AMX) {
    y = linear_amx(x, packed, bias, out_features);
  } else if (kind == LinearKind::QUANTIZED) {
    y = linear_quantized(x, packed, out_features, group, bits);
    if (bias.defined() && bias.numel()) y.add_(bias);
  } else if (kind == LinearKind::AMX_INT8) {
    y = linear_amx_int8(x, packed, out_features);
    if (bias.defined() && bias.numel()) y.add_(bias);
  } else {
    y = call_python(fn, x);
  }
  if (lora) lora->add(y, x, groups);
  return y;
}

// a gate_up projection followed by SiLU(gate) * up: in one kernel where it can be (no LoRA in the step)
torch::Tensor Linear::silu_mul(const torch::Tensor& x, const LoraGroups& groups) const {
  if (NP_HAS_AVX512_BF16 && kind == LinearKind::DPBF16 && out_features % (2 * 64) == 0 &&
      !(lora && !groups.empty()))
    return linear_bf16_silu_mul(x, packed, bias, out_features / 2);
  return silu_and_mul((*this)(x, groups));
}

// y[rows[i], start:] += d[i] * s, rounded to bfloat16 after the product and after the sum, as torch's mul
// and index_add_ round them (Dpbf16SlotWeights.add_to's last two ops), in one pass over the rows
static void add_scaled_rows(torch::Tensor& y, const torch::Tensor& rows, const torch::Tensor& d, float s, int64_t start) {
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.stride(1) == 1 && d.is_contiguous(), "LoRA: y must be bfloat16 rows");
  const int64_t n = d.size(0), width = d.size(1);
  for (int64_t i = 0; i < n; ++i) {
    bf16* yr = y.data_ptr<bf16>() + rows.data_ptr<int64_t>()[i] * y.stride(0) + start;
    const bf16* dr = d.data_ptr<bf16>() + i * width;
    int64_t c = 0;
    for (; c + 16 <= width; c += 16)
      round_to<bf16>(Vec16::load(yr + c) + round_to<bf16>(Vec16::load(dr + c) * Vec16::fill(s))).store(yr + c);
    for (; c < width; ++c) yr[c] = bf16(float(yr[c]) + float(bf16(float(dr[c]) * s)));
  }
}

// The step's rows of every slot that updates this projection, gathered once, slot after slot; each
// slot's run shrunk, each part expanded, scaled and added: Dpbf16SlotWeights.add_to's values.
void LoraSlots::add(torch::Tensor& y, const torch::Tensor& x, const LoraGroups& groups) const {
  std::vector<torch::Tensor> rows;
  std::vector<int64_t> slots;
  for (const auto& [slot, r] : groups)
    if (a[slot].defined() && a[slot].numel()) rows.push_back(r), slots.push_back(slot);
  if (rows.empty()) return;
  auto xs = x.index_select(0, rows.size() == 1 ? rows[0] : torch::cat(rows));
  std::vector<int64_t> starts{0};                                     // each slot's first row in xs
  for (const auto& r : rows) starts.push_back(starts.back() + r.size(0));
  auto run = [&](int64_t i) {        // slot i's rows; the rows of two slots never meet, so any order is one
    const int64_t s = slots[i], r = rank[s];
    auto shrunk = linear_bf16(xs.narrow(0, starts[i], rows[i].size(0)), a[s], torch::Tensor(), r * parts[s].size());
    for (size_t p = 0; p < parts[s].size(); ++p) {
      const auto& [b, start, width] = parts[s][p];
      add_scaled_rows(y, rows[i], linear_bf16(shrunk.narrow(1, p * r, r), b, {}, width), float(scaling[s]), start);
    }
  };
  // A few rows a slot (decode): the slots side by side on the threads, each product on one, since a
  // product this small costs less than waking the threads for it; else each product on every thread.
  const int64_t n = slots.size();
  if (n > 1 && xs.size(0) <= 64 * n)
    return at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) { for (int64_t i = b; i < e; ++i) run(i); });
  c10::ParallelGuard one_thread(xs.size(0) <= 64 * n);     // one slot's few rows: its products on this thread
  for (int64_t i = 0; i < n; ++i) run(i);
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
    const bool experts = layer.moe && !layer.moe.is_none();
    mlp = experts ? call_python(layer.moe, h) : layer.down(layer.gate_up.silu_mul(h, loras), loras);
  }
  return mlp.defined() ? x.add_(mlp) : x;
}

