// The rows of x quantized to 8 bits, per block of G inputs (G = K: one scale per token, W8A8): what
// the integer kernels multiply (linear_quantized.cpp on VNNI, linear_amx.cpp on AMX's int8 tiles).
// nanopaged/cpu/quantized_linear.py: quantize_activations is the reference.
#pragma once

#include "vec16.h"

// Per row and block of G inputs: the codes xq (int8), dx, and sum_i xq_i times dx (what m weighs).
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx, dx_sum;
  std::vector<int32_t> sum;
};

template <typename T>
static inline void quantize_block(const T* x, int64_t G, int8_t* xq, float& dx, float& dx_sum, int32_t& sum) {
  Vec16 amax = Vec16::fill(0.f);
  for (int64_t i = 0; i < G; i += 16) {
    const Vec16 v = Vec16::load(x + i);
    amax = max(amax, max(v, Vec16::fill(0.f) - v));
  }
  const float a = amax.max(), inv = a > 0.f ? 127.f / a : 0.f;
  Vec16 total = Vec16::fill(0.f);
  for (int64_t i = 0; i < G; i += 16) {
    const Vec16 q = round_nearest(Vec16::load(x + i) * Vec16::fill(inv));     // |q| <= 127: fits a byte
    total = total + q;
#if defined(__AVX512F__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q.v)));
#else
    for (int j = 0; j < 16; ++j) xq[i + j] = int8_t(q.v[j]);
#endif
  }
  dx = a / 127.f;
  sum = int32_t(total.sum());         // integers below 2^24: the float sum is exact
  dx_sum = dx * float(sum);
}

template <typename T>
static inline QuantizedRows quantize_rows(const T* x, int64_t x_row, int64_t M, int64_t K, int64_t G) {
  const int64_t blocks = K / G;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<float>(M * blocks),
                  std::vector<int32_t>(M * blocks)};
  at::parallel_for(0, M, grain(K), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = r * blocks + b;
        quantize_block(x + r * x_row + b * G, G, q.xq.data() + r * K + b * G, q.dx[i], q.dx_sum[i], q.sum[i]);
      }
  });
  return q;
}

