// The order of K and V inside a block of the pool, and what one entry of it is, which the kernels
// that write the cache (rotary_kv.cpp) and the one that reads it (attention.cpp) must agree on: one
// definition, here.
#pragma once

#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

// The runner allocates each layer's K and V as (blocks, block_size, kv_heads, head_dim): the paper's
// blocks, in the order the torch reference gathers them. Inside each block these kernels keep
// their own order, so that what one instruction multiplies is one contiguous run (64 bytes; 32 of 8-bit entries):
//   K: (kv_heads, head_dim / 2, block_size, 2)  for a pair of dims, every token's two values
//   V: (kv_heads, block_size / 2, head_dim, 2)  for a pair of tokens, every dim's two values
// (vLLM's CUDA and CPU kernels keep K as (head_dim / x, block_size, x) for the same reason.) An int8
// cache's rows are 4 bytes longer, (..., head_dim + 4): each token's head carries its float32 scale,
// kept after the head's codes, (kv_heads, [codes as above], block_size scales). A block is still one
// block of the pool: copy-on-write copies and prefix-cache hits move whole blocks, whatever is inside,
// scales included. store_kv writes it, and the `cpu` attention backend and the fused layers read and
// write nothing else (block_size must be even: V pairs tokens).
struct KvLayout {
  int64_t block_size, kv_heads, D, row;                                       // row: D, or D + 4 with int8's scale
  int64_t block() const { return block_size * kv_heads * row; }               // entries per block
  int64_t k(int64_t block_id, int64_t t, int64_t h, int64_t d) const {        // token t of the block
    return block_id * block() + h * row * block_size + (d / 2) * 2 * block_size + 2 * t + (d & 1);
  }
  int64_t v(int64_t block_id, int64_t t, int64_t h, int64_t d) const {
    return block_id * block() + h * row * block_size + (t / 2) * 2 * D + 2 * d + (t & 1);
  }
  int64_t scale(int64_t block_id, int64_t t, int64_t h) const {               // int8: the byte where t's scale starts
    return block_id * block() + h * row * block_size + D * block_size + 4 * t;
  }
};

static inline KvLayout kv_layout(const torch::Tensor& cache) {      // cache: (blocks, block_size, kv_heads, head_dim)
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(1) % 2 == 0,
              "the cpu kernels' KV cache: a contiguous (blocks, block_size, kv_heads, head_dim) tensor, "
              "block_size even");
  const int64_t scale_bytes = cache.scalar_type() == at::kChar ? 4 : 0;
  return {cache.size(1), cache.size(2), cache.size(3) - scale_bytes, cache.size(3)};
}

// ---- one entry of the cache -----------------------------------------------------------------
// The model's dtype T (kv_cache_dtype "auto"); one byte, vLLM's "fp8" = fp8_e4m3 or "fp8_e5m2" (c10's
// Float8_e4m3fn, Float8_e5m2), with k_scale = v_scale = 1, so the byte is the value itself; or "int8",
// a code of each token's head times that row's scale. Stored as the torch reference stores it
// (attention/torch_backend.py: to_cache_dtype): fp8 saturated past the format's largest finite value,
// as vLLM's kernels do, else rounded to nearest even; int8 as round(x / s), s = the row's absmax / 127.

// The scale of one head's row of D values: int8's; the other entries have none (1).
template <typename C, typename T>
static inline float row_scale(const T* x, int64_t D) {
  if constexpr (!std::is_same_v<C, int8_t>) {
    return 1.f;
  } else {
    float most = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float a = std::abs(float(x[d]));
      if (std::isnan(a)) return a;        // as torch's amax: a NaN makes the row's scale NaN (std::max would skip it)
      most = std::max(most, a);
    }
    return most / 127.f;
  }
}

template <typename C, typename T>
static inline C to_cache(T x, float scale) {
  if constexpr (std::is_same_v<C, T>) {
    return x;
  } else if constexpr (std::is_same_v<C, int8_t>) {
    const float q = scale > 0.f ? std::nearbyint(float(x) / scale) : 0.f;    // scale NaN: 0, as the reference
    return int8_t(std::isnan(q) ? 0.f : q);      // inf / inf: 0, as the reference (a NaN cast is undefined)
  } else {
    const float most = float(std::numeric_limits<C>::max());
    return C(std::clamp(float(x), -most, most));
  }
}

// int8: the scale that token t's row of KV head h carries (memcpy: the bytes need not be aligned)
static inline float stored_scale(const int8_t* cache, const KvLayout& L, int64_t block_id, int64_t t, int64_t h) {
  float s;
  std::memcpy(&s, cache + L.scale(block_id, t, h), sizeof(s));
  return s;
}

// f(C{}) for the cache's entry type C: the model's T, or an 8-bit format; a cache of any other dtype
// is refused.
template <typename T, typename F>
static inline void dispatch_cache_entry(const torch::Tensor& cache, F&& f) {
  const auto dtype = cache.scalar_type();
  if (dtype == c10::CppTypeToScalarType<T>::value) f(T{});
  else if (dtype == at::kFloat8_e4m3fn) f(c10::Float8_e4m3fn{});
  else if (dtype == at::kFloat8_e5m2) f(c10::Float8_e5m2{});
  else if (dtype == at::kChar) f(int8_t{});
  else TORCH_CHECK(false, "the KV cache must hold the model's dtype (", c10::CppTypeToScalarType<T>::value,
                   "), float8 (Float8_e4m3fn, Float8_e5m2) or int8 codes with their scales, got ", dtype);
}
