// Greedy sampling's argmax on CPU: for each row of fp32 logits, the index of its largest value.
//
//   argmax_rows(x [R, V] fp32) -> int64 [R]:  the first index of the row's maximum; a row holding
//                                              a NaN gives its first NaN (NaN counts as the
//                                              maximum)
//
// The same indices as `torch.max(x, dim=-1).indices` on CPU (which this replaces in the sampler:
// ≈ 1 ms for 32 rows of SmolLM2's 49,152 logits on 2 cores, a scalar loop per row; this is two
// vectorized passes over the row, the maximum and then its first position). The kernels build
// with -ffast-math, which lets the compiler assume no NaN, so NaN is found from the bits (an
// exponent of all ones and a nonzero mantissa), which that flag cannot remove. A row is read by
// one thread in a fixed order: its result never depends on the other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// Index of the first NaN of x[0 .. v), or -1.
int64_t first_nan(const float* x, int64_t v) {
  const auto* bits = reinterpret_cast<const uint32_t*>(x);
  uint32_t any = 0;
  for (int64_t i = 0; i < v; ++i) any |= static_cast<uint32_t>((bits[i] & 0x7fffffffu) > 0x7f800000u);
  if (!any) return -1;
  for (int64_t i = 0; i < v; ++i)
    if ((bits[i] & 0x7fffffffu) > 0x7f800000u) return i;
  return -1;   // unreachable
}

// First index of the maximum of x[0 .. v) (v >= 1, no NaN).
int64_t first_max(const float* x, int64_t v) {
  float m = x[0];
  for (int64_t i = 1; i < v; ++i) m = x[i] > m ? x[i] : m;
  for (int64_t i = 0; i < v; ++i)
    if (x[i] == m) return i;
  return 0;    // unreachable
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "argmax_rows: x must be a contiguous fp32 [R, V] tensor");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: V must be positive");
  const int64_t rows = x.size(0), v = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * v;
      const int64_t nan = first_nan(row, v);
      op[r] = nan >= 0 ? nan : first_max(row, v);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
