"""The `cpu` attention backend: decode rows attend straight from the paged cache, in C++.

The torch reference gathers each decode row's blocks into a padded copy before it can call
`scaled_dot_product_attention`: per layer it writes the K/V it reads, reads the copy again, and
pads every row to the longest. At long contexts that copying is most of a decode step (a step
of 84 rows over contexts up to 1,024 tokens spent ~250 ms there, the weights ~20 ms). This
backend reads K/V once, through the block table, as the paper's kernel does (section 4.1):
one small C++ function, compiled on first use with torch's extension builder and cached, runs
every (request, KV head) pair in parallel over torch's threads: scores of the head's query
group against each key, a softmax, then the values. Prefill chunks, store and everything else
are the torch reference's (torch_backend.py), and tests/attention/test_cpu_backend.py holds the
kernel to it. Without a C++ compiler, `resolve_attention_backend` says so and the torch
backend runs. docs/05_model_runner_and_kernels.md, "Backends".
"""
from __future__ import annotations

import logging
from functools import lru_cache

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_backend import TorchAttentionBackend, _attend, gather_kv, store_kvcache
from nanopaged.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

// A row of n values as floats: bfloat16 is the top half of a float32.
static inline void load(const float* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d];
}
static inline void load(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t d = 0; d < n; ++d) { uint32_t b = uint32_t(bits[d]) << 16; std::memcpy(dst + d, &b, 4); }
}
static inline void load(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = float(src[d]);
}

// Attention of one (request, KV head) pair: its `group` query heads over its n keys, which the
// block table scatters over the pool. Two passes: scores against every key, then the values.
// DIM: head_dim known when compiled (64, 128, 256: the loops vectorize), or 0: `dim` at run time.
template <typename T, int DIM>
static void one_head(const T* q, int64_t q_head, const T* kc, const T* vc, const int64_t* table, int64_t n,
                     int64_t block_size, int64_t c_block, int64_t c_token, int64_t offset, int64_t group, float scale,
                     T* out, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc, int64_t dim) {
  const int64_t D = DIM > 0 ? DIM : dim;
  alignas(64) float row[DIM > 0 ? DIM : 512];
  for (int64_t g = 0; g < group; ++g) {
    load(q + g * q_head, qf.data() + g * D, D);
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
  }
  scores.resize(group * n);
  for (int64_t t = 0; t < n; ++t) {
    load(kc + table[t / block_size] * c_block + (t % block_size) * c_token + offset, row, D);
    for (int64_t g = 0; g < group; ++g) {
      const float* __restrict qg = qf.data() + g * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
      scores[g * n + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict sg = scores.data() + g * n;
    float m = sg[0], sum = 0.f;
    for (int64_t t = 1; t < n; ++t) m = std::max(m, sg[t]);
    for (int64_t t = 0; t < n; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) sg[t] *= inv;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    load(vc + table[t / block_size] * c_block + (t % block_size) * c_token + offset, row, D);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + t];
      float* __restrict ag = acc.data() + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = T(acc[g * D + d]);
}

template <typename T, int DIM>
static void attend(const T* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, T* out,
                   int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks,
                   int64_t q_row, int64_t q_head, int64_t c_block, int64_t c_token, int64_t c_head, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(group * dim), acc(group * dim);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / kv_heads, h = job % kv_heads;
      one_head<T, DIM>(q + r * q_row + h * group * q_head, q_head, kc, vc, tables + r * max_blocks, lens[r],
                       block_size, c_block, c_token, h * c_head, group, scale, out + (r * heads + h * group) * dim,
                       scores, qf, acc, dim);
    }
  });
}

// q (rows, heads, dim), caches (blocks, block_size, kv_heads, dim) with unit stride in dim,
// block_tables (rows, max_blocks) and seq_lens (rows,) int64: out (rows, heads, dim).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "unit stride in head_dim");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "K and V caches of one layout");
  const int64_t dim = q.size(2);
  TORCH_CHECK(dim <= 512, "head_dim at most 512, got ", dim);
  auto tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), dim}, q.options());
  auto run = [&](auto value_tag, auto dim_tag) {
    using T = typename decltype(value_tag)::type;
    constexpr int DIM = decltype(dim_tag)::value;
    attend<T, DIM>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables.data_ptr<int64_t>(),
                   lens.data_ptr<int64_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(2), dim,
                   k_cache.size(1), tables.size(1), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                   k_cache.stride(2), float(scale));
  };
  auto by_dim = [&](auto value_tag) {
    if (dim == 64) run(value_tag, std::integral_constant<int, 64>{});
    else if (dim == 128) run(value_tag, std::integral_constant<int, 128>{});
    else if (dim == 256) run(value_tag, std::integral_constant<int, 256>{});
    else run(value_tag, std::integral_constant<int, 0>{});
  };
  switch (q.scalar_type()) {
    case at::kFloat: by_dim(std::type_identity<float>{}); break;
    case at::kBFloat16: by_dim(std::type_identity<c10::BFloat16>{}); break;
    case at::kHalf: by_dim(std::type_identity<c10::Half>{}); break;
    default: TORCH_CHECK(false, "float32, bfloat16 or float16, got ", q.scalar_type());
  }
  return out;
}
"""


@lru_cache(maxsize=1)
def kernel():
    """The compiled extension (torch caches the build under ~/.cache/torch_extensions: once a machine)."""
    from torch.utils.cpp_extension import load_inline
    # reassociating float sums lets the compiler vectorize the dot products; the instruction sets
    # are the CPU's own, named from its flags (-march=native has built code a VM could not run)
    flags = ["-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
    flags += [f"-m{f}" for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl") if f in cpu_flags()]
    return load_inline("nanopaged_cpu_attention", cpp_sources=SOURCE, functions=["paged_decode_attention"],
                       extra_cflags=flags, verbose=False)


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch reference, with its decode rows attended by the C++ kernel (no gather, no padding)."""
    name = "cpu"

    def __init__(self) -> None:
        self.op = kernel().paged_decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        if max(meta.query_lens_list) == 1:               # a decode-only step: every row at once
            return self.op(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out, start = torch.empty_like(q), 0
        decode_rows, decode_reqs = [], []
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            rows = slice(start, start + q_len)
            if q_len == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
            elif seq_len == q_len:
                out[rows] = _attend(q[rows], k[rows], v[rows], 0, scale)
            else:
                kk, vv = gather_kv(k_cache, meta.block_tables[i], seq_len), gather_kv(v_cache, meta.block_tables[i], seq_len)
                out[rows] = _attend(q[rows], kk, vv, seq_len - q_len, scale)
            start += q_len
        if decode_rows:
            idx = torch.tensor(decode_reqs, device=q.device)
            rows = torch.tensor(decode_rows, device=q.device)
            out[rows] = self.op(q[rows], k_cache, v_cache, meta.block_tables[idx], meta.seq_lens[idx], scale)
        return out
