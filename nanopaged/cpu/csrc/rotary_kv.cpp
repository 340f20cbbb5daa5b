// Where the step's new tokens enter the cache: rotary embedding on q and k, then each token's K
// and V into its slot of the pool, in the kernels' order inside a block (kv_layout.h). store_kv is
// the store alone (the `cpu` attention backend's, beside the reference's projections);
// rotary_and_store is the fused layers' pass over the q/k/v projection's output. The cache holds
// the model's dtype or 8-bit entries (kv_layout.h: to_cache).
#include "ops.h"
#include "kv_layout.h"
#include "row_kernels.h"

// One token's K and V heads (kv_heads x D each) into slot s.
template <typename C, typename T>
static inline void store_token(const KvLayout& L, C* kc, C* vc, int64_t s, const T* k, const T* v, int64_t k_head,
                               int64_t v_head) {
  const int64_t block_id = s / L.block_size, t = s % L.block_size;
  for (int64_t h = 0; h < L.kv_heads; ++h) {
    const float k_scale = row_scale<C>(k + h * k_head, L.D), v_scale = row_scale<C>(v + h * v_head, L.D);
    for (int64_t d = 0; d < L.D; ++d) {
      kc[L.k(block_id, t, h, d)] = to_cache<C>(k[h * k_head + d], k_scale);
      vc[L.v(block_id, t, h, d)] = to_cache<C>(v[h * v_head + d], v_scale);
    }
    if constexpr (std::is_same_v<C, int8_t>) {      // the row's scale, after the head's codes
      std::memcpy(kc + L.scale(block_id, t, h), &k_scale, sizeof(k_scale));
      std::memcpy(vc + L.scale(block_id, t, h), &v_scale, sizeof(v_scale));
    }
  }
}

// k, v (tokens, kv_heads, head_dim) with unit stride in head_dim: each token's K and V into its slot.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  const KvLayout L = kv_layout(k_cache);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(), "store_kv: K and V caches of one shape");
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.size(1) == L.kv_heads && k.size(2) == L.D &&
              v.sizes() == k.sizes() && slots.scalar_type() == at::kLong && slots.numel() == k.size(0),
              "store_kv: k and v (tokens, kv_heads, head_dim) matching the caches, int64 slots (tokens,)");
  auto sl = slots.contiguous();
  DISPATCH_MODEL_DTYPES(k.scalar_type(), "store_kv", [&] {
    dispatch_cache_entry<scalar_t>(k_cache, [&](auto entry) {
      using C = decltype(entry);
      const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
      C *kc = k_cache.data_ptr<C>(), *vc = v_cache.data_ptr<C>();
      const int64_t* sp = sl.data_ptr<int64_t>();
      for (int64_t t = 0; t < k.size(0); ++t)
        store_token(L, kc, vc, sp[t], kp + t * k.stride(0), vp + t * v.stride(0), k.stride(1), v.stride(1));
    });
  });
}

// ---- rotary embedding, and the K/V store ------------------------------------------------------
// One head of D values rotated in place: x * cos + rotate_half(x) * sin, Hugging Face's
// rotate_half (the first half of a head pairs with the second, negated), each product and the
// sum rounded to T as the reference's three bfloat16 ops round them.
template <typename T>
static inline void rotate_head(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  if (half % 16 == 0) {                 // 16 pairs (i, i + half) at a time
    for (int64_t i = 0; i < half; i += 16) {
      const Vec16 a = Vec16::load(x + i), b = Vec16::load(x + half + i);
      const Vec16 first = round_to<T>(a * Vec16::load(cos + i)) - round_to<T>(b * Vec16::load(sin + i));
      const Vec16 second = round_to<T>(b * Vec16::load(cos + half + i)) + round_to<T>(a * Vec16::load(sin + half + i));
      round_to<T>(first).store(x + i);
      round_to<T>(second).store(x + half + i);
    }
    return;
  }
  float tmp[1024];
  for (int64_t i = 0; i < D; ++i) tmp[i] = float(x[i]);
  for (int64_t i = 0; i < D; ++i) {
    const float rot = i < half ? -tmp[i + half] : tmp[i - half];
    x[i] = T(float(T(tmp[i] * float(cos[i]))) + float(T(rot * float(sin[i]))));
  }
}

// One step's attention inputs, from the fused q/k/v projection's output:
//   qkv (n, (heads + 2 kv_heads) D): q's heads, then k's, then v's, per row (any row stride)
//   cos, sin (n, D): the rows' rotary tables, in qkv's dtype
//   q_norm, k_norm (D,) or empty: Qwen3's RMSNorm over each q and k head, before the rotation;
//                  (heads D,) and (kv_heads D,): OLMoE's, over the whole q and the whole k
// q's and k's heads are rotated in place; k and v are written to their slots of the pool,
// k_cache and v_cache (blocks, block_size, kv_heads, D) in the kernels' order (kv_layout.h): slot s is
// block s / block_size, token s % block_size (the paper's section 4.1; vLLM's reshape_and_cache).
// Afterwards q, k and v are the views of qkv the attention reads.
// A row's values cost more here than a norm's: each token's K and V are stored into ~100 lines
// scattered over its block, mostly not in cache. Counted 8 times, a 24-row decode step's rows are
// shared by two threads, whose misses then overlap.
static constexpr int64_t kRotaryCostPerValue = 8;

void rotary_and_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_norm,
                      torch::Tensor k_norm, double eps, int64_t heads, int64_t kv_heads, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slot_mapping) {
  const KvLayout L = kv_layout(k_cache);
  const int64_t n = qkv.size(0), D = L.D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * D,
              "rotary_and_store: qkv must be (tokens, (heads + 2 kv_heads) head_dim) with unit stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * D && sin.numel() == n * D,
              "rotary_and_store: cos and sin must be contiguous (tokens, head_dim)");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && k_cache.size(2) == kv_heads,
              "rotary_and_store: caches must be (blocks, block_size, kv_heads, head_dim), one shape");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == n, "slot_mapping: int64 (tokens,)");
  TORCH_CHECK(D % 2 == 0 && D <= 1024, "head_dim must be even and at most 1024");
  const bool norm = q_norm.defined() && q_norm.numel() > 0;
  const bool whole = norm && q_norm.numel() == heads * D && heads > 1;
  TORCH_CHECK(!norm || (q_norm.numel() == D && k_norm.numel() == D) || (whole && k_norm.numel() == kv_heads * D),
              "q_norm and k_norm must be (head_dim,), or (heads x head_dim,) and (kv_heads x head_dim,)");
  auto slots = slot_mapping.contiguous();
  const int64_t row = qkv.stride(0);
  DISPATCH_MODEL_DTYPES(qkv.scalar_type(), "rotary_and_store", [&] {
    using T = scalar_t;
    dispatch_cache_entry<T>(k_cache, [&](auto entry) {
      using C = decltype(entry);
      T* base = qkv.data_ptr<T>();
      const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
      const T* qn = norm ? q_norm.data_ptr<T>() : nullptr;
      const T* kn = norm ? k_norm.data_ptr<T>() : nullptr;
      C *kc = k_cache.data_ptr<C>(), *vc = v_cache.data_ptr<C>();
      const int64_t* sl = slots.data_ptr<int64_t>();
      at::parallel_for(0, n, grain(kRotaryCostPerValue * (heads + 2 * kv_heads) * D), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          T* x = base + t * row;
          if (whole) {
            rms_norm_row(x, qn, x, heads * D, float(eps));
            rms_norm_row(x + heads * D, kn, x + heads * D, kv_heads * D, float(eps));
          }
          for (int64_t h = 0; h < heads + kv_heads; ++h) {   // q's heads, then k's
            T* head = x + h * D;
            if (norm && !whole) rms_norm_row(head, h < heads ? qn : kn, head, D, float(eps));
            rotate_head(head, cp + t * D, sp + t * D, D);
          }
          store_token(L, kc, vc, sl[t], x + heads * D, x + (heads + kv_heads) * D, D, D);
        }
      });
    });
  });
}
