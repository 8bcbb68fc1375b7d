// y = x @ W^T on int8 arithmetic (engine/model/int8.py): the input rows quantized per row, the
// weight held as int8 rows with one fp32 scale each, exact int32 sums by oneDNN's int8 product
// (at::_int_mm: u8·s8 VNNI, or AMX-INT8 where the CPU has it; the few outlier channels' sums by
// hand), scaled back in fp32.
//
//   x_scale[m] = max |x[m, k]| · (1/127) over the channels not kept apart (1 if that is 0)
//   xq[m, k]   = round_half_even(x[m, k] · (1 / x_scale[m])), clamped to ±127; 0 at outliers
//   o_scale, oq: the same over the outlier channels alone
//   y[m, n]    = bf16(((fp32(Σ_k xq·q) · x_scale[m]) + (fp32(Σ_c oq·outlier_q) · o_scale[m]))
//                     · w_scale[n])                        rounded to nearest even, once
//
// This is the Python fallback's formula (engine/model/int8.py `int8_linear`), in one pass over the
// input to quantize it and one over the sums to scale them, instead of a dozen whole-tensor
// torch ops whose conversions and temporaries cost more than the products themselves at 512
// rows. Built with -ffast-math, the compiler may fuse the epilogue's multiply and add and round
// x · (1/scale) differently where it falls within an fp32 rounding of a tie, so an output can
// differ from the fallback's in its last bit, or by one level of one input; an engine uses one
// of the two for all of its products.
//
// Every step is per row or an exact integer sum, so a row's bits do not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "genserve_ops.h"

namespace {

constexpr float QMAX = 127.0f;
constexpr float INV_QMAX = 1.0f / 127.0f;

inline int8_t quantize(float v, float inv) {
  const float r = std::nearbyint(v * inv);           // the default rounding mode: half to even
  return static_cast<int8_t>(std::min(QMAX, std::max(-QMAX, r)));
}

}  // namespace

namespace genserve {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const at::Tensor& outliers, const at::Tensor& outlier_q) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int8_linear: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() &&
                  q.size(1) == x.size(1),
              "int8_linear: q must be contiguous int8 [N, K] with x's K");
  const int64_t m = x.size(0), k = x.size(1), n = q.size(0), c = outliers.numel();
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n && scale.is_contiguous(),
              "int8_linear: scale must be fp32 [N]");
  TORCH_CHECK(outliers.scalar_type() == at::kLong && outliers.dim() == 1,
              "int8_linear: outliers must be int64 [C]");
  TORCH_CHECK(outlier_q.scalar_type() == at::kChar && outlier_q.dim() == 2 &&
                  outlier_q.size(0) == c && outlier_q.size(1) == n && outlier_q.is_contiguous(),
              "int8_linear: outlier_q must be contiguous int8 [C, N]");
  std::vector<uint8_t> apart(k, 0);
  const int64_t* idx = outliers.data_ptr<int64_t>();
  for (int64_t j = 0; j < c; ++j) {
    TORCH_CHECK(idx[j] >= 0 && idx[j] < k, "int8_linear: outlier channel out of range");
    apart[idx[j]] = 1;
  }
  const auto i8 = x.options().dtype(at::kChar);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xq = at::empty({m, k}, i8), oq = at::empty({m, c}, i8);
  at::Tensor xs = at::empty({m}, f32), os = at::empty({m}, f32);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  int8_t* oqp = oq.data_ptr<int8_t>();
  float* xsp = xs.data_ptr<float>();
  float* osp = os.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) {
      float amax = 0.0f, omax = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        row[j] = static_cast<float>(xp[r * k + j]);
        const float a = std::fabs(row[j]);
        if (apart[j]) omax = std::max(omax, a); else amax = std::max(amax, a);
      }
      const float s = amax > 0.0f ? amax * INV_QMAX : 1.0f;
      const float inv = 1.0f / s;
      for (int64_t j = 0; j < k; ++j) xqp[r * k + j] = apart[j] ? 0 : quantize(row[j], inv);
      xsp[r] = s;
      const float so = omax > 0.0f ? omax * INV_QMAX : 1.0f;
      const float oinv = 1.0f / so;
      for (int64_t j = 0; j < c; ++j) oqp[r * c + j] = quantize(row[idx[j]], oinv);
      osp[r] = so;
    }
  });
  const at::Tensor acc = at::_int_mm(xq, q.t()).contiguous();                // int32 [M, N]
  at::Tensor y = at::empty({m, n}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const int8_t* owp = outlier_q.data_ptr<int8_t>();
  const float* wsp = scale.data_ptr<float>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // The outlier channels' sums (C ≤ a few dozen) by hand, exact in int32, beside the scaling.
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> acc_o(n);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc_o.begin(), acc_o.end(), 0);
      for (int64_t j = 0; j < c; ++j) {
        const int32_t a = oqp[r * c + j];
        const int8_t* wrow = owp + j * n;
        for (int64_t t = 0; t < n; ++t) acc_o[t] += a * static_cast<int32_t>(wrow[t]);
      }
      const float s = xsp[r], so = osp[r];
      for (int64_t t = 0; t < n; ++t) {
        float v = static_cast<float>(ap[r * n + t]) * s;
        v += static_cast<float>(acc_o[t]) * so;
        yp[r * n + t] = c10::BFloat16(v * wsp[t]);        // round to nearest even
      }
    }
  });
  return y;
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor outliers, Tensor outlier_q) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("int8_linear", &genserve::int8_linear); }
