// The 4- and 8-bit linears: GGUF's blocks (or the checkpoint's, quantized at load) packed once into
// one stream per tile of output features, multiplied as integers by the rows quantized to 8 bits
// (AVX512-VNNI's VPDPBUSD), the way llama.cpp's Q8 dot products and vLLM's CPU int8 kernels do.
// A build without VNNI has plain loops that give the same bits (Python prefers torch's weight-only
// int4 and int8 kernels there: nanopaged/cpu/quantized_linear.py).
#include "ops.h"
#include "quantized_rows.h"
#include "vec16.h"

// ---- why integers ------------------------------------------------------------------------------
// A decode step streams every weight once, so the weights stay in the bits they ship in (GGUF's
// Q4_1: 4 bits a weight plus a float16 scale d and minimum m per block of G = 32 inputs, w = q d + m;
// Q8_0: 8 bits and d, w = q d). Widening them to floats costs instructions that a step of many rows
// pays once per row; quantizing each row instead, per block of G inputs, to x = dx xq with xq in
// -127..127 (the block's largest |x| mapped to 127), makes a block's products exact integer sums,
// 64 of them per VPDPBUSD:
//   4-bit:  sum_i (q_i d + m) x_i = d dx sum_i q_i xq_i + m dx sum_i xq_i
//   8-bit:  sum_i q_i d x_i       = d dx (sum_i (q_i + 128) xq_i - 128 sum_i xq_i)
// (VPDPBUSD multiplies unsigned bytes by signed ones: 8-bit codes are stored as q + 128.) A row is
// quantized alone and its blocks are summed in one order, so its result is the same bits at every
// row count (the batch-invariance tests hold it).
//
// Layout, packed once at load: tiles of 16 output features, one stream per tile; per block of G
// inputs, the codes in chunks of 64 bytes, then the 16 features' d (float16), and for 4 bits their m.
// Bytes 4f .. 4f + 3 of a chunk belong to feature f: one 32-bit lane of a register, VPDPBUSD's unit.
//   8-bit: chunk c holds inputs 4c .. 4c + 3 (G / 4 chunks)
//   4-bit: chunk c holds inputs 8c .. 8c + 3 in the low nibbles, 8c + 4 .. 8c + 7 in the high (G / 8)
static constexpr int64_t kTile = 16;

static int64_t q_block_bytes(int64_t G, int bits) { return bits == 4 ? 8 * G + 64 : 16 * G + 32; }
static int64_t q_meta_offset(int64_t G, int bits) { return bits == 4 ? 8 * G : 16 * G; }

// Where the code of feature f (0..15), input k (0..G-1) of a block lies: (byte, nibble shift).
static inline std::pair<int64_t, int> q_position(int64_t f, int64_t k, int bits) {
  if (bits == 8) return {(k / 4) * 64 + 4 * f + k % 4, 0};
  return {(k / 8) * 64 + 4 * f + k % 4, (k / 4) % 2 ? 4 : 0};
}

// codes (N, K) integers (4-bit: 0..15; 8-bit: -128..127), d and m (N, K / G) float (m: 4-bit only):
// the packed bytes.
torch::Tensor pack_quantized(torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t G, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_quantized: bits must be 4 or 8");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(G % 16 == 0 && K % G == 0 && d.size(0) == N && d.size(1) == K / G &&
              (bits == 8 || (m.size(0) == N && m.size(1) == K / G)),
              "pack_quantized: codes (N, K), d and m (N, K / G), G a multiple of 16 dividing K");
  const int64_t tiles = (N + kTile - 1) / kTile, blocks = K / G, bb = q_block_bytes(G, bits);
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
        fp16* meta = reinterpret_cast<fp16*>(blk + q_meta_offset(G, bits));
        for (int64_t f = 0; f < kTile && t * kTile + f < N; ++f) {
          const int64_t n = t * kTile + f;
          const int32_t* row = cp + n * K + b * G;
          for (int64_t k = 0; k < G; ++k) {
            const auto [byte, shift] = q_position(f, k, int(bits));
            blk[byte] |= bits == 4 ? uint8_t((row[k] & 15) << shift) : uint8_t(row[k] + 128);
          }
          meta[f] = fp16(dp[n * blocks + b]);
          if (bits == 4) meta[kTile + f] = fp16(mp[n * blocks + b]);
        }
      }
  });
  return out;
}

// ---- one tile of 16 features times MT rows --------------------------------------------------------
// A block's integer sum per row and feature, then in float32: y += sum (d dx) [+ m (dx sum xq)].
#if defined(__AVX512VNNI__)
template <int MT, int BITS>
static inline void q_tile(const QuantizedRows& q, int64_t r0, int64_t K, int64_t G, const uint8_t* tile, float* out) {
  const int64_t blocks = K / G, bb = q_block_bytes(G, BITS);
  __m512 acc[MT];
  NP_UNROLL
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * bb;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * bb), _MM_HINT_T0);
    __m512i part[MT];
    NP_UNROLL
    for (int m = 0; m < MT; ++m) part[m] = _mm512_setzero_si512();
    const int8_t* xb = q.xq.data() + r0 * K + b * G;
    for (int64_t c = 0; c < G / (BITS == 4 ? 8 : 4); ++c) {
      const __m512i w = _mm512_loadu_si512(blk + 64 * c);
      if constexpr (BITS == 8) {
        NP_UNROLL
        for (int m = 0; m < MT; ++m) {
          const int32_t* x4 = reinterpret_cast<const int32_t*>(xb + m * K + 4 * c);
          part[m] = _mm512_dpbusd_epi32(part[m], w, _mm512_set1_epi32(x4[0]));
        }
      } else {
        const __m512i nib = _mm512_set1_epi8(0x0F);
        const __m512i lo = _mm512_and_si512(w, nib), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
        NP_UNROLL
        for (int m = 0; m < MT; ++m) {
          const int32_t* x8 = reinterpret_cast<const int32_t*>(xb + m * K + 8 * c);
          part[m] = _mm512_dpbusd_epi32(part[m], lo, _mm512_set1_epi32(x8[0]));
          part[m] = _mm512_dpbusd_epi32(part[m], hi, _mm512_set1_epi32(x8[1]));
        }
      }
    }
    const uint8_t* meta = blk + q_meta_offset(G, BITS);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    const __m512 mins = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)))
                                  : _mm512_setzero_ps();          // 4-bit: the block's minimum m per feature
    NP_UNROLL
    for (int m = 0; m < MT; ++m) {
      const int64_t i = (r0 + m) * blocks + b;
      __m512i sums = part[m];
      if constexpr (BITS == 8) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * q.sum[i]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(d, _mm512_set1_ps(q.dx[i])), acc[m]);
      if constexpr (BITS == 4) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(q.dx_sum[i]), acc[m]);
    }
  }
  NP_UNROLL
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * kTile, acc[m]);
}
#endif

// Plain loops, for a build without VNNI: the same integer sums and the same float32 steps, row by row.
static void q_tile_any(const QuantizedRows& q, int64_t r0, int64_t rows, int64_t K, int64_t G, int bits,
                       const uint8_t* tile, float* out) {
  const int64_t blocks = K / G, bb = q_block_bytes(G, bits);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t f = 0; f < kTile; ++f) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = tile + b * bb;
        const fp16* meta = reinterpret_cast<const fp16*>(blk + q_meta_offset(G, bits));
        const int8_t* x = q.xq.data() + (r0 + r) * K + b * G;
        const int64_t i = (r0 + r) * blocks + b;
        int32_t sum = 0;
        for (int64_t k = 0; k < G; ++k) {
          const auto [byte, shift] = q_position(f, k, bits);
          sum += int32_t((blk[byte] >> shift) & (bits == 4 ? 15 : 255)) * x[k];
        }
        if (bits == 8) sum -= 128 * q.sum[i];
        acc = std::fma(float(sum), float(meta[f]) * q.dx[i], acc);
        if (bits == 4) acc = std::fma(float(meta[kTile + f]), q.dx_sum[i], acc);
      }
      out[r * kTile + f] = acc;
    }
}

// x (M, K) in the model's dtype, unit stride in K; packed from pack_quantized: y (M, N), float32
// sums rounded once to x's dtype. Each tile streams its weights once for all the rows, kQRows at a
// time (its codes stay in L1 between them). One step calls this 120 times for weights of a few
// hundred kilobytes, so nothing is allocated but y and the quantized rows.
static constexpr int64_t kQRows = 12;      // 12 integer sums + 12 float sums + operands: 28 of 32 registers
template <typename T>
static void quantized_rows(const T* x, int64_t x_row, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int64_t G,
                           int bits, T* y) {
  const int64_t blocks = K / G, tiles = (N + kTile - 1) / kTile, bb = q_block_bytes(G, bits);
  const QuantizedRows q = quantize_rows(x, x_row, M, K, G);
  // a thread takes at least ~32 KB of weights: smaller shares cost more to hand out than to read
  at::parallel_for(0, tiles, std::max<int64_t>(1, 32 * 1024 / (blocks * bb)), [&](int64_t tb, int64_t te) {
    float out[kQRows * kTile];
    for (int64_t t = tb; t < te; ++t) {
      const uint8_t* tile = wp + t * blocks * bb;
      const int64_t width = std::min(kTile, N - t * kTile);
      for (int64_t r = 0; r < M; r += kQRows) {
        const int64_t rows = std::min<int64_t>(kQRows, M - r);
#if defined(__AVX512VNNI__)
#define NP_QTILE(MT) (bits == 4 ? q_tile<MT, 4>(q, r, K, G, tile, out) : q_tile<MT, 8>(q, r, K, G, tile, out))
        switch (rows) {
          case 12: NP_QTILE(12); break;
          case 11: NP_QTILE(11); break;
          case 10: NP_QTILE(10); break;
          case 9: NP_QTILE(9); break;
          case 8: NP_QTILE(8); break;
          case 7: NP_QTILE(7); break;
          case 6: NP_QTILE(6); break;
          case 5: NP_QTILE(5); break;
          case 4: NP_QTILE(4); break;
          case 3: NP_QTILE(3); break;
          case 2: NP_QTILE(2); break;
          default: NP_QTILE(1);
        }
#undef NP_QTILE
#else
        q_tile_any(q, r, rows, K, G, bits, tile, out);
#endif
        for (int64_t j = 0; j < rows; ++j)
          for (int64_t f = 0; f < width; ++f) y[(r + j) * N + t * kTile + f] = T(out[j * kTile + f]);
      }
    }
  });
}

torch::Tensor linear_quantized(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t G, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && (bits == 4 || bits == 8), "linear_quantized: x (rows, in_features), 4 or 8 bits");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTile - 1) / kTile;
  TORCH_CHECK(G % 16 == 0 && K % G == 0 && packed.numel() == tiles * (K / G) * q_block_bytes(G, bits),
              "linear_quantized: x's in_features do not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "linear_quantized", [&] {
    quantized_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), M, K, packed.data_ptr<uint8_t>(), N, G, int(bits),
                             y.data_ptr<scalar_t>());
  });
  return y;
}
