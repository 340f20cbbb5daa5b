// nanopaged's CPU kernels: the small ops of a decoder layer fused into one pass each, and paged
// attention. Built on first use by nanopaged/cpu/build.py, all these files into one module; every
// op has a torch reference beside it (the model's own modules) and tests/cpu/test_cpu_ops.py
// holds it to that.
//
// Why C++: on a CPU a decode step of a small model launches ~1,600 torch ops (a norm is eight:
// float, pow, mean, add, rsqrt, mul, to, mul), each a few microseconds of dispatch for a few
// microseconds of work. One pass over the data per op, as vLLM's csrc/cpu kernels do, removes
// both the launches and the intermediate tensors (docs/05_model_runner_and_kernels.md).
//
// This header declares what each file offers the others (the layer loop calls them all) and the
// bindings. The files: what the kernels share, then the kernels in the order a layer runs them:
//   vec16.h              Vec16, exp, rounding to the model's dtype, the threads' grain
//   row_kernels.h        one row of RMSNorm, one row of SiLU(gate) * up, inline where they are used
//   kv_layout.h          the order of K and V inside a block
//   norms.cpp            rms_norm, add_rms_norm
//   rotary_kv.cpp        store_kv, rotary_and_store
//   attention_jobs.h     a step's attention cut into jobs: rows that share blocks read them once
//   attention.cpp        paged_attention
//   linear_bf16.cpp      pack_bf16_weight, linear_bf16, linear_bf16_silu_mul (AVX512-BF16)
//   quantized_rows.h     rows quantized to 8 bits per block (or per token), for the integer kernels
//   linear_amx.cpp       pack_amx_weight, linear_amx (AMX-BF16 tiles); pack_amx_int8, linear_amx_int8 (W8A8)
//   linear_quantized.cpp pack_quantized, linear_quantized (4- and 8-bit weights)
//   activations.cpp      silu_and_mul
//   argmax.cpp           argmax_rows (the sampler's)
//   recurrent.cpp        gated_delta_step, ssd_step, conv_step: a hybrid's linear layers, a decode token in place
//   moe.cpp              Experts: a mixture of experts' MLP, its experts grouped per step
//   decoder.h, .cpp      the decoder layers, one after another, in one call
//   bindings.cpp         the Python module
#pragma once

// torch/types.h (tensors, their factories, TORCH_CHECK), not torch/extension.h: every file is
// compiled on its own and would parse torch's whole C++ API and pybind11 again; only the files
// that meet Python (decoder.h, bindings.cpp) include those.
#include <torch/types.h>
#include <utility>
#include <vector>

// norms.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps);

// rotary_kv.cpp
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
void rotary_and_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_norm,
                      torch::Tensor k_norm, double eps, int64_t heads, int64_t kv_heads, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slot_mapping);

// attention.cpp
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, bool share_prefixes);
using RowGroups = std::vector<std::pair<std::vector<int64_t>, int64_t>>;     // (rows, blocks they share)
RowGroups shared_prefix_groups(torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                               int64_t block_size, int64_t threads);

// linear_bf16.cpp (without AVX512-BF16, each raises)
torch::Tensor pack_bf16_weight(torch::Tensor w);
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N);
torch::Tensor linear_bf16_silu_mul(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t I);

// linear_amx.cpp (without AMX-BF16 or AMX-INT8, the kernels that need it raise)
torch::Tensor pack_amx_weight(torch::Tensor w);
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N);
torch::Tensor pack_amx_int8(torch::Tensor codes, torch::Tensor scale);
torch::Tensor linear_amx_int8(torch::Tensor x, torch::Tensor packed, int64_t N);

// linear_quantized.cpp
torch::Tensor pack_quantized(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t G, int64_t bits);
torch::Tensor linear_quantized(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t G, int64_t bits);

// activations.cpp
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// argmax.cpp
torch::Tensor argmax_rows(torch::Tensor x);

// recurrent.cpp
torch::Tensor gated_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                               torch::Tensor beta, torch::Tensor state, torch::Tensor index, torch::Tensor fresh);
torch::Tensor ssd_step(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
                       torch::Tensor D, torch::Tensor state, torch::Tensor index, torch::Tensor fresh);
torch::Tensor conv_step(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor state,
                        torch::Tensor index, torch::Tensor fresh);
