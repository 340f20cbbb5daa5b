// The one-row loops that more than one file runs inside its own loop: RMSNorm of a row (norms.cpp,
// and rotary_kv.cpp over each q and k head for Qwen3) and SiLU(gate) * up of a row
// (activations.cpp, and linear_bf16.cpp as its gate/up projection's epilogue). Here, inline, so
// each caller's loop compiles them in place instead of calling out once per row.
#pragma once

#include "vec16.h"

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

// ---- SiLU(gate) * up ----------------------------------------------------------------------
// One row: SiLU of the gate's I values times the up's, SiLU rounded to T before the product as
// the reference's two ops round it.
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
