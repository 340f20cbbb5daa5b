// One decode token of a hybrid model's linear layers, in place on each request's state page: the gated
// delta rule (Qwen3.5), Mamba-2's recurrence (Granite 4.0-H) and the short convolution before either. The
// torch references
// (models/gated_delta_rule.py: paged_recurrent_step, models/mamba2.py: paged_ssd_step) gather every
// request's state, make a new tensor for each of five elementwise steps and scatter it back: ten passes
// over a state that is far larger than the token (16 heads x 128 x 128 float32 = 1 MB a layer). Here each
// (request, head) state is read once and written once, while it sits in the core's cache, and each is
// computed alone: a request's result never depends on the others in the step.
#include "ops.h"
#include "vec16.h"

#include <cmath>

namespace {

// The rows a state page holds, checked once: (pages, heads, a, b) float32, each page's (a, b) contiguous.
void check_pages(const torch::Tensor& pages, int64_t heads, const char* what) {
  TORCH_CHECK(pages.dim() == 4 && pages.scalar_type() == torch::kFloat && pages.size(1) == heads &&
                  pages.stride(3) == 1 && pages.stride(2) == pages.size(3) && pages.stride(1) == pages.size(2) * pages.size(3),
              what, ": state pages must be (pages, heads, a, b) float32 with each page's heads contiguous");
}

}  // namespace

// q, k (R, H, dk) (q and k unit length, q scaled), v (R, H, dv), g, beta (R, H): all float32 and
// contiguous. state (pages, H, dk, dv); index (R,) int64 the page of each row; fresh (R,) bool: start at 0.
// S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q.  Returns o (R, H, dv).
torch::Tensor gated_delta_step(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                               torch::Tensor beta, torch::Tensor state, torch::Tensor index, torch::Tensor fresh) {
  const int64_t R = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  check_pages(state, H, "gated_delta_step");
  TORCH_CHECK(state.size(2) == dk && state.size(3) == dv && q.is_contiguous() && k.is_contiguous() &&
                  v.is_contiguous() && g.is_contiguous() && beta.is_contiguous(),
              "gated_delta_step: q, k (R, H, dk), v (R, H, dv), g, beta (R, H), contiguous float32");
  auto out = torch::empty({R, H, dv}, v.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  float *sp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t page = state.stride(0), head = dk * dv;
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> predicted(dv);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H;
      float* S = sp + ip[r] * page + h * head;
      const float *qr = qp + rh * dk, *kr = kp + rh * dk, *vr = vp + rh * dv;
      float* o = op + rh * dv;
      if (fp[r]) std::fill(S, S + head, 0.0f);
      const float decay = std::exp(gp[rh]), b = bp[rh];
      // S^T k after the decay: a sum down the key dim, vectorised across the value dim
      std::fill(predicted.begin(), predicted.end(), 0.0f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = kr[i] * decay;
        const float* row = S + i * dv;
        for (int64_t j = 0; j < dv; ++j) predicted[j] += row[j] * ki;
      }
      for (int64_t j = 0; j < dv; ++j) predicted[j] = b * (vr[j] - predicted[j]);     // now the write, delta
      std::fill(o, o + dv, 0.0f);
      for (int64_t i = 0; i < dk; ++i) {
        const float ki = kr[i], qi = qr[i];
        float* row = S + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          row[j] = row[j] * decay + ki * predicted[j];
          o[j] += row[j] * qi;
        }
      }
    }
  });
  return out;
}

// x (R, H, P), dt (R, H), B, C (R, H, N), all float32 contiguous; A, D (H,); state (pages, H, P, N); index,
// fresh as above. h <- exp(dt A) h + dt x B^T; y = h C + D x.  Returns y (R, H, P).
torch::Tensor ssd_step(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
                       torch::Tensor D, torch::Tensor state, torch::Tensor index, torch::Tensor fresh) {
  const int64_t R = x.size(0), H = x.size(1), P = x.size(2), N = B.size(2);
  check_pages(state, H, "ssd_step");
  TORCH_CHECK(state.size(2) == P && state.size(3) == N && x.is_contiguous() && dt.is_contiguous() &&
                  B.is_contiguous() && C.is_contiguous() && A.is_contiguous() && D.is_contiguous(),
              "ssd_step: x (R, H, P), dt (R, H), B, C (R, H, N), A, D (H,), contiguous float32");
  auto out = torch::empty({R, H, P}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  float *sp = state.data_ptr<float>(), *yp = out.data_ptr<float>();
  const int64_t page = state.stride(0), head = P * N;
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H;
      float* S = sp + ip[r] * page + h * head;
      if (fp[r]) std::fill(S, S + head, 0.0f);
      const float step = dtp[rh], decay = std::exp(step * Ap[h]);
      const float *xr = xp + rh * P, *Br = Bp + rh * N, *Cr = Cp + rh * N;
      for (int64_t p = 0; p < P; ++p) {
        const float in = step * xr[p];
        float* row = S + p * N;
        float y = 0.0f;
        for (int64_t n = 0; n < N; ++n) {
          row[n] = row[n] * decay + in * Br[n];
          y += row[n] * Cr[n];
        }
        yp[rh * P + p] = y + Dp[h] * xr[p];
      }
    }
  });
  return out;
}

// The short causal convolution of one decode token per request, then SiLU, in place on its page: x (R, C)
// float32 contiguous, weight (C, K) float32, bias (C,) or empty; state (pages, C, K-1) float32, each page's
// (C, K-1) contiguous: the last K-1 inputs. y = silu(bias + sum_j weight[:, j] window[:, j]), window = the
// state then x; the state moves one input along. Returns y (R, C) float32.
torch::Tensor conv_step(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, torch::Tensor state,
                        torch::Tensor index, torch::Tensor fresh) {
  const int64_t R = x.size(0), C = x.size(1), K = weight.size(1), W = K - 1;
  TORCH_CHECK(state.dim() == 3 && state.size(1) == C && state.size(2) == W && state.stride(2) == 1 &&
                  state.stride(1) == W && x.is_contiguous() && weight.is_contiguous() &&
                  (bias.numel() == 0 || bias.numel() == C),
              "conv_step: x (R, C), weight (C, K), bias (C,) or empty, state (pages, C, K - 1) float32");
  auto out = torch::empty({R, C}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  float *sp = state.data_ptr<float>(), *yp = out.data_ptr<float>();
  const int64_t page = state.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* S = sp + ip[r] * page;
      if (fp[r]) std::fill(S, S + C * W, 0.0f);
      for (int64_t c = 0; c < C; ++c) {
        float* s = S + c * W;
        const float* w = wp + c * K;
        const float in = xp[r * C + c];
        float y = bp ? bp[c] : 0.0f;
        for (int64_t j = 0; j < W; ++j) y += w[j] * s[j];
        y += w[W] * in;
        for (int64_t j = 0; j + 1 < W; ++j) s[j] = s[j + 1];
        if (W > 0) s[W - 1] = in;
        yp[r * C + c] = y / (1.0f + std::exp(-y));
      }
    }
  });
  return out;
}
