// RMSNorm over rows, and the residual add joined to the norm after it: a layer's two norms, one
// pass over each row. The row loop itself is rms_norm_row (row_kernels.h), which rotary_kv.cpp
// also runs over each q and k head.
#include "ops.h"
#include "row_kernels.h"

// x (rows, d) with unit stride in d: a new (rows, d) tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be (rows, d) with unit stride in d");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be (d,) contiguous, in x's dtype");
  const int64_t rows = x.size(0), d = x.size(1), row = x.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * row, wp, op + r * d, d, float(eps));
    });
  });
  return out;
}

// The residual add and the norm after it, in one pass: x = x + y rounded to T in place (the
// residual stream, rounded as the reference's add rounds it: a sum kept in float32 instead shifts
// greedy tokens at near ties), then a new tensor with RMSNorm(x). vLLM's fused_add_rms_norm.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.stride(1) == 1 && x.sizes() == y.sizes(),
              "add_rms_norm: x must be contiguous (rows, d) and y (rows, d) with unit stride in d");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "add_rms_norm: x and y in one dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be (d,) contiguous, in x's dtype");
  const int64_t rows = x.size(0), d = x.size(1), y_row = y.stride(0);
  auto out = torch::empty({rows, d}, x.options());
  DISPATCH_MODEL_DTYPES(x.scalar_type(), "add_rms_norm", [&] {
    using T = scalar_t;
    T* xp = x.data_ptr<T>();
    const T* yp = y.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t body = d - d % 16;
    at::parallel_for(0, rows, grain(d), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* xr = xp + r * d;
        const T* yr = yp + r * y_row;
        for (int64_t i = 0; i < body; i += 16) round_to<T>(Vec16::load(xr + i) + Vec16::load(yr + i)).store(xr + i);
        for (int64_t i = body; i < d; ++i) xr[i] = T(float(xr[i]) + float(yr[i]));
        rms_norm_row(xr, wp, op + r * d, d, float(eps));
      }
    });
  });
  return out;
}
