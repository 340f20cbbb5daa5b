// The bfloat16 linears, on AVX512-BF16's dot-product instruction: a weight packed once at load,
// y = x W^T (+ b), and the gate/up projection with SiLU(gate) * up as its epilogue. A build
// without AVX512-BF16 has the names only, each raising (Python chooses another linear there).
#include "ops.h"
#include "row_kernels.h"

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
// pass, 1-5 rows, is over before the next tile arrives: asking there made a step's linears slower.
// Measured both ways: docs/05, "nanopaged's own kernel where there is no AMX".)
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
