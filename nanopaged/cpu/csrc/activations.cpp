// SiLU(gate) * up over rows: the MLP's activation where the gate/up projection is not nanopaged's
// bfloat16 kernel (behind that one it is the projection's epilogue instead, linear_bf16.cpp). The
// row loop is silu_and_mul_row (row_kernels.h), which both run.
#include "ops.h"
#include "row_kernels.h"

// gate_up (n, 2 I) -> (n, I): SiLU of the first half times the second.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be (rows, 2 I) with unit stride");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2, row = gate_up.stride(0);
  auto out = torch::empty({rows, I}, gate_up.options());
  DISPATCH_MODEL_DTYPES(gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(I), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_and_mul_row(gp + r * row, gp + r * row + I, op + r * I, I);
    });
  });
  return out;
}
