// A mixture of experts' MLP, its experts grouped: what nanopaged/models/moe.py: SparseMoeBlock.forward
// computes after routing, for a whole step at once (nanopaged/cpu/moe.py routes and calls it).
//
// The reference asks, expert by expert, which tokens chose it (a scan of the step's choices per
// expert: 64 scans a layer for OLMoE) and gathers their rows. Here the step's (token, expert) pairs
// are sorted by expert once (a counting sort, stable, so each expert's tokens stay in ascending
// order as the reference takes them), their rows gathered once, and each expert that any token
// chose runs its gate/up projection with SiLU(gate) * up and its down projection once over its
// rows, on the kernels its linears name (decoder.h: Linear). The weighted sum back into each token
// is one pass over the tokens: a token's k outputs, each times its routing weight and rounded to
// the model's dtype, added in ascending expert order from zero, as the reference's index_add_
// adds them. A token's result depends on its own row and choices alone: the linears compute each
// row alone, and the sum's order is the token's own.
#include <algorithm>
#include "decoder.h"
#include "ops.h"
#include "vec16.h"

// SiLU(gate) * up of x's gate/up projection: the projection's epilogue where nanopaged's bfloat16
// kernel runs it (Linear::silu_mul), else torch's silu and mul, the reference's own two ops.
static torch::Tensor activated(const Linear& gate_up, const torch::Tensor& x) {
  if (gate_up.kind == LinearKind::DPBF16) return gate_up.silu_mul(x, {});
  auto gu = gate_up(x);
  const int64_t I = gu.size(1) / 2;
  return at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
}

// out[t] = sum over t's k choices, in ascending expert order, of round(ys[pos] * w[t, j]); every
// product and every partial sum rounded to T, as torch's mul (or Mixtral's float32 product and
// .to) and index_add_ round them. The products are scaled in place first, in a pass of their own:
// in float32 a product added in the same loop would be fused into one multiply-add, one rounding
// fewer than the reference's.
template <typename T, typename W>
static void weighted_sum(torch::Tensor& out, torch::Tensor& ys, const std::vector<int64_t>& pos,
                         const torch::Tensor& chosen, const torch::Tensor& weights) {
  const int64_t n = out.size(0), k = chosen.size(1), d = out.size(1);
  const int64_t* cp = chosen.data_ptr<int64_t>();
  const W* wp = weights.data_ptr<W>();
  T* yp = ys.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n, grain(k * d), [&](int64_t b, int64_t e) {
    std::vector<int64_t> js(k);
    for (int64_t t = b; t < e; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        T* y = yp + pos[t * k + j] * d;
        const float w = float(wp[t * k + j]);
        int64_t c = 0;
        for (; c + 16 <= d; c += 16) round_to<T>(Vec16::load(y + c) * Vec16::fill(w)).store(y + c);
        for (; c < d; ++c) y[c] = T(float(y[c]) * w);
        js[j] = j;
      }
      std::sort(js.begin(), js.end(), [&](int64_t x, int64_t y) { return cp[t * k + x] < cp[t * k + y]; });
      T* o = op + t * d;
      std::fill(o, o + d, T(0.f));
      for (int64_t j : js) {
        const T* y = yp + pos[t * k + j] * d;
        int64_t c = 0;
        for (; c + 16 <= d; c += 16) round_to<T>(Vec16::load(o + c) + Vec16::load(y + c)).store(o + c);
        for (; c < d; ++c) o[c] = T(float(o[c]) + float(y[c]));
      }
    }
  });
}

// x (tokens, hidden); chosen (tokens, k) int64 expert ids, distinct within a row; weights (tokens,
// k), in x's dtype or float32 (Mixtral's).
torch::Tensor Experts::operator()(const torch::Tensor& x, const torch::Tensor& chosen,
                                  const torch::Tensor& weights) const {
  const int64_t n = x.size(0), k = chosen.size(1), E = int64_t(gate_up.size());
  TORCH_CHECK(x.dim() == 2 && chosen.dim() == 2 && chosen.size(0) == n && chosen.scalar_type() == at::kLong &&
              chosen.is_contiguous() && weights.sizes() == chosen.sizes() && weights.is_contiguous() &&
              int64_t(down.size()) == E, "moe experts: x (tokens, hidden), chosen and weights (tokens, k)");
  const int64_t* cp = chosen.data_ptr<int64_t>();
  // counting sort of the n * k pairs by expert: start[e] is expert e's first row among them
  std::vector<int64_t> start(E + 1, 0), pos(n * k);
  for (int64_t i = 0; i < n * k; ++i) {
    TORCH_CHECK(cp[i] >= 0 && cp[i] < E, "moe experts: an expert id out of range");
    ++start[cp[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  auto tokens = torch::empty({n * k}, chosen.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * k; ++i) {       // pair i is (token i / k, its j-th choice): tokens ascending
    pos[i] = next[cp[i]]++;
    tp[pos[i]] = i / k;
  }
  auto xs = x.index_select(0, tokens);        // every pair's row, grouped by expert
  auto ys = torch::empty_like(xs);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;                  // an expert no token chose reads no weight
    ys.narrow(0, start[e], rows).copy_(down[e](activated(gate_up[e], xs.narrow(0, start[e], rows))));
  }
  auto out = torch::empty_like(x);
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "moe experts", [&] {
    if (weights.scalar_type() == at::kFloat) weighted_sum<scalar_t, float>(out, ys, pos, chosen, weights);
    else weighted_sum<scalar_t, scalar_t>(out, ys, pos, chosen, weights.to(x.scalar_type()));
  });
  return out;
}
