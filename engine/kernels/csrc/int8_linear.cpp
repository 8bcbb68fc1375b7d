// y = x @ W^T on int8 arithmetic (engine/model/int8.py): the input rows quantized per row, the
// weight held as int8 rows with one fp32 scale each, exact int32 sums by oneDNN's int8 product
// (at::_int_mm: u8·s8 VNNI, or AMX-INT8 where the CPU has it), scaled back in fp32.
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
#include <cstring>
#include <vector>

#include "genserve_ops.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr float QMAX = 127.0f;
constexpr float INV_QMAX = 1.0f / 127.0f;

inline int8_t quantize(float v, float inv) {
  const float r = std::nearbyint(v * inv);           // the default rounding mode: half to even
  return static_cast<int8_t>(std::min(QMAX, std::max(-QMAX, r)));
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp32 → bf16 bits, rounded to nearest even (finite inputs: the products' sums are), written so
// the compiler vectorizes it.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Row r's channels as fp32 into `rp`, and max |x · keep| over them.
inline float load_row(const uint16_t* in, const float* keep, float* rp, int64_t k) {
  int64_t j = 0;
  float amax = 0.0f;
#ifdef __AVX512F__
  __m512 vmax = _mm512_setzero_ps();
  for (; j + 16 <= k; j += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j)));
    const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    _mm512_storeu_ps(rp + j, v);
    vmax = _mm512_max_ps(vmax, _mm512_mul_ps(_mm512_abs_ps(v), _mm512_loadu_ps(keep + j)));
  }
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; j < k; ++j) {
    rp[j] = bf16_to_float(in[j]);
    amax = std::max(amax, std::fabs(rp[j]) * keep[j]);
  }
  return amax;
}

// out[j] = quantize(rp[j] · keep[j], inv) for j < k.
inline void quantize_row(const float* rp, const float* keep, float inv, int8_t* out, int64_t k) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-QMAX), hi = _mm512_set1_ps(QMAX);
  for (; j + 16 <= k; j += 16) {
    __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(rp + j), _mm512_loadu_ps(keep + j)), vinv);
    t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);   // half to even
    t = _mm512_min_ps(hi, _mm512_max_ps(lo, t));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(t)));
  }
#endif
  for (; j < k; ++j) out[j] = quantize(rp[j] * keep[j], inv);
}

// out[t] = bf16((a[t] · s + ao[t] · so) · ws[t]) for t < n (without ao: a[t] · s · ws[t]).
inline void scale_row(const int32_t* a, const int32_t* ao, float s, float so, const float* ws,
                      uint16_t* out, int64_t n) {
  int64_t t = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s), vso = _mm512_set1_ps(so);
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (; t + 16 <= n; t += 16) {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + t)), vs);
    if (ao != nullptr)
      v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(ao + t)), vso));
    v = _mm512_mul_ps(v, _mm512_loadu_ps(ws + t));
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
  }
#endif
  for (; t < n; ++t) {
    float v = static_cast<float>(a[t]) * s;
    if (ao != nullptr) v += static_cast<float>(ao[t]) * so;
    out[t] = float_to_bf16(v * ws[t]);
  }
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
  TORCH_CHECK(outliers.scalar_type() == at::kLong && outliers.dim() == 1 &&
                  outliers.is_contiguous(),
              "int8_linear: outliers must be contiguous int64 [C]");
  TORCH_CHECK(outlier_q.scalar_type() == at::kChar && outlier_q.dim() == 2 &&
                  outlier_q.size(0) == c && outlier_q.size(1) == n && outlier_q.is_contiguous(),
              "int8_linear: outlier_q must be contiguous int8 [C, N]");
  // keep[j] = 1 for the channels quantized together, 0 for the outliers
  std::vector<float> keep(k, 1.0f);
  const int64_t* idx = outliers.data_ptr<int64_t>();
  for (int64_t j = 0; j < c; ++j) {
    TORCH_CHECK(idx[j] >= 0 && idx[j] < k, "int8_linear: outlier channel out of range");
    keep[idx[j]] = 0.0f;
  }
  const auto i8 = x.options().dtype(at::kChar);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor xq = at::empty({m, k}, i8), oq = at::empty({m, c}, i8);
  at::Tensor xs = at::empty({m}, f32), os = at::empty({m}, f32);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  int8_t* xqp = xq.data_ptr<int8_t>();
  int8_t* oqp = oq.data_ptr<int8_t>();
  float* xsp = xs.data_ptr<float>();
  float* osp = os.data_ptr<float>();
  const float* kp = keep.data();
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    float* rp = row.data();
    for (int64_t r = begin; r < end; ++r) {
      const float amax = load_row(xp + r * k, kp, rp, k);
      float omax = 0.0f;
      for (int64_t j = 0; j < c; ++j) omax = std::max(omax, std::fabs(rp[idx[j]]));
      const float s = amax > 0.0f ? amax * INV_QMAX : 1.0f;
      const float inv = 1.0f / s;
      quantize_row(rp, kp, inv, xqp + r * k, k);                               // 0 at outliers
      xsp[r] = s;
      const float so = omax > 0.0f ? omax * INV_QMAX : 1.0f;
      const float oinv = 1.0f / so;
      for (int64_t j = 0; j < c; ++j) oqp[r * c + j] = quantize(rp[idx[j]], oinv);
      osp[r] = so;
    }
  });
  const at::Tensor acc = at::_int_mm(xq, q.t()).contiguous();                // int32 [M, N]
  // The outlier channels' sums: oneDNN's int8 product too, except at C = 1, where torch 2.13's
  // CPU _int_mm gives wrong sums; there, by hand. Exact either way.
  at::Tensor acc_o;
  if (c > 1) {
    acc_o = at::_int_mm(oq, outlier_q).contiguous();
  } else if (c == 1) {
    acc_o = oq.to(at::kInt).mul(outlier_q.to(at::kInt));      // [M, 1] · [1, N] → [M, N]
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const int32_t* aop = c ? acc_o.data_ptr<int32_t>() : nullptr;
  const float* wsp = scale.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      scale_row(ap + r * n, aop != nullptr ? aop + r * n : nullptr, xsp[r], osp[r], wsp,
                yp + r * n, n);
  });
  return y;
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor outliers, Tensor outlier_q) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("int8_linear", &genserve::int8_linear); }
