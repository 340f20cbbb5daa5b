// What every kernel file is written on: Vec16 (16 floats at a time, one AVX-512 register or an
// array the compiler splits into AVX2 halves), e^x on it, rounding to the model's dtype, and how
// finely a loop is split over threads. All inline here, so a kernel's inner loop calls nothing.
//
// Rounding: T is the model's dtype. Where the torch reference rounds an intermediate to T (a
// bfloat16 tensor between two ops), the kernel rounds it too (`round_to<T>`: round to nearest
// even, as torch does), so a norm, a rotation or a SiLU here gives the reference's values up to
// the order of a float32 sum and the last bit of an exp.
#pragma once

#include <torch/types.h>
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

static inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_row)); }

#define DISPATCH_MODEL_DTYPES(dtype, name, ...) \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// ---- 16 floats at a time ----------------------------------------------------------------------
// Every kernel is written once on Vec16: AVX-512 registers where the CPU has them, else an array
// of 16 floats whose loops the compiler turns into AVX2 (two 8-wide halves). Loads and stores
// convert from and to the model's dtype T; `round_to<T>` rounds a float to T's precision and
// keeps it a float (what a bfloat16 tensor between two torch ops holds).
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
