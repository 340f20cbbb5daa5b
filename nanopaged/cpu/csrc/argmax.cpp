// The sampler's argmax over each row of logits, 16 lanes at a time. Not a layer's op: the fused
// path hands it to the sampler (nanopaged/cpu/fused.py: argmax_rows).
#include "ops.h"
#include "vec16.h"

// ---- argmax of each row ----------------------------------------------------------------------
// A greedy step's last op: the index of each row's largest logit, as torch.argmax gives it (the
// first index of the largest value; a NaN counts as larger than any number, and the first NaN
// wins). torch's CPU argmax reads the logits slower than memory delivers them (measured: docs/05,
// "The sampler's argmax"); 16 lanes at a time it is the time to read the logits.
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
