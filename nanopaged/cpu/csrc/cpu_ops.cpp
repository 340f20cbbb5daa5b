// nanopaged's CPU kernels: the small ops of a decoder layer fused into one pass each, and paged
// attention. Built on first use by nanopaged/cpu/build.py; every op has a torch
// reference beside it (the model's own modules) and tests/cpu/test_cpu_ops.py holds it to that.
//
// Why C++: on a CPU a decode step of a small model launches ~1,600 torch ops (a norm is eight:
// float, pow, mean, add, rsqrt, mul, to, mul), each a few microseconds of dispatch for a few
// microseconds of work. One pass over the data per op, as vLLM's csrc/cpu kernels do, removes
// both the launches and the intermediate tensors (docs/05_model_runner_and_kernels.md).
//
// Rounding: T is the model's dtype. Where the torch reference rounds an intermediate to T (a
// bfloat16 tensor between two ops), the kernel rounds it too (`round_to<T>`: round to nearest
// even, as torch does), so a norm, a rotation or a SiLU here gives the reference's values up to
// the order of a float32 sum and the last bit of an exp.
#include <torch/extension.h>
#include <pybind11/stl.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#define NP_HAS_AVX512_BF16 1
#else
#define NP_HAS_AVX512_BF16 0
#endif

// Put on a loop over a small array of registers (sums, operands) whose length is a template
// constant: unrolled this early, the array lives in registers. GCC otherwise unrolls it after it
// has decided the array lives in memory, and stores every sum back at every step of the loop.
#define NP_UNROLL _Pragma("GCC unroll 64")

// How many elements a thread should get before a loop is split over threads: below that the
// fork/join costs more than the work (a 24-row decode step's norm is 14k elements).
static constexpr int64_t kGrainElements = 32768;

static int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_row)); }

#define DISPATCH_MODEL_DTYPES(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ---- 16 floats at a time ----------------------------------------------------------------------
// Every kernel below is written once on Vec16: AVX-512 registers where the CPU has them, else
// an array of 16 floats whose loops the compiler turns into AVX2 (two 8-wide halves). Loads and
// stores convert from and to the model's dtype T; `round_to<T>` rounds a float to T's precision
// and keeps it a float (what a bfloat16 tensor between two torch ops holds).
using bf16 = c10::BFloat16;
using fp16 = c10::Half;

#if defined(__AVX512F__)
struct Vec16 {
  __m512 v;
  static Vec16 fill(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const bf16* p) {         // a bfloat16 is the top half of a float32
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static Vec16 load(const fp16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(bf16* p) const {                // v already holds bfloat16 values: keep the top halves
    const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), top);
  }
  void store(fp16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float max() const { return _mm512_reduce_max_ps(v); }
  Vec16 operator+(Vec16 o) const { return {_mm512_add_ps(v, o.v)}; }
  Vec16 operator-(Vec16 o) const { return {_mm512_sub_ps(v, o.v)}; }
  Vec16 operator*(Vec16 o) const { return {_mm512_mul_ps(v, o.v)}; }
  Vec16 operator/(Vec16 o) const { return {_mm512_div_ps(v, o.v)}; }
  friend Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend Vec16 min(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend Vec16 round_nearest(Vec16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT)}; }
  friend Vec16 times_pow2(Vec16 a, Vec16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }   // a * 2^n
};
template <typename T> static inline Vec16 round_to(Vec16 x);
template <> inline Vec16 round_to<float>(Vec16 x) { return x; }
template <> inline Vec16 round_to<bf16>(Vec16 x) {     // nearest even on the dropped 16 bits, as torch rounds
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  return {_mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))))};
}
template <> inline Vec16 round_to<fp16>(Vec16 x) { return {_mm512_cvtph_ps(_mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT))}; }
#else
struct Vec16 {
  float v[16];
  static Vec16 fill(float x) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
  template <typename T> static Vec16 load(const T* p) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = float(p[i]); return r; }
  template <typename T> void store(T* p) const { for (int i = 0; i < 16; ++i) p[i] = T(v[i]); }
  float sum() const { float s = 0.f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }
  float max() const { float m = v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, v[i]); return m; }
#define NP_VEC_OP(op) Vec16 operator op(Vec16 o) const { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = v[i] op o.v[i]; return r; }
  NP_VEC_OP(+) NP_VEC_OP(-) NP_VEC_OP(*) NP_VEC_OP(/)
#undef NP_VEC_OP
  friend Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
  friend Vec16 max(Vec16 a, Vec16 b) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::max(a.v[i], b.v[i]); return r; }
  friend Vec16 min(Vec16 a, Vec16 b) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::min(a.v[i], b.v[i]); return r; }
  friend Vec16 round_nearest(Vec16 a) { Vec16 r; for (int i = 0; i < 16; ++i) r.v[i] = std::nearbyint(a.v[i]); return r; }
  friend Vec16 times_pow2(Vec16 a, Vec16 n) {
    Vec16 r;
    for (int i = 0; i < 16; ++i) r.v[i] = std::ldexp(a.v[i], int(n.v[i]));
    return r;
  }
};
template <typename T> static inline Vec16 round_to(Vec16 x) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(T(x.v[i]));
  return r;
}
#endif

// e^x to about one unit in the last place: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes'
// polynomial, then times 2^n. Inputs below -87 give ~0, as a softmax or a SiLU needs.
static inline Vec16 exp(Vec16 x) {
  x = min(max(x, Vec16::fill(-87.3f)), Vec16::fill(88.3f));
  const Vec16 n = round_nearest(x * Vec16::fill(1.44269504088896341f));
  Vec16 r = fma(n, Vec16::fill(-0.693359375f), x);
  r = fma(n, Vec16::fill(2.12194440e-4f), r);
  Vec16 p = Vec16::fill(1.9875691500e-4f);
  p = fma(p, r, Vec16::fill(1.3981999507e-3f));
  p = fma(p, r, Vec16::fill(8.3334519073e-3f));
  p = fma(p, r, Vec16::fill(4.1665795894e-2f));
  p = fma(p, r, Vec16::fill(1.6666665459e-1f));
  p = fma(p, r, Vec16::fill(5.0000001201e-1f));
  p = fma(p * r, r, r + Vec16::fill(1.f));
  return times_pow2(p, n);
}

static inline float exp_scalar(float x) {       // the same e^x for a loop's tail
  float lanes[16] = {x};
  exp(Vec16::load(lanes)).store(lanes);
  return lanes[0];
}

// ---- RMSNorm --------------------------------------------------------------------------------
// Hugging Face's LlamaRMSNorm in dtype T: x in float32, times rsqrt(mean(x^2) + eps), rounded to
// T, then times the weight (a T product, rounded again). One row of `d` values; out may be x.
template <typename T>
static inline void rms_norm_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  const int64_t body = d - d % 16;
  Vec16 acc = Vec16::fill(0.f);
  for (int64_t i = 0; i < body; i += 16) { const Vec16 v = Vec16::load(x + i); acc = fma(v, v, acc); }
  float sum = acc.sum();
  for (int64_t i = body; i < d; ++i) sum += float(x[i]) * float(x[i]);
  const float inv = 1.f / std::sqrt(sum / float(d) + eps);
  const Vec16 scale = Vec16::fill(inv);
  for (int64_t i = 0; i < body; i += 16)
    round_to<T>(Vec16::load(w + i) * round_to<T>(Vec16::load(x + i) * scale)).store(out + i);
  for (int64_t i = body; i < d; ++i) out[i] = T(float(w[i]) * float(T(float(x[i]) * inv)));
}

// x (rows, d) with unit stride in d: a new (rows, d) tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (rows, d) with unit stride in d");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be (d,) contiguous, in x's dtype");
  const int64_t rows = x.size(0), d = x.size(1), row = x.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * row, wp, op + r * d, d, float(eps));
    });
  });
  return out;
}

// The residual add and the norm after it, in one pass: x = x + y rounded to T in place (the
// residual stream, rounded as the reference's add rounds it: a sum kept in float32 instead shifts
// greedy tokens at near ties), then a new tensor with RMSNorm(x). vLLM's fused_add_rms_norm.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 && x.sizes() == y.sizes(),
              "add_rms_norm: x must be contiguous (rows, d) and y (rows, d) with unit stride in d");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "add_rms_norm: x and y in one dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be (d,) contiguous, in x's dtype");
  const int64_t rows = x.size(0), d = x.size(1), y_row = y.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "add_rms_norm", [&] {
    using T = scalar_t;
    T* xp = x.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t body = d - d % 16;
    at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * d;
        const T* yr = yp + r * y_row;
        for (int64_t i = 0; i < body; i += 16) round_to<T>(Vec16::load(xr + i) + Vec16::load(yr + i)).store(xr + i);
        for (int64_t i = body; i < d; ++i) xr[i] = T(float(xr[i]) + float(yr[i]));
        rms_norm_row(xr, wp, op + r * d, d, float(eps));
      }
    });
  });
  return out;
}

// ---- the KV cache in this file's order ----------------------------------------------------------
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

static KvLayout kv_layout(const torch::Tensor& cache) {      // cache: (blocks, block_size, kv_heads, head_dim)
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.size(1) % 2 == 0,
              "the cpu kernels' KV cache: a contiguous (blocks, block_size, kv_heads, head_dim) tensor, "
              "block_size even");
  return {cache.size(1), cache.size(2), cache.size(3)};
}

// One token's K and V heads (kv_heads x D each) into slot s.
template <typename T>
static inline void store_token(const KvLayout& L, T* kc, T* vc, int64_t s, const T* k, const T* v, int64_t k_head,
                               int64_t v_head) {
  const int64_t block_id = s / L.block_size, t = s % L.block_size;
  for (int64_t h = 0; h < L.kv_heads; ++h)
    for (int64_t d = 0; d < L.D; ++d) {
      kc[L.k(block_id, t, h, d)] = k[h * k_head + d];
      vc[L.v(block_id, t, h, d)] = v[h * v_head + d];
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
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    scalar_t *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    const int64_t* sp = sl.data_ptr<int64_t>();
    for (int64_t t = 0; t < k.size(0); ++t)
      store_token(L, kc, vc, sp[t], kp + t * k.stride(0), vp + t * v.stride(0), k.stride(1), v.stride(1));
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
//   q_norm, k_norm (D,) or empty: Qwen3's RMSNorm over each q and k head, before the rotation
// q's and k's heads are rotated in place; k and v are written to their slots of the pool,
// k_cache and v_cache (blocks, block_size, kv_heads, D) in this file's order (KvLayout): slot s is
// block s / block_size, token s % block_size (the paper's section 4.1; vLLM's reshape_and_cache).
// Afterwards q, k and v are the views of qkv the attention reads.
// A row's values cost more here than a norm's: each token's K and V are stored into ~100 lines
// scattered over its block, mostly not in cache. Counted 8 times, a 24-row decode step's rows are
// shared by two threads, whose misses then overlap.
static constexpr int64_t kRotaryCostPerValue = 8;

void rotary_and_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_norm,
                      torch::Tensor k_norm, double eps, int64_t heads, int64_t kv_heads, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slot_mapping) {
  const int64_t n = qkv.size(0), D = k_cache.size(3), block_size = k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * D,
              "rotary_and_store: qkv must be (tokens, (heads + 2 kv_heads) head_dim) with unit stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * D && sin.numel() == n * D,
              "rotary_and_store: cos and sin must be contiguous (tokens, head_dim)");
  const KvLayout L = kv_layout(k_cache);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && k_cache.size(2) == kv_heads,
              "rotary_and_store: caches must be (blocks, block_size, kv_heads, head_dim), one shape");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == n, "slot_mapping: int64 (tokens,)");
  TORCH_CHECK(D % 2 == 0 && D <= 1024, "head_dim must be even and at most 1024");
  const bool norm = q_norm.defined() && q_norm.numel() > 0;
  TORCH_CHECK(!norm || (q_norm.numel() == D && k_norm.numel() == D), "q_norm and k_norm must be (head_dim,)");
  auto slots = slot_mapping.contiguous();
  const int64_t row = qkv.stride(0);
  DISPATCH_MODEL_DTYPES(qkv.scalar_type(), "rotary_and_store", [&] {
    using T = scalar_t;
    T* base = qkv.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    const T* qn = norm ? q_norm.data_ptr<T>() : nullptr;
    const T* kn = norm ? k_norm.data_ptr<T>() : nullptr;
    T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    at::parallel_for(0, n, grain(kRotaryCostPerValue * (heads + 2 * kv_heads) * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        T* x = base + t * row;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {   // q's heads, then k's
          T* head = x + h * D;
          if (norm) rms_norm_row(head, h < heads ? qn : kn, head, D, float(eps));
          rotate_head(head, cp + t * D, sp + t * D, D);
        }
        store_token(L, kc, vc, sl[t], x + heads * D, x + (heads + kv_heads) * D, D, D);
      }
    });
  });
}

// ---- SiLU(gate) * up ----------------------------------------------------------------------
// gate_up (n, 2 I) -> (n, I): SiLU of the first half times the second, SiLU rounded to T before
// the product as the reference's two ops round it.
template <typename T>
static inline void silu_and_mul_row(const T* g, const T* u, T* o, int64_t I) {
  const int64_t body = I - I % 16;
  const Vec16 one = Vec16::fill(1.f), zero = Vec16::fill(0.f);
  for (int64_t i = 0; i < body; i += 16) {
    const Vec16 x = Vec16::load(g + i);
    const Vec16 silu = round_to<T>(x / (one + exp(zero - x)));
    round_to<T>(silu * Vec16::load(u + i)).store(o + i);
  }
  for (int64_t i = body; i < I; ++i) {
    const float x = float(g[i]);
    o[i] = T(float(T(x / (1.f + exp_scalar(-x)))) * float(u[i]));
  }
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be (rows, 2 I) with unit stride");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, row = gate_up.stride(0);
  auto out = torch::empty({rows, I}, gate_up.options());
  DISPATCH_MODEL_DTYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(I), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_and_mul_row(gp + r * row, gp + r * row + I, op + r * I, I);
    });
  });
  return out;
}

// ---- argmax of each row ----------------------------------------------------------------------
// A greedy step's last op: the index of each row's largest logit, as torch.argmax gives it (the
// first index of the largest value; a NaN counts as larger than any number, and the first NaN
// wins). torch's CPU argmax takes 0.4-0.9 ns an element, 0.5-1 ms for 24 rows of a 49k vocabulary,
// a few percent of a decode step; 16 lanes at a time it is the time to read the logits.
static int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    // each lane keeps its own best (value, index); ties keep the first, a NaN replaces a number
    __m512 best = _mm512_loadu_ps(x);
    __m512i best_i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = best_i;
    const __m512i step = _mm512_set1_epi32(16);
    const __m512 below = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 16; i < n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __mmask16 in = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512 v = _mm512_mask_loadu_ps(below, in, x + i);          // past n: -inf, never taken
      const __mmask16 take = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                             (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q));
      best = _mm512_mask_mov_ps(best, take, v);
      best_i = _mm512_mask_mov_epi32(best_i, take, idx);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, best);
    _mm512_store_si512(ids, best_i);
    int lane = 0;                          // across lanes: the larger value, or on a tie the smaller index
    for (int l = 1; l < 16; ++l) {
      const bool nan_l = std::isnan(vals[l]), nan_b = std::isnan(vals[lane]);
      const bool larger = (nan_l && !nan_b) || vals[l] > vals[lane];
      const bool tie = (nan_l && nan_b) || vals[l] == vals[lane];
      if (larger || (tie && ids[l] < ids[lane])) lane = l;
    }
    return ids[lane];
  }
#endif
  int64_t b = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[b] || (std::isnan(x[i]) && !std::isnan(x[b]))) b = i;
  return b;
}

// x (rows, n) float32 with unit stride in n: (rows,) int64.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: x must be float32 (rows, n), n > 0");
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "argmax_rows: rows of fewer than 2^31 values");
  auto out = torch::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), row = x.stride(0);
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * row, n);
  });
  return out;
}

// ---- paged attention -------------------------------------------------------------------------
// For each KV head of a row: the row's G query heads (the heads that share this KV head, GQA) over
// the first n keys of its request, which the block table scatters over the pool. Three passes:
// the scores q . k of every query head with every key, a softmax over each head's scores, then
// the values weighted by it. The weights are rounded to T before they weigh the values, as SDPA's
// CPU kernel (and so Hugging Face) rounds them in bfloat16; the sum is the float32 one, as there.

// Softmax of n scores in place, 16 at a time: the weights rounded to T; returns 1 / their float32 sum.
template <typename T>
static inline float softmax_in_place(float* s, int64_t n) {
  // the last n % 16 scores as one more register, padded with -inf: a score past n weighs nothing.
  // (One exp_scalar per leftover score cost a prompt row of ~45 keys about as much as its dot
  // products: an exp is a register's work whether it fills one lane or sixteen.)
  const int64_t body = n - n % 16, tail = n - body;
  alignas(64) float last[16];
  for (int64_t i = 0; i < 16; ++i) last[i] = i < tail ? s[body + i] : -INFINITY;
  Vec16 mv = Vec16::load(last);
  for (int64_t t = 0; t < body; t += 16) mv = max(mv, Vec16::load(s + t));
  const Vec16 mx = Vec16::fill(mv.max());
  Vec16 sv = Vec16::fill(0.f);
  for (int64_t t = 0; t < body; t += 16) {
    const Vec16 e = exp(Vec16::load(s + t) - mx);
    round_to<T>(e).store(s + t);
    sv = sv + e;
  }
  if (tail) {
    exp(Vec16::load(last) - mx).store(last);
    for (int64_t i = tail; i < 16; ++i) last[i] = 0.f;     // exp clamps -inf to e^-87, not 0
    const Vec16 e = Vec16::load(last);
    sv = sv + e;
    round_to<T>(e).store(last);
    for (int64_t i = 0; i < tail; ++i) s[body + i] = last[i];
  }
  return 1.f / sv.sum();
}

// Any dtype, any head_dim, any even block size: plain loops through KvLayout.
template <typename T>
static void attend_one_head_any(const T* q, int64_t q_head, const T* kc, const T* vc, const KvLayout& L,
                                const int64_t* table, int64_t n, int64_t h, int64_t G, float scale, T* out,
                                float* scores) {
  const int64_t D = L.D;
  std::vector<float> acc(D);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t block_id = table[t / L.block_size], j = t % L.block_size;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += float(q[g * q_head + d]) * float(kc[L.k(block_id, j, h, d)]);
      s[t] = dot * scale;
    }
    const float inv = softmax_in_place<T>(s, n);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t block_id = table[t / L.block_size], j = t % L.block_size;
      for (int64_t d = 0; d < D; ++d) acc[d] += s[t] * float(vc[L.v(block_id, j, h, d)]);
    }
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = T(acc[d] * inv);
  }
}

#if defined(__AVX512BF16__)
static inline uint32_t bf16_bits(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u >> 16; }  // x already rounded

// bfloat16 on VDPBF16PS, block_size a multiple of 16. A job is one row's query heads of KV heads
// h0 .. h1, taken GC (at most 4) at a time, a "unit": their sums stay in registers only if the
// compiler knows how many there are. Scores: for each 16 tokens, each pair of dims p is one
// register of K (16 tokens x the pair) times q's pair p broadcast, summed into one register of 16
// scores per query head: no sum across a register. Values: for each pair of tokens, each 16 dims
// are one register of V (16 dims x the pair) times the two tokens' weights broadcast.
// Both passes go block by block and, inside a block, head by head: a block holds its KV heads one
// after another, so the job reads each block's K (and then V) as one run of memory, and a request
// whose blocks lie in order as one long run, which the CPU's prefetcher streams from memory.
// (Head by head over all blocks, the job read 1 / kv_heads of each block, a short run each time:
// a 32-row decode step's attention took a third longer, 5.8 against 4.3 ms in the engine.)
// `pairs` pairs of tokens of one block (V laid out at x: every dim's two values, pair after pair),
// the first of them pair `first` of the request, weighed into GC x DIM / 16 sums. Its own function
// with its own copy of the sums: the compiler then keeps them in registers through the loop.
template <int DIM, int GC>
static void __attribute__((noinline)) weigh_values(const bf16* x, int64_t first, int64_t pairs,
                                                   const int32_t* const* weights, float* sums, __mmask32 keep) {
  constexpr int V = DIM / 16;
  __m512 acc[GC * V];
  NP_UNROLL
  for (int i = 0; i < GC * V; ++i) acc[i] = _mm512_loadu_ps(sums + 16 * i);
  for (int64_t i = 0; i < pairs; ++i, x += 2 * DIM) {
    __m512bh vals[V];
    NP_UNROLL
    for (int v = 0; v < V; ++v) vals[v] = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + 32 * v);
    NP_UNROLL
    for (int g = 0; g < GC; ++g) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(weights[g][first + i]);
      NP_UNROLL
      for (int v = 0; v < V; ++v) acc[g * V + v] = _mm512_dpbf16_ps(acc[g * V + v], vals[v], w);
    }
  }
  NP_UNROLL
  for (int i = 0; i < GC * V; ++i) _mm512_storeu_ps(sums + 16 * i, acc[i]);
}

// The scores of one unit's GC query heads (q32[g]: head g's dims as pairs) with the tokens
// t0 .. end of one block (block_k: its K of the unit's KV head), into scores[g * stride + t].
template <int DIM, int GC>
static inline void score_block(const int32_t* const* q32, const bf16* block_k, int64_t bs, int64_t b0, int64_t end,
                               float scale, float* scores, int64_t stride) {
  constexpr int P = DIM / 2;
  for (int64_t t0 = b0; t0 < end; t0 += 16) {
    const bf16* k = block_k + 2 * (t0 - b0);                        // pair p of these 16 tokens: k + 2 bs p
    // two sums per query head, over even and odd pairs: consecutive instructions do not wait on
    // each other's result (an instruction takes several cycles; the unit starts one each cycle)
    __m512 acc[GC][2];
    NP_UNROLL
    for (int g = 0; g < GC; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int p = 0; p < P; p += 2)
      NP_UNROLL
      for (int e = 0; e < 2; ++e) {
        const __m512bh kp = (__m512bh)_mm512_loadu_si512(k + 2 * bs * (p + e));
        NP_UNROLL
        for (int g = 0; g < GC; ++g)
          acc[g][e] = _mm512_dpbf16_ps(acc[g][e], kp, (__m512bh)_mm512_set1_epi32(q32[g][p + e]));
      }
    NP_UNROLL
    for (int g = 0; g < GC; ++g)
      _mm512_storeu_ps(scores + g * stride + t0, _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_set1_ps(scale)));
  }
}

static inline void prefetch_run(const bf16* p, int64_t elements) {     // into L1, a line (32 values) at a time
  for (int64_t e = 0; e < elements; e += 32) _mm_prefetch(reinterpret_cast<const char*>(p + e), _MM_HINT_T0);
}

// One job: q points at the row's first query head of KV head h0, out at its output; G query heads
// share a KV head (GC divides G). scores: (h1 - h0) G (n + 16) floats; sums: (h1 - h0) G (DIM + 1).
template <int DIM, int GC>
static void attend_heads_bf16(const bf16* q, int64_t q_head, const bf16* kc, const bf16* vc, const KvLayout& L,
                              const int64_t* table, int64_t n, int64_t h0, int64_t h1, int64_t G, float scale,
                              bf16* out, float* scores, float* sums) {
  constexpr int V = DIM / 16;
  const int64_t bs = L.block_size, stride = n + 16;                 // a query head's scores: stride floats
  const int64_t per_kv = G / GC, units = (h1 - h0) * per_kv;       // unit u: query heads u GC .. u GC + GC
  // Blocks are read two ahead of use where the CPU's own prefetcher cannot foresee them: it follows
  // a run of memory into the next block when that block lies right after (the pool hands out
  // blocks in order, so a request's mostly do), not a jump to another block, nor a job's short run
  // of part of each block. (Asked for every block, a 32-row step's attention took 15-30% longer
  // when the blocks lay in order; asked for none, 20% longer when they lay shuffled.)
  const bool whole = h1 - h0 == L.kv_heads;
  auto ahead = [&](int64_t b) { return b + 2 * bs < n && (!whole || table[b / bs + 2] != table[b / bs + 1] + 1); };
  // the scores, block by block (no division per key)
  for (int64_t b0 = 0; b0 < n; b0 += bs) {
    const int64_t block = table[b0 / bs], end = std::min(n, b0 + bs);
    const bool fetch = ahead(b0);
    for (int64_t u = 0; u < units; ++u) {
      if (fetch && u % per_kv == 0) prefetch_run(kc + L.k(table[b0 / bs + 2], 0, h0 + u / per_kv, 0), DIM * bs);
      const int32_t* q32[GC];
      NP_UNROLL
      for (int g = 0; g < GC; ++g) q32[g] = reinterpret_cast<const int32_t*>(q + (u * GC + g) * q_head);
      score_block<DIM, GC>(q32, kc + L.k(block, 0, h0 + u / per_kv, 0), bs, b0, end, scale,
                           scores + u * GC * stride, stride);
    }
  }
  // the weights, rounded to bfloat16 by the softmax, then kept as bfloat16 in place:
  // pairs[t / 2] holds tokens t and t + 1 (an odd n's last pair weighs nothing past n)
  const int64_t heads = units * GC;
  float* inv = sums + heads * DIM;                                  // 1 / each head's sum
  for (int64_t i = 0; i < heads; ++i) {
    float* s = scores + i * stride;
    inv[i] = softmax_in_place<bf16>(s, n);
    s[n] = 0.f;
    uint16_t* w = reinterpret_cast<uint16_t*>(s);                   // w[t] is written after s[t] is read
    int64_t t = 0;
    for (; t + 16 <= n + 1; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
    for (; t <= n; ++t) w[t] = uint16_t(bf16_bits(s[t]));
  }
  std::fill(sums, sums + heads * DIM, 0.f);
  for (int64_t b0 = 0; b0 < n; b0 += bs) {                          // the values, block by block
    const int64_t block = table[b0 / bs], pairs = (std::min(n, b0 + bs) - b0) / 2;
    const bool fetch = ahead(b0);
    for (int64_t u = 0; u < units; ++u) {
      if (fetch && u % per_kv == 0) prefetch_run(vc + L.v(table[b0 / bs + 2], 0, h0 + u / per_kv, 0), DIM * bs);
      const int32_t* weights[GC];                                   // weights[g][t / 2]: tokens t, t + 1
      NP_UNROLL
      for (int g = 0; g < GC; ++g) weights[g] = reinterpret_cast<const int32_t*>(scores + (u * GC + g) * stride);
      weigh_values<DIM, GC>(vc + L.v(block, 0, h0 + u / per_kv, 0), b0 / 2, pairs, weights, sums + u * GC * DIM,
                            0xFFFFFFFFu);
      if (n % 2 && b0 + bs >= n)  // an odd n's last token: the slot past it is not the request's (it may hold anything)
        weigh_values<DIM, GC>(vc + L.v(block, (n - 1) % bs, h0 + u / per_kv, 0), (n - 1) / 2, 1, weights,
                              sums + u * GC * DIM, 0x55555555u);
    }
  }
  for (int64_t i = 0; i < heads; ++i)
    NP_UNROLL
    for (int v = 0; v < V; ++v)
      round_to<bf16>(Vec16{_mm512_mul_ps(_mm512_loadu_ps(sums + i * DIM + 16 * v), _mm512_set1_ps(inv[i]))})
          .store(out + i * DIM + 16 * v);
}

// The job's query heads GC at a time: the largest GC of 4, 3, 2, 1 that divides G.
template <int DIM>
static void attend_job_bf16(const bf16* q, int64_t q_head, const bf16* kc, const bf16* vc, const KvLayout& L,
                            const int64_t* table, int64_t n, int64_t h0, int64_t h1, int64_t G, float scale,
                            bf16* out, float* scores, float* sums) {
  if (G % 4 == 0) attend_heads_bf16<DIM, 4>(q, q_head, kc, vc, L, table, n, h0, h1, G, scale, out, scores, sums);
  else if (G % 3 == 0) attend_heads_bf16<DIM, 3>(q, q_head, kc, vc, L, table, n, h0, h1, G, scale, out, scores, sums);
  else if (G % 2 == 0) attend_heads_bf16<DIM, 2>(q, q_head, kc, vc, L, table, n, h0, h1, G, scale, out, scores, sums);
  else attend_heads_bf16<DIM, 1>(q, q_head, kc, vc, L, table, n, h0, h1, G, scale, out, scores, sums);
}
#endif

// A step's rows: row t belongs to request req[t] and sees the first n[t] keys of it. Request i's
// q_len new rows are the last q_len of its seq_len tokens, so its row j sees seq_len - q_len + j
// + 1 keys (causal): a decode row sees all seq_len, a prompt's rows one more key each.
struct StepRows {
  std::vector<int64_t> req, n;
};

static StepRows step_rows(const int64_t* seq_lens, const int64_t* query_start_loc, int64_t num_reqs) {
  StepRows rows;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = query_start_loc[i + 1] - query_start_loc[i];
    for (int64_t j = 0; j < q_len; ++j) {
      rows.req.push_back(i);
      rows.n.push_back(seq_lens[i] - q_len + j + 1);
    }
  }
  return rows;
}

// A job is one row's KV heads h0 .. h1: all of them when each thread has enough rows to share
// (a job then reads its blocks whole), else one head each, so that a step of a few rows still
// splits over the threads. The jobs are cut into one range per thread holding about the same
// number of keys (a prompt's last rows see many more keys than its first, so equal counts of jobs
// would leave one thread with most of the work).
static constexpr int64_t kRowsPerThreadForWholeRows = 4;

template <typename T>
static void attend_rows(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& tables, const StepRows& rows, torch::Tensor& out, float scale) {
  const KvLayout L = kv_layout(k_cache);
  const int64_t num_rows = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = L.kv_heads;
  const int64_t G = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const T *qp = q.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t longest = num_rows ? *std::max_element(rows.n.begin(), rows.n.end()) : 0;
#if defined(__AVX512BF16__)
  const bool vector = std::is_same_v<T, bf16> && L.block_size % 16 == 0 && q_head % 2 == 0 &&
                      q_row % 2 == 0 && reinterpret_cast<uintptr_t>(qp) % 4 == 0 && (D == 64 || D == 128 || D == 256);
#endif
  const int64_t max_threads = at::get_num_threads();
  const int64_t per_row = num_rows >= kRowsPerThreadForWholeRows * max_threads ? 1 : kv_heads;   // jobs per row
  const int64_t job_heads = kv_heads / per_row;
  // cut[k]..cut[k+1]: thread k's jobs, by prefix sums of their keys (+ a job's fixed cost)
  const int64_t jobs = num_rows * per_row, threads = std::max<int64_t>(1, std::min<int64_t>(max_threads, jobs));
  std::vector<int64_t> cut(threads + 1, jobs);
  cut[0] = 0;
  int64_t total = 0;
  for (int64_t t = 0; t < num_rows; ++t) total += (rows.n[t] + 16) * per_row;
  for (int64_t job = 0, done = 0, k = 1; job < jobs && k < threads; ++job) {
    done += rows.n[job / per_row] + 16;
    while (k < threads && done * threads >= total * k) cut[k++] = job + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(job_heads * G * (longest + 32)), sums(job_heads * G * (D + 1));
    for (int64_t job = cut[begin]; job < cut[end]; ++job) {
      const int64_t t = job / per_row, h0 = (job % per_row) * job_heads, h1 = h0 + job_heads;
      const T* qt = qp + t * q_row + h0 * G * q_head;
      const int64_t* table = tp + rows.req[t] * max_blocks;
      T* o = op + (t * heads + h0 * G) * D;
      const int64_t n = rows.n[t];
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, bf16>) {
        if (vector) {
          auto job_fn = D == 64 ? attend_job_bf16<64> : D == 128 ? attend_job_bf16<128> : attend_job_bf16<256>;
          job_fn(qt, q_head, kc, vc, L, table, n, h0, h1, G, scale, o, scores.data(), sums.data());
          continue;
        }
      }
#endif
      for (int64_t h = h0; h < h1; ++h)
        attend_one_head_any<T>(qt + (h - h0) * G * q_head, q_head, kc, vc, L, table, n, h, G, scale,
                               o + (h - h0) * G * D, scores.data());
    }
  });
}

// The whole step's attention in one call, every row through its request's block table (the
// K/V of the step's own tokens already stored): prompt chunks, prefix-cache hits and decode rows
// alike, as vLLM's unified paged attention does.
//   q (rows, heads, dim) with unit stride in dim; caches (blocks, block_size, kv_heads, dim) in
//   this file's order (KvLayout)
//   block_tables (reqs, max_blocks), seq_lens (reqs,), query_start_loc (reqs + 1,): int64
// Returns out (rows, heads, dim).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.size(2) == k_cache.size(3),
              "paged_attention: q (rows, heads, head_dim) with unit stride in head_dim, as the caches' head_dim");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && v_cache.is_contiguous(), "paged_attention: K and V caches of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_attention: q and the caches in one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_attention: heads must be a multiple of kv_heads");
  auto tables = block_tables.contiguous(), lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  const int64_t num_reqs = lens.size(0);
  TORCH_CHECK(tables.size(0) == num_reqs && starts.numel() == num_reqs + 1, "paged_attention: one table, one "
              "length and one start per request");
  const int64_t *lp = lens.data_ptr<int64_t>(), *sp = starts.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] == 0 && sp[num_reqs] == q.size(0), "paged_attention: query_start_loc must run from 0 to the rows");
  for (int64_t i = 0; i < num_reqs; ++i)
    TORCH_CHECK(sp[i + 1] >= sp[i] && lp[i] >= sp[i + 1] - sp[i] && lp[i] <= tables.size(1) * k_cache.size(1),
                "paged_attention: request ", i, " has more rows than keys, or more keys than its block table holds");
  const StepRows rows = step_rows(lp, sp, num_reqs);
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  DISPATCH_MODEL_DTYPES(q.scalar_type(), "paged_attention", [&] {
    attend_rows<scalar_t>(q, k_cache, v_cache, tables, rows, out, float(scale));
  });
  return out;
}

// ---- bfloat16 linear on the dot-product instruction ----------------------------------------
// y = x W^T (+ b) for bfloat16 x and W, on AVX512-BF16's VDPBF16PS: one instruction multiplies 16
// pairs of bfloat16 weights by a broadcast pair of inputs and adds each pair's two products into
// one of 16 float32 sums. The weight is packed once, at load, so that the operand for 16 output
// features and one pair of inputs is 64 contiguous bytes, and a tile of 64 features reads one
// stream: packed (ceil(N / 64), K / 2, 64 features, 2 inputs). A tile of up to 6 rows keeps its
// 6 x 4 sums in registers while it runs down K; the next row tile reads the same weights from L2.
// Products of two bfloat16 numbers are exact in float32, so this is a float32 sum of exact
// products, as oneDNN's, in another order; the sum is rounded to bfloat16 once, after the bias.
#if defined(__AVX512BF16__)
static constexpr int64_t kTileN = 64;   // output features per tile: 4 registers of 16
static constexpr int kTileM = 6;        // rows per tile: 24 sums + 4 weights + 1 input = 29 of 32 registers

torch::Tensor pack_bf16_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "pack_bf16_weight: w must be bfloat16 (out_features, in_features) with in_features even");
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + kTileN - 1) / kTileN;
  auto out = torch::zeros({tiles, K / 2, kTileN, 2}, w.options());       // features past N stay 0
  auto src = w.contiguous();
  const bf16* sp = src.data_ptr<bf16>();
  bf16* dp = out.data_ptr<bf16>();
  at::parallel_for(0, tiles, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t kp = 0; kp < K / 2; ++kp)
        for (int64_t f = 0; f < kTileN && t * kTileN + f < N; ++f)
          for (int64_t i = 0; i < 2; ++i)
            dp[((t * (K / 2) + kp) * kTileN + f) * 2 + i] = sp[(t * kTileN + f) * K + 2 * kp + i];
  });
  return out;
}

// Rows m0 .. m0 + MT of x times one tile of 64 features; y's columns past N are not written.
// `next`: another tile of weights to ask into L2 meanwhile (linear_rows says which), else this
// tile's own weights a few steps ahead into L1.
template <int MT>
static inline void linear_tile(const int32_t* x, int64_t x_row, const __m512i* w, int64_t KP, const float* bias,
                               bf16* y, int64_t y_row, int64_t width, const __m512i* next) {
  __m512 acc[MT][4];
  NP_UNROLL
  for (int m = 0; m < MT; ++m)
    NP_UNROLL
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp, w += 4) {
    if (next) {
      NP_UNROLL
      for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + 4 * kp + j), _MM_HINT_T1);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(w + 32), _MM_HINT_T0);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w), b1 = (__m512bh)_mm512_loadu_si512(w + 1),
                   b2 = (__m512bh)_mm512_loadu_si512(w + 2), b3 = (__m512bh)_mm512_loadu_si512(w + 3);
    NP_UNROLL
    for (int m = 0; m < MT; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[m * x_row + kp]);    // inputs 2kp, 2kp + 1 of row m
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
    }
  }
  NP_UNROLL
  for (int m = 0; m < MT; ++m)
    NP_UNROLL
    for (int j = 0; j < 4; ++j) {
      __m512 v = acc[m][j];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(v);                    // round to nearest even
      if (16 * j + 16 <= width) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * y_row + 16 * j), out);
      } else if (16 * j < width) {                                          // the last, partial tile
        const __mmask16 keep = (__mmask16)((1u << (width - 16 * j)) - 1);
        _mm256_mask_storeu_epi16(y + m * y_row + 16 * j, keep, out);
      }
    }
}

// `rows` rows of x times one tile of 64 features, 6 rows at a time, this call's first 6 rows the
// tile's pass number `pass`. A tile's first pass reads its weights from memory and waits on them;
// the passes after it read them from L2 and wait on the arithmetic. So the second pass, if it is a
// whole one, also asks for `next`, the tile this thread reads after this one, into L2: its first
// pass then finds it there, and the memory streams while the arithmetic runs. (A short second
// pass, 1-5 rows, is over before the next tile arrives: at 8 rows asking there made a step's
// linears 30% slower. With it as it is: 10-20% faster from 12 to 48 rows, the same at 256 and 2,048.)
static void linear_rows(const int32_t* x, int64_t x_row, int64_t rows, const __m512i* w, int64_t KP, const float* bias,
                        bf16* y, int64_t y_row, int64_t width, const __m512i* next = nullptr, int64_t pass = 0) {
  int64_t m = 0;
  for (; m + kTileM <= rows; m += kTileM)
    linear_tile<kTileM>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width,
                        pass + m / kTileM == 1 ? next : nullptr);
  switch (rows - m) {
    case 5: linear_tile<5>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width, nullptr); break;
    case 4: linear_tile<4>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width, nullptr); break;
    case 3: linear_tile<3>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width, nullptr); break;
    case 2: linear_tile<2>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width, nullptr); break;
    case 1: linear_tile<1>(x + m * x_row, x_row, w, KP, bias, y + m * y_row, y_row, width, nullptr); break;
    default: break;
  }
}

// The work of a linear is cut into (feature tile, group of rows) units: a layer of 576 features is
// only 9 tiles, which two threads would share 5 to 4; cut into 6-row groups its units share evenly.
static int64_t rows_per_unit(int64_t tiles) { return tiles >= 16 ? 4 * kTileM : kTileM; }

// The weight tile a thread reads after tile t (linear_rows asks for it ahead): tile t + 1, if the
// thread's range of units, which ends before unit `end` (units tile-major, `groups` a tile), holds it.
static const __m512i* next_tile(const __m512i* w, int64_t KP, int64_t t, int64_t groups, int64_t end) {
  return (t + 1) * groups < end ? w + (t + 1) * KP * 4 : nullptr;
}

// bias (any dtype) as float32, zero-padded to `length`; empty where there is no bias.
static std::vector<float> float_bias(const torch::Tensor& bias, int64_t length) {
  std::vector<float> out;
  if (bias.defined() && bias.numel()) {
    out.assign(length, 0.f);
    auto b = bias.to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + std::min<int64_t>(b.numel(), length), out.begin());
  }
  return out;
}

// x (rows, K) bfloat16 with unit stride in K; packed from pack_bf16_weight; bias (N,) or empty.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
              packed.size(1) * 2 == x.size(1) && packed.size(0) * kTileN >= N,
              "linear_bf16: x must be bfloat16 (rows, in_features) matching the packed weight");
  const int64_t M = x.size(0), KP = packed.size(1), tiles = packed.size(0), x_row = x.stride(0) / 2;
  TORCH_CHECK(x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "linear_bf16: x's rows must start on 4-byte boundaries");
  auto y = torch::empty({M, N}, x.options());
  const std::vector<float> bias_f = float_bias(bias, tiles * kTileN);           // padded to whole tiles
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<bf16>());    // a pair of inputs as one int32
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<bf16>());
  bf16* yp = y.data_ptr<bf16>();
  const int64_t per_unit = rows_per_unit(tiles), groups = (M + per_unit - 1) / per_unit, units = tiles * groups;
  at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) {
      const int64_t t = u / groups, m = (u % groups) * per_unit, rows = std::min(M, m + per_unit) - m;
      const float* bt = bias_f.empty() ? nullptr : bias_f.data() + t * kTileN;
      const int64_t width = std::min(kTileN, N - t * kTileN);
      linear_rows(xp + m * x_row, x_row, rows, wp + t * KP * 4, KP, bt, yp + m * N + t * kTileN, N, width,
                  next_tile(wp, KP, t, groups, e), m / kTileM);
    }
  });
  return y;
}

// ---- the gate/up projection with SiLU(gate) x up as its epilogue ------------------------------
// gate_up's weight holds gate's I features, then up's I; when I is a multiple of 64, feature tile
// t of gate and tile t + I / 64 of up are the two halves of the same 64 features. One unit runs
// both over up to 24 rows into a buffer that stays in L1, then writes SiLU(gate) * up: the
// (rows, 2 I) projection is never written to memory and read back (a 2,048-row prompt step wrote
// and reread 12 MB a layer for it). The values are linear_bf16's, then silu_and_mul's.
//
// x (rows, K) bfloat16 with unit stride in K; packed from pack_bf16_weight of the (2 I, K) gate_up
// weight, I a multiple of 64; bias (2 I,) or empty: SiLU(x Wg^T + bg) * (x Wu^T + bu), (rows, I).
torch::Tensor linear_bf16_silu_mul(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t I) {
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 4 && I % kTileN == 0 &&
              packed.size(1) * 2 == x.size(1) && packed.size(0) * kTileN == 2 * I,
              "linear_bf16_silu_mul: x must be bfloat16 (rows, in_features) matching a packed (2 I, in_features) "
              "weight, I a multiple of 64");
  TORCH_CHECK(x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "linear_bf16_silu_mul: x's rows must start on 4-byte boundaries");
  const int64_t M = x.size(0), KP = packed.size(1), tiles = I / kTileN, x_row = x.stride(0) / 2;
  auto y = torch::empty({M, I}, x.options());
  const std::vector<float> bias_f = float_bias(bias, 2 * I);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<bf16>());
  const __m512i* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<bf16>());
  bf16* yp = y.data_ptr<bf16>();
  const int64_t per_unit = rows_per_unit(tiles), groups = (M + per_unit - 1) / per_unit, units = tiles * groups;
  at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
    alignas(64) bf16 gate[4 * kTileM * kTileN], up[4 * kTileM * kTileN];     // rows_per_unit's most
    for (int64_t u = b; u < e; ++u) {
      const int64_t t = u / groups, m = (u % groups) * per_unit, rows = std::min(M, m + per_unit) - m;
      const float* bg = bias_f.empty() ? nullptr : bias_f.data() + t * kTileN;
      const float* bu = bias_f.empty() ? nullptr : bias_f.data() + I + t * kTileN;
      linear_rows(xp + m * x_row, x_row, rows, wp + t * KP * 4, KP, bg, gate, kTileN, kTileN, wp + (t + tiles) * KP * 4,
                  m / kTileM);                                      // up's tile t is read next
      linear_rows(xp + m * x_row, x_row, rows, wp + (t + tiles) * KP * 4, KP, bu, up, kTileN, kTileN,
                  next_tile(wp, KP, t, groups, e), m / kTileM);
      for (int64_t r = 0; r < rows; ++r) silu_and_mul_row(gate + r * kTileN, up + r * kTileN, yp + (m + r) * I + t * kTileN, kTileN);
    }
  });
  return y;
}
#else
torch::Tensor pack_bf16_weight(torch::Tensor) { TORCH_CHECK(false, "built without AVX512-BF16"); }
torch::Tensor linear_bf16(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
torch::Tensor linear_bf16_silu_mul(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
#endif

// ---- weight-only 4- and 8-bit linears ---------------------------------------------------------
// A step of one or a few rows streams every weight once and does two FLOPs per weight it reads:
// its time is the weights' bytes. So the weights stay in the bits they ship in (GGUF's Q4_1: 4 bits
// a weight plus a float16 scale d and minimum m per block of G = 32 inputs, w = q d + m; Q8_0: 8
// bits and d, w = q d) and are widened in registers just before they are multiplied. Within a block
// the products are summed unscaled; d scales the block's sum, and m times the block's sum of inputs
// (once per row) adds the minimum: sum_i (q_i d + m) x_i = d sum_i q_i x_i + m sum_i x_i.
//
// Layouts, packed once at load, one stream per tile of output features:
//   4-bit: tiles of 32 features; per block, G / 4 chunks of 64 bytes, then the 32 features' d and m
//     (float16). A chunk holds 2 pairs of inputs for all 32 features: byte p of its 16-byte lane L
//     belongs to feature 4L + p / 2 (p < 8) or 16 + 4L + (p - 8) / 2, input p % 2 of a pair; its low
//     nibble to the chunk's first pair, its high nibble to the second. That is the order in which
//     unpacking a chunk's nibbles next to the byte 0x43 lays them out: 4 registers of 16 features x
//     (input 2i, input 2i + 1) as bfloat16 numbers 128 + q, VDPBF16PS's operands (q4_chunk_bf16).
//   8-bit: tiles of 16 features; per block, G x 16 bytes (input-major), then the 16 features' d.
static constexpr int64_t kQ4Tile = 32, kQ8Tile = 16;

static int64_t q_tile(int bits) { return bits == 4 ? kQ4Tile : kQ8Tile; }
static int64_t q_block_bytes(int64_t G, int bits) { return bits == 4 ? 16 * G + 128 : 16 * G + 32; }
static int64_t q_meta_offset(int64_t G) { return 16 * G; }      // both layouts: codes first, 16 G bytes

// Where the 4-bit code of feature f (0..31), input k (0..G-1) of a block lies: (byte, nibble shift).
static inline std::pair<int64_t, int> q4_position(int64_t f, int64_t k) {
  const int64_t chunk = k / 4, second_pair = (k / 2) % 2, e = k % 2;
  const int64_t g = f % 16, lane = g / 4, p = (f < 16 ? 0 : 8) + 2 * (g % 4) + e;
  return {chunk * 64 + lane * 16 + p, second_pair ? 4 : 0};
}

// codes (N, K) integers (4-bit: 0..15; 8-bit: -128..127), d and m (N, K / G) float (m: 4-bit only):
// the packed bytes.
torch::Tensor pack_quantized(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t G, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_quantized: bits must be 4 or 8");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(G % 4 == 0 && K % G == 0 && d.size(0) == N && d.size(1) == K / G &&
              (bits == 8 || (m.size(0) == N && m.size(1) == K / G)),
              "pack_quantized: codes (N, K), d and m (N, K / G), G a multiple of 4 dividing K");
  const int64_t T = q_tile(bits), tiles = (N + T - 1) / T, blocks = K / G, bb = q_block_bytes(G, bits);
  auto out = torch::zeros({tiles * blocks * bb}, codes.options().dtype(at::kByte));   // features past N: 0
  auto c = codes.to(at::kInt).contiguous();
  auto df = d.to(at::kFloat).contiguous();
  auto mf = bits == 4 ? m.to(at::kFloat).contiguous() : df;
  const int32_t* cp = c.data_ptr<int32_t>();
  const float *dp = df.data_ptr<float>(), *mp = mf.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = op + (t * blocks + b) * bb;
        fp16* meta = reinterpret_cast<fp16*>(blk + q_meta_offset(G));
        for (int64_t f = 0; f < T && t * T + f < N; ++f) {
          const int64_t n = t * T + f;
          const int32_t* row = cp + n * K + b * G;
          for (int64_t k = 0; k < G; ++k) {
            if (bits == 4) {
              const auto [byte, shift] = q4_position(f, k);
              blk[byte] |= uint8_t((row[k] & 15) << shift);
            } else {
              blk[16 * k + f] = uint8_t(int8_t(row[k]));
            }
          }
          meta[f] = fp16(dp[n * blocks + b]);
          if (bits == 4) meta[kQ4Tile + f] = fp16(mp[n * blocks + b]);
        }
      }
  });
  return out;
}

#if defined(__AVX512F__)
// A chunk's 64 bytes as 4 operands: (A, B) the chunk's first pair of inputs for features 0-15 and
// 16-31, (C, D) its second pair; each u32 lane (128 + q for input 2i, 128 + q for input 2i + 1) as
// bfloat16 bits (0x43 is the high byte of 128.0 in bfloat16; 128 + q is exact for q < 128).
static inline void q4_chunk(const uint8_t* chunk, __m512i& A, __m512i& B, __m512i& C, __m512i& D) {
  const __m512i v = _mm512_loadu_si512(chunk), nib = _mm512_set1_epi8(0x0F), c43 = _mm512_set1_epi8(0x43);
  const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  A = _mm512_unpacklo_epi8(lo, c43);
  B = _mm512_unpackhi_epi8(lo, c43);
  C = _mm512_unpacklo_epi8(hi, c43);
  D = _mm512_unpackhi_epi8(hi, c43);
}

// One 4-bit tile (32 features) times MT rows: y = d (sum (128 + q) x - 128 sum x) + m sum x per block.
// bfloat16 rows with AVX512-BF16: a pair of inputs times 16 features' pairs is one VDPBF16PS;
// otherwise each operand's two halves are widened to float32 (a bfloat16's bits are a float32's
// top half) and multiplied by the float32 inputs one at a time.
template <int MT, bool BF16_PAIRS>
static inline void q4_tile(const void* xv, int64_t x_row, const float* sx, const uint8_t* tile, int64_t K,
                           int64_t G, float* out, int64_t out_row) {
  const int64_t blocks = K / G, bb = q_block_bytes(G, 4);
  __m512 acc[MT][2];
  NP_UNROLL
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * bb;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bb), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bb + 64 * (G / 8)), _MM_HINT_T0);
    __m512 part[MT][2];
    NP_UNROLL
    for (int m = 0; m < MT; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < G / 4; ++c) {
      __m512i A, B, C, D;
      q4_chunk(blk + 64 * c, A, B, C, D);
      const int64_t k = b * G + 4 * c;                             // inputs k .. k + 3
      NP_UNROLL
      for (int m = 0; m < MT; ++m) {
#if defined(__AVX512BF16__)
        if constexpr (BF16_PAIRS) {
          const int32_t* x = static_cast<const int32_t*>(xv) + m * x_row + k / 2;
          const __m512bh first = (__m512bh)_mm512_set1_epi32(x[0]), second = (__m512bh)_mm512_set1_epi32(x[1]);
          part[m][0] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(part[m][0], (__m512bh)A, first), (__m512bh)C, second);
          part[m][1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(part[m][1], (__m512bh)B, first), (__m512bh)D, second);
          continue;
        }
#endif
        if constexpr (!BF16_PAIRS) {
          const float* x = static_cast<const float*>(xv) + m * x_row + k;
          const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
          const __m512 x0 = _mm512_set1_ps(x[0]), x1 = _mm512_set1_ps(x[1]), x2 = _mm512_set1_ps(x[2]),
                       x3 = _mm512_set1_ps(x[3]);
          part[m][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(A, 16)), x0, part[m][0]);
          part[m][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(A, top)), x1, part[m][0]);
          part[m][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(C, 16)), x2, part[m][0]);
          part[m][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(C, top)), x3, part[m][0]);
          part[m][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(B, 16)), x0, part[m][1]);
          part[m][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(B, top)), x1, part[m][1]);
          part[m][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(D, 16)), x2, part[m][1]);
          part[m][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(D, top)), x3, part[m][1]);
        }
      }
    }
    const uint8_t* meta = blk + q_meta_offset(G);
    NP_UNROLL
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32 * h)));
      const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 64 + 32 * h)));
      NP_UNROLL
      for (int m = 0; m < MT; ++m) {
        const __m512 s = _mm512_set1_ps(sx[m * blocks + b]);
        acc[m][h] = _mm512_fmadd_ps(_mm512_fnmadd_ps(s, _mm512_set1_ps(128.f), part[m][h]), d, acc[m][h]);
        acc[m][h] = _mm512_fmadd_ps(mins, s, acc[m][h]);
      }
    }
  }
  NP_UNROLL
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(out + m * out_row, acc[m][0]);
    _mm512_storeu_ps(out + m * out_row + 16, acc[m][1]);
  }
}

// One 8-bit tile (16 features) times MT rows of float32 inputs.
template <int MT>
static inline void q8_tile(const float* x, int64_t x_row, const uint8_t* tile, int64_t K, int64_t G, float* out,
                           int64_t out_row) {
  const int64_t blocks = K / G, bb = q_block_bytes(G, 8);
  __m512 acc[MT];
  NP_UNROLL
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * bb;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bb), _MM_HINT_T0);
    __m512 part[MT];
    NP_UNROLL
    for (int m = 0; m < MT; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t i = 0; i < G; ++i) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * i))));
      NP_UNROLL
      for (int m = 0; m < MT; ++m) part[m] = _mm512_fmadd_ps(q, _mm512_set1_ps(x[m * x_row + b * G + i]), part[m]);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + q_meta_offset(G))));
    NP_UNROLL
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_fmadd_ps(part[m], d, acc[m]);
  }
  NP_UNROLL
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * out_row, acc[m]);
}
#endif

// Plain loops, for a build without AVX-512: the same sums, one feature and one row at a time.
static void quantized_tile_any(const float* x, int64_t x_row, const float* sx, const uint8_t* tile, int64_t K,
                               int64_t G, int bits, int64_t rows, float* out, int64_t out_row) {
  const int64_t blocks = K / G, bb = q_block_bytes(G, bits), T = q_tile(bits);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < T; ++f) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = tile + b * bb;
        const fp16* meta = reinterpret_cast<const fp16*>(blk + q_meta_offset(G));
        float part = 0.f;
        for (int64_t k = 0; k < G; ++k) {
          float q;
          if (bits == 4) {
            const auto [byte, shift] = q4_position(f, k);
            q = float((blk[byte] >> shift) & 15);
          } else {
            q = float(int8_t(blk[16 * k + f]));
          }
          part += q * x[r * x_row + b * G + k];
        }
        acc += part * float(meta[f]) + (bits == 4 ? float(meta[kQ4Tile + f]) * sx[r * blocks + b] : 0.f);
      }
      out[r * out_row + f] = acc;
    }
}

// x (M, K) in the model's dtype, unit stride in K; packed from pack_quantized: y (M, N), float32
// sums rounded once to x's dtype. Rows go 4 at a time; each tile streams its weights once. One
// step calls this 120 times for weights of a few hundred kilobytes, so nothing is allocated but y.
template <typename T>
static void quantized_rows(const T* x, int64_t x_row, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int64_t G,
                           int bits, T* y) {
  const int64_t blocks = K / G, Tw = q_tile(bits), tiles = (N + Tw - 1) / Tw, bb = q_block_bytes(G, bits);
  std::vector<float> xf(M * K), sx(M * blocks, 0.f);          // the rows in float32; their sums per block
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < K; ++i) {
      xf[r * K + i] = float(x[r * x_row + i]);
      sx[r * blocks + i / G] += xf[r * K + i];
    }
  // a thread takes at least ~32 KB of weights: smaller shares cost more to hand out than to read
  at::parallel_for(0, tiles, std::max<int64_t>(1, 32 * 1024 / (blocks * bb)), [&](int64_t tb, int64_t te) {
    float out[4 * kQ4Tile];
    for (int64_t t = tb; t < te; ++t) {
      const uint8_t* tile = wp + t * blocks * bb;
      const int64_t width = std::min(Tw, N - t * Tw);
      for (int64_t r = 0; r < M; r += 4) {
        const int64_t rows = std::min<int64_t>(4, M - r);
        const float *xr = xf.data() + r * K, *sr = sx.data() + r * blocks;
#if defined(__AVX512F__)
        constexpr bool pairs = std::is_same_v<T, bf16> && NP_HAS_AVX512_BF16;
        const void* x4 = pairs ? static_cast<const void*>(x + r * x_row) : static_cast<const void*>(xr);
        const int64_t row4 = pairs ? x_row / 2 : K;
#define NP_QTILE(MT) (bits == 4 ? q4_tile<MT, pairs>(x4, row4, sr, tile, K, G, out, Tw) \
                               : q8_tile<MT>(xr, K, tile, K, G, out, Tw))
        if (rows == 4) NP_QTILE(4); else if (rows == 3) NP_QTILE(3); else if (rows == 2) NP_QTILE(2); else NP_QTILE(1);
#undef NP_QTILE
#else
        quantized_tile_any(xr, K, sr, tile, K, G, bits, rows, out, Tw);
#endif
        for (int64_t j = 0; j < rows; ++j)
          for (int64_t f = 0; f < width; ++f) y[(r + j) * N + t * Tw + f] = T(out[j * Tw + f]);
      }
    }
  });
}

torch::Tensor linear_quantized(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t G, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && (bits == 4 || bits == 8), "linear_quantized: x (rows, in_features), 4 or 8 bits");
  if (x.stride(1) != 1 || x.stride(0) % 2) x = x.contiguous();     // rows read as pairs: an even row stride
  const int64_t M = x.size(0), K = x.size(1), Tw = q_tile(bits), tiles = (N + Tw - 1) / Tw;
  TORCH_CHECK(K % G == 0 && packed.numel() == tiles * (K / G) * q_block_bytes(G, bits),
              "linear_quantized: x's in_features do not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "linear_quantized", [&] {
    quantized_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), M, K, packed.data_ptr<uint8_t>(), N, G, int(bits),
                             y.data_ptr<scalar_t>());
  });
  return y;
}

// ---- the decoder layers, one after another, in one call ----------------------------------------
// A decode step of a small model on a CPU spends about a millisecond of its ten in Python between
// the kernels above: looking up modules, calling them, slicing the projection's output. So the
// fused path hands the whole stack of layers to C++ once per step (cpu/fused.py builds the
// description from the model's own modules). Each layer is the reference's DecoderLayer in ten
// calls: rms_norm, q/k/v projection, rotary_and_store, paged_attention, o projection,
// add_rms_norm, gate/up projection, silu_and_mul, down projection, the residual add.
//
// A linear is one of: nanopaged's bfloat16 kernel (kDpbf16); a quantized weight for steps of at
// most `rows_max` rows beside a dense layer for more (kQuantized); anything else, a Python callable
// (kCallable: oneDNN's packed linear, nn.Linear, torch's int4 kernel), called back with the GIL the
// caller holds.
struct Linear {
  enum Kind { kDpbf16 = 0, kQuantized = 1, kCallable = 2 };
  int64_t kind = kCallable, out_features = 0;
  torch::Tensor packed, bias;                        // kDpbf16: pack_bf16_weight's; kQuantized: pack_quantized's
  int64_t group = 0, bits = 0, rows_max = 0;         // kQuantized
  std::shared_ptr<Linear> dense;                     // kQuantized: the layer for more rows
  pybind11::object fn;                               // kCallable

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == kDpbf16) return linear_bf16(x, packed, bias, out_features);
    if (kind == kQuantized) {
      if (x.size(0) > rows_max) return (*dense)(x);
      auto y = linear_quantized(x, packed, out_features, group, bits);
      return bias.defined() && bias.numel() ? y.add_(bias) : y;
    }
    return fn(x).cast<torch::Tensor>();
  }

  // a gate_up projection followed by SiLU(gate) * up: in one kernel where it can be
  torch::Tensor silu_mul(const torch::Tensor& x) const {
    if (NP_HAS_AVX512_BF16 && kind == kDpbf16 && out_features % (2 * 64) == 0)
      return linear_bf16_silu_mul(x, packed, bias, out_features / 2);
    return silu_and_mul((*this)(x));
  }
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

// x (tokens, hidden): the embeddings, the residual stream through every layer (updated in place);
// cos, sin (tokens, head_dim); kv_cache (layers, 2, blocks, block_size, kv_heads, head_dim); the
// step's slot mapping, block tables, lengths and query starts (AttentionMetadata's).
torch::Tensor decoder_forward(const Decoder& dec, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                              torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc) {
  TORCH_CHECK(kv_cache.size(0) == int64_t(dec.layers.size()), "decoder_forward: one KV cache per layer");
  const int64_t n = x.size(0), q_width = dec.heads * dec.head_dim;
  torch::Tensor mlp;     // the layer before's MLP output, added to x by the next norm (vLLM's fused_add_rms_norm)
  for (size_t i = 0; i < dec.layers.size(); ++i) {
    const Layer& layer = dec.layers[i];
    auto k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
    auto nx = mlp.defined() ? add_rms_norm(x, mlp, layer.input_norm, dec.eps) : rms_norm(x, layer.input_norm, dec.eps);
    auto qkv = layer.qkv(nx);
    rotary_and_store(qkv, cos, sin, layer.q_norm, layer.k_norm, dec.qk_eps, dec.heads, dec.kv_heads, k_cache, v_cache,
                     slot_mapping);
    auto q = qkv.narrow(1, 0, q_width).view({n, dec.heads, dec.head_dim});
    auto o = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dec.scale);
    auto h = add_rms_norm(x, layer.o(o.view({n, q_width})), layer.post_norm, dec.eps);   // x += o
    mlp = layer.down(layer.gate_up.silu_mul(h));
  }
  return mlp.defined() ? x.add_(mlp) : x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as Hugging Face's LlamaRMSNorm");
  m.def("add_rms_norm", &add_rms_norm, "x += y in place (the residual), then RMSNorm of x");
  m.def("rotary_and_store", &rotary_and_store, "rotate q and k in place (Qwen3: norm each head first), store k and v");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(gate) * up");
  m.def("argmax_rows", &argmax_rows, "the index of each row's largest value, as torch.argmax(x, dim=-1)");
  m.def("paged_attention", &paged_attention, "every row of a step attending through its block table, causally");
  m.def("store_kv", &store_kv, "each token's K and V into its slot, in the kernels' order within a block");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bfloat16 weight in the layout linear_bf16 reads");
  m.def("linear_bf16_silu_mul", &linear_bf16_silu_mul, "SiLU(gate) * up of a packed gate_up projection, in one pass");
  m.def("linear_bf16", &linear_bf16, "x W^T + b on AVX512-BF16's dot-product instruction");
  m.attr("has_avx512_bf16") = bool(NP_HAS_AVX512_BF16);
  m.def("pack_quantized", &pack_quantized, "4- or 8-bit codes with their block scales, in linear_quantized's layout");
  m.def("linear_quantized", &linear_quantized, "x W^T for W in 4 or 8 bits, widened in registers");
#if defined(__AVX512F__)
  m.attr("has_avx512") = true;
#else
  m.attr("has_avx512") = false;
#endif
  namespace py = pybind11;
  // module_local: the tests load a second build of this file (without AVX-512) beside the first
  py::class_<Linear, std::shared_ptr<Linear>>(m, "Linear", py::module_local())
      .def(py::init<>())
      .def_readwrite("kind", &Linear::kind).def_readwrite("out_features", &Linear::out_features)
      .def_readwrite("packed", &Linear::packed).def_readwrite("bias", &Linear::bias)
      .def_readwrite("group", &Linear::group).def_readwrite("bits", &Linear::bits)
      .def_readwrite("rows_max", &Linear::rows_max).def_readwrite("dense", &Linear::dense)
      .def_readwrite("fn", &Linear::fn)
      .def("__call__", &Linear::operator());
  py::class_<Layer>(m, "Layer", py::module_local())
      .def(py::init<>())
      .def_readwrite("input_norm", &Layer::input_norm).def_readwrite("post_norm", &Layer::post_norm)
      .def_readwrite("q_norm", &Layer::q_norm).def_readwrite("k_norm", &Layer::k_norm)
      .def_readwrite("qkv", &Layer::qkv).def_readwrite("o", &Layer::o)
      .def_readwrite("gate_up", &Layer::gate_up).def_readwrite("down", &Layer::down);
  py::class_<Decoder>(m, "Decoder", py::module_local())
      .def(py::init<>())
      .def_readwrite("layers", &Decoder::layers).def_readwrite("heads", &Decoder::heads)
      .def_readwrite("kv_heads", &Decoder::kv_heads).def_readwrite("head_dim", &Decoder::head_dim)
      .def_readwrite("eps", &Decoder::eps).def_readwrite("qk_eps", &Decoder::qk_eps)
      .def_readwrite("scale", &Decoder::scale);
  m.def("decoder_forward", &decoder_forward, "every decoder layer of one step, in C++");
}
