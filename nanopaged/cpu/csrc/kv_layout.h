// The order of K and V inside a block of the pool, which the kernels that write the cache
// (rotary_kv.cpp) and the one that reads it (attention.cpp) must agree on: one definition, here.
#pragma once

#include <torch/types.h>

// The runner allocates each layer's K and V as (blocks, block_size, kv_heads, head_dim): the paper's
// blocks, in the order the torch reference gathers them. Inside each block these kernels keep
// their own order, so that what one instruction multiplies is 64 contiguous bytes:
//   K: (kv_heads, head_dim / 2, block_size, 2)  for a pair of dims, every token's two values
//   V: (kv_heads, block_size / 2, head_dim, 2)  for a pair of tokens, every dim's two values
// (vLLM's CUDA and CPU kernels keep K as (head_dim / x, block_size, x) for the same reason.) A
// block is still one block of the pool: copy-on-write copies and prefix-cache hits move whole
// blocks, whatever is inside. store_kv writes it, and the `cpu` attention backend and the fused
// layers read and write nothing else (block_size must be even: V pairs tokens).
struct KvLayout {
  int64_t block_size, kv_heads, D;
  int64_t block() const { return block_size * kv_heads * D; }                 // elements per block
  int64_t k(int64_t block_id, int64_t t, int64_t h, int64_t d) const {        // token t of the block
    return block_id * block() + h * D * block_size + (d / 2) * 2 * block_size + 2 * t + (d & 1);
  }
  int64_t v(int64_t block_id, int64_t t, int64_t h, int64_t d) const {
    return block_id * block() + h * D * block_size + (t / 2) * 2 * D + 2 * d + (t & 1);
  }
};

static inline KvLayout kv_layout(const torch::Tensor& cache) {      // cache: (blocks, block_size, kv_heads, head_dim)
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(1) % 2 == 0,
              "the cpu kernels' KV cache: a contiguous (blocks, block_size, kv_heads, head_dim) tensor, "
              "block_size even");
  return {cache.size(1), cache.size(2), cache.size(3)};
}
