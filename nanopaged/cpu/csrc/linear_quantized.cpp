// The 4- and 8-bit weight-only linears: GGUF's blocks (or the checkpoint's, quantized at load)
// packed once into one stream per tile of output features, and widened in registers just before
// they are multiplied. AVX-512 runs the tiles; a build without it has plain loops that give the
// same sums (Python prefers torch's int4 and int8 kernels there: nanopaged/cpu/quantized_linear.py).
#include "ops.h"
#include "vec16.h"

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
// sums rounded once to x's dtype. Rows go up to kQRows at a time, each tile's codes unpacked once
// for all of them; each tile streams its weights once. A row's sums run in the same order whatever
// the tile of rows it shares (the batch-invariant path runs this at every row count). One step
// calls this 120 times for weights of a few hundred kilobytes, so nothing is allocated but y.
static constexpr int64_t kQRows = 6;      // 6 x 2 sums and 6 x 2 block parts + 4 operands: 28 of 32 registers
template <typename T>
static void quantized_rows(const T* x, int64_t x_row, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int64_t G,
                           int bits, T* y) {
  const int64_t blocks = K / G, Tw = q_tile(bits), tiles = (N + Tw - 1) / Tw, bb = q_block_bytes(G, bits);
  std::vector<float> xf(M * K), sx(M * blocks, 0.f);          // the rows in float32; their sums per block
  at::parallel_for(0, M, grain(K), [&](int64_t rb, int64_t re) {     // a prompt's rows: on every thread
    for (int64_t r = rb; r < re; ++r)
      for (int64_t i = 0; i < K; ++i) {
        xf[r * K + i] = float(x[r * x_row + i]);
        sx[r * blocks + i / G] += xf[r * K + i];
      }
  });
  // a thread takes at least ~32 KB of weights: smaller shares cost more to hand out than to read
  at::parallel_for(0, tiles, std::max<int64_t>(1, 32 * 1024 / (blocks * bb)), [&](int64_t tb, int64_t te) {
    float out[kQRows * kQ4Tile];
    for (int64_t t = tb; t < te; ++t) {
      const uint8_t* tile = wp + t * blocks * bb;
      const int64_t width = std::min(Tw, N - t * Tw);
      for (int64_t r = 0; r < M; r += kQRows) {
        const int64_t rows = std::min<int64_t>(kQRows, M - r);
        const float *xr = xf.data() + r * K, *sr = sx.data() + r * blocks;
#if defined(__AVX512F__)
        constexpr bool pairs = std::is_same_v<T, bf16> && NP_HAS_AVX512_BF16;
        const void* x4 = pairs ? static_cast<const void*>(x + r * x_row) : static_cast<const void*>(xr);
        const int64_t row4 = pairs ? x_row / 2 : K;
#define NP_QTILE(MT) (bits == 4 ? q4_tile<MT, pairs>(x4, row4, sr, tile, K, G, out, Tw) \
                               : q8_tile<MT>(xr, K, tile, K, G, out, Tw))
        switch (rows) {
          case 6: NP_QTILE(6); break;
          case 5: NP_QTILE(5); break;
          case 4: NP_QTILE(4); break;
          case 3: NP_QTILE(3); break;
          case 2: NP_QTILE(2); break;
          default: NP_QTILE(1);
        }
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
