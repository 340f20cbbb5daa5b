// The linears on AMX's tiles (Intel Xeons since Sapphire Rapids): bfloat16, y = x W^T (+ b), each
// row's sums in an order that depends on that row alone; and W8A8's integer sums on the int8 tiles.
// A build without AMX has the names only, each raising (Python chooses another linear there).
#include "ops.h"
#include "quantized_rows.h"
#include "vec16.h"

// ---- why a kernel of our own ----------------------------------------------------------------------
// oneDNN drives these tiles faster than anything else in torch, but it picks its blocking from the
// call's shape, and on some shapes (the 49,152-feature lm_head) a row's bits change with the number
// of rows beside it. Here a row's sums never depend on them: a tile register holds 16 rows x 16
// features of float32 sums, and one TDPBF16PS adds to every one of them the products of 32 inputs
// (16 pairs) of its row and its feature. Each sum runs down K in steps of 32, in order, from zero:
// the same steps whether its row is alone or one of 300, and whichever thread runs it (threads
// split the features, never K). Rows are independent lanes of the tile, so fewer rows only leave
// lanes unused.
//
// Eight tile registers: four sums (2 row tiles x 2 feature tiles: 32 rows x 32 features), two row
// tiles of x (16 rows x 32 inputs, read straight from x's rows) and two of the weight. The weight is
// packed once, at load, into what a weight tile reads: per block of 32 features and step of 32
// inputs, two 1 KB tiles of 16 pairs of inputs x 16 features x 2, so each tile is one contiguous read.
#if defined(__AMX_TILE__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>

static constexpr int64_t kBlockN = 32, kTileBytes = 1024;

// Linux hands AMX's 8 KB of tile state to a process only when asked (arch_prctl, once per process).
static bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// The tiles' shapes (ldtilecfg's 64-byte record): tiles 0-3 the sums, 4-5 rows of x, 6-7 the weight.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `top` rows in the first row tile, `bottom` (0-16) in the second.
static void configure(int64_t top, int64_t bottom) {
  TileConfig c;
  for (int t : {0, 1, 4}) c.rows[t] = uint8_t(top), c.colsb[t] = 64;
  if (bottom)
    for (int t : {2, 3, 5}) c.rows[t] = uint8_t(bottom), c.colsb[t] = 64;
  for (int t : {6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  // an asm that names c as what it reads: GCC 12 dropped the stores above before _tile_loadconfig
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// Up to 32 rows of x (x_stride bytes apart) times one block of 32 features, 64 bytes of each row a step
// (32 bfloat16 inputs, or 64 int8 ones) against two 1 KB weight tiles, each step's products added by
// Dot's instruction (rows in tiles 4-5, weights in 6-7, sums in 0-3): the 32 x 32 sums (float32 or
// int32), 128 bytes a row, into c.
template <typename Dot, bool TWO_ROW_TILES>
static inline void amx_tiles(const uint8_t* x, int64_t x_stride, int64_t row_bytes, const uint8_t* w, uint8_t* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO_ROW_TILES) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < row_bytes; k += 64, w += 2 * kTileBytes) {
    _tile_loadd(4, x + k, x_stride);
    if constexpr (TWO_ROW_TILES) _tile_loadd(5, x + 16 * x_stride + k, x_stride);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileBytes, 64);
    Dot::template add<TWO_ROW_TILES>();
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 64, 128);
  if constexpr (TWO_ROW_TILES) {
    _tile_stored(2, c + 16 * 128, 128);
    _tile_stored(3, c + 16 * 128 + 64, 128);
  }
}

template <typename Dot>
static inline void amx_block(const uint8_t* x, int64_t x_stride, int64_t row_bytes, const uint8_t* w, int64_t rows,
                             uint8_t* c) {
  if (rows > 16)
    amx_tiles<Dot, true>(x, x_stride, row_bytes, w, c);
  else
    amx_tiles<Dot, false>(x, x_stride, row_bytes, w, c);
}

// Threads split the `blocks` of 32 features; each runs every group of 32 rows over its blocks, so its
// share of the weight is read from memory once and from its cache for the groups after the first:
// body(first row, rows, block), the tiles configured for the group's rows.
template <typename Body>
static void over_row_groups(int64_t M, int64_t blocks, const Body& body) {
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = 0; m < M; m += 32) {
      const int64_t rows = std::min<int64_t>(32, M - m);
      configure(std::min<int64_t>(16, rows), std::max<int64_t>(0, rows - 16));
      for (int64_t nb = b; nb < e; ++nb) body(m, rows, nb);
    }
    _tile_release();
  });
}

#endif

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
static constexpr int64_t kStepK = 32;

torch::Tensor pack_amx_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % kStepK == 0,
              "pack_amx_weight: w must be bfloat16 (out_features, in_features), in_features a multiple of 32");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kBlockN - 1) / kBlockN;
  // (block, step of K, feature tile, pair of inputs, feature, 2): features past N stay 0
  auto out = torch::zeros({blocks, K / kStepK, 2, kStepK / 2, 16, 2}, w.options());
  auto src = w.contiguous();
  const bf16* sp = src.data_ptr<bf16>();
  bf16* dp = out.data_ptr<bf16>();
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb)
      for (int64_t f = 0; f < kBlockN && nb * kBlockN + f < N; ++f)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t step = k / kStepK, pair = (k % kStepK) / 2;
          dp[((((nb * (K / kStepK) + step) * 2 + f / 16) * (kStepK / 2) + pair) * 16 + f % 16) * 2 + k % 2] =
              sp[(nb * kBlockN + f) * K + k];
        }
  });
  return out;
}

struct DotBf16 {                  // TDPBF16PS: 16 pairs of bfloat16 products into each float32 sum
  template <bool TWO_ROW_TILES>    // the tile numbers are literals: GCC's tile intrinsics spell them in asm
  static void add() {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO_ROW_TILES) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};

// The sums (+ bias), rounded once to bfloat16 (nearest even), into y's `width` columns of `rows` rows.
static inline void store_rows(const float* c, int64_t rows, const float* bias, bf16* y, int64_t y_row, int64_t width) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < kBlockN && j < width; j += 16) {
      __m512 v = _mm512_loadu_ps(c + r * kBlockN + j);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
      const __mmask16 keep = width - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - j)) - 1);
      _mm256_mask_storeu_epi16(y + r * y_row + j, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// x (rows, K) bfloat16 with unit stride in K; packed from pack_amx_weight; bias (N,) or empty.
torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t N) {
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 6 &&
              packed.size(1) * kStepK == x.size(1) && packed.size(0) * kBlockN >= N,
              "linear_amx: x must be bfloat16 (rows, in_features) matching the packed weight");
  TORCH_CHECK(amx_permitted(), "linear_amx: Linux did not grant this process AMX's tile state (arch_prctl)");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), x_row = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  std::vector<float> bias_f;
  if (bias.defined() && bias.numel()) {
    bias_f.assign(blocks * kBlockN, 0.f);
    auto b = bias.to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + N, bias_f.begin());
  }
  const uint8_t* xp = reinterpret_cast<const uint8_t*>(x.data_ptr<bf16>());
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr<bf16>());
  bf16* yp = y.data_ptr<bf16>();
  const int64_t x_stride = x_row * int64_t(sizeof(bf16)), block_bytes = K / kStepK * 2 * kTileBytes;
  over_row_groups(M, blocks, [&](int64_t m, int64_t rows, int64_t nb) {
    alignas(64) float c[kBlockN * kBlockN];
    amx_block<DotBf16>(xp + m * x_stride, x_stride, K * int64_t(sizeof(bf16)), wp + nb * block_bytes, rows,
                       reinterpret_cast<uint8_t*>(c));
    store_rows(c, rows, bias_f.empty() ? nullptr : bias_f.data() + nb * kBlockN, yp + m * N + nb * kBlockN, N,
               std::min(kBlockN, N - nb * kBlockN));
  });
  return y;
}
#else
torch::Tensor pack_amx_weight(torch::Tensor) { TORCH_CHECK(false, "built without AMX-BF16"); }
torch::Tensor linear_amx(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "built without AMX-BF16");
}
#endif

// ---- W8A8 on the int8 tiles ------------------------------------------------------------------------
// TDPBSSD adds to each of a tile's 16 x 16 int32 sums the products of 64 signed bytes of its row and
// its feature: twice the multiply-adds of a TDPBF16PS. The row is quantized per token (quantized_rows.h,
// G = K: codes xq and one scale dx), the weight per output feature (codes q, scale d), so each output is
// one exact integer sum over the whole row, scaled once: y = sum(q xq) (d dx). Exact sums have no order:
// these are the bits of linear_quantized's VNNI kernel with one block the row's length, at any row count.
// The packed weight: per block of 32 features and step of 64 inputs, two 1 KB tiles (16 quads of inputs
// x 16 features x 4 bytes), then the N scales d as float32.
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
static constexpr int64_t kStepK8 = 64;

torch::Tensor pack_amx_int8(torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) % kStepK8 == 0 && scale.numel() == codes.size(0),
              "pack_amx_int8: codes (out_features, in_features), in_features a multiple of 64; scale (out_features,)");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = (N + kBlockN - 1) / kBlockN;
  const int64_t code_bytes = blocks * (K / kStepK8) * 2 * kTileBytes;
  auto out = torch::zeros({code_bytes + N * int64_t(sizeof(float))}, codes.options().dtype(at::kByte));
  auto c = codes.to(at::kInt).contiguous();
  auto d = scale.to(at::kFloat).contiguous();
  const int32_t* cp = c.data_ptr<int32_t>();
  int8_t* op = reinterpret_cast<int8_t*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb)
      for (int64_t f = 0; f < kBlockN && nb * kBlockN + f < N; ++f)
        for (int64_t k = 0; k < K; ++k)
          op[(((nb * (K / kStepK8) + k / kStepK8) * 2 + f / 16) * 16 + (k % kStepK8) / 4) * 64 + (f % 16) * 4 + k % 4] =
              int8_t(cp[(nb * kBlockN + f) * K + k]);
  });
  std::memcpy(out.data_ptr<uint8_t>() + code_bytes, d.data_ptr<float>(), N * sizeof(float));
  return out;
}

struct DotInt8 {                  // TDPBSSD: 64 products of signed bytes into each int32 sum
  template <bool TWO_ROW_TILES>
  static void add() {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if constexpr (TWO_ROW_TILES) {
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
};

// y = sum (d dx), in linear_quantized's instructions (a multiply, then a fused multiply-add onto zero),
// so the compiler cannot reorder the product (-fassociative-math) and the bits are its kernel's.
template <typename T>
static inline void store_scaled(const int32_t* c, int64_t rows, const float* dx, const float* d, T* y, int64_t y_row,
                                int64_t width) {
  alignas(64) float out[16];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 keep = width - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - j)) - 1);
      const __m512 scale = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, d + j), _mm512_set1_ps(dx[r]));
      const __m512 sums = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * kBlockN + j));
      _mm512_store_ps(out, _mm512_fmadd_ps(sums, scale, _mm512_setzero_ps()));
      for (int64_t i = 0; i < std::min<int64_t>(16, width - j); ++i) y[r * y_row + j + i] = T(out[i]);
    }
}

template <typename T>
static void amx_int8_rows(const T* x, int64_t x_row, int64_t M, int64_t K, const uint8_t* wp, const float* d, int64_t N,
                          T* y) {
  const QuantizedRows q = quantize_rows(x, x_row, M, K, K);
  const int64_t blocks = (N + kBlockN - 1) / kBlockN, block_bytes = K / kStepK8 * 2 * kTileBytes;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(q.xq.data());
  over_row_groups(M, blocks, [&](int64_t m, int64_t rows, int64_t nb) {
    alignas(64) int32_t c[kBlockN * kBlockN];
    amx_block<DotInt8>(xq + m * K, K, K, wp + nb * block_bytes, rows, reinterpret_cast<uint8_t*>(c));
    store_scaled(c, rows, q.dx.data() + m, d + nb * kBlockN, y + m * N + nb * kBlockN, N,
                 std::min(kBlockN, N - nb * kBlockN));
  });
}

// x (M, K) in the model's dtype, unit stride in K; packed from pack_amx_int8: y (M, N) in x's dtype.
torch::Tensor linear_amx_int8(torch::Tensor x, torch::Tensor packed, int64_t N) {
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + kBlockN - 1) / kBlockN;
  const int64_t code_bytes = blocks * (K / kStepK8) * 2 * kTileBytes;
  TORCH_CHECK(x.dim() == 2 && K % kStepK8 == 0 && packed.numel() == code_bytes + N * int64_t(sizeof(float)),
              "linear_amx_int8: x's in_features do not match the packed weight");
  TORCH_CHECK(amx_permitted(), "linear_amx_int8: Linux did not grant this process AMX's tile state (arch_prctl)");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* d = reinterpret_cast<const float*>(packed.data_ptr<uint8_t>() + code_bytes);
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "linear_amx_int8", [&] {
    amx_int8_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), M, K, wp, d, N, y.data_ptr<scalar_t>());
  });
  return y;
}
#else
torch::Tensor pack_amx_int8(torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "built without AMX-INT8"); }
torch::Tensor linear_amx_int8(torch::Tensor, torch::Tensor, int64_t) { TORCH_CHECK(false, "built without AMX-INT8"); }
#endif
