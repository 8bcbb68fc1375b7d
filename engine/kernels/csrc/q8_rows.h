// A bf16 row rounded to 8 bits per block of 32 (llama.cpp's Q8_1 activations), with AVX512: the
// inputs of the 8-bit products (`q4q8_linear`, `q8q8_linear`) and of `lora_delta_`'s 8-bit format,
// the same operations in each so a row rounds to the same bits in all of them.
//
// Per block of 32: s = max|x| / 127 (1 where that is 0), q = round(x · (1 / s)) to nearest even,
// each step rounded once in fp32; Σ q exactly; and s · Σ q in fp32.
#pragma once

#include <cstdint>
#include <memory>

namespace genserve {

// Rows rounded to 8 bits per block of 32: xq [M][K] and, per block, scale, xsum (scale · Σ xq)
// and isum (Σ xq, exact). Allocated, not filled: the rounding functions fill the rows they round.
struct Q8Rows {
  int64_t k = 0;
  std::unique_ptr<int8_t[]> xq;
  std::unique_ptr<float[]> scale, xsum;
  std::unique_ptr<int32_t[]> isum;

  Q8Rows(int64_t m, int64_t k_)
      : k(k_), xq(new int8_t[m * k_]), scale(new float[m * (k_ / 32)]), xsum(new float[m * (k_ / 32)]),
        isum(new int32_t[m * (k_ / 32)]) {}
  const int8_t* q_row(int64_t r) const { return xq.get() + r * k; }
  const float* scale_row(int64_t r) const { return scale.get() + r * (k / 32); }
  const float* xsum_row(int64_t r) const { return xsum.get() + r * (k / 32); }
  const int32_t* isum_row(int64_t r) const { return isum.get() + r * (k / 32); }
};

}  // namespace genserve

#if defined(__AVX512F__) && defined(__AVX512BW__)

#include <immintrin.h>

namespace genserve {

constexpr int64_t Q8_ROW_BLOCK = 32;

// Row `in` (bf16 bits, k values, k % 32 == 0) -> xq [k] int8, and per block of 32: scale, xsum
// (scale · Σ xq) and isum (Σ xq, exact).
inline void round_row_q8(const uint16_t* in, int64_t k, int8_t* xq, float* scale, float* xsum,
                         int32_t* isum) {
  constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 inv_qmax = _mm512_set1_ps(1.0f / 127.0f);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t b = 0; b < k / Q8_ROW_BLOCK; ++b) {
    const uint16_t* p = in + b * Q8_ROW_BLOCK;
    const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    __m512 s = _mm512_mul_round_ps(_mm512_set1_ps(amax), inv_qmax, RN);
    s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), s, one);
    const __m512 inv = _mm512_div_round_ps(one, s, RN);
    const __m512i q0 = _mm512_cvtps_epi32(
        _mm512_roundscale_ps(_mm512_mul_round_ps(v0, inv, RN), RN));
    const __m512i q1 = _mm512_cvtps_epi32(
        _mm512_roundscale_ps(_mm512_mul_round_ps(v1, inv, RN), RN));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * Q8_ROW_BLOCK), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * Q8_ROW_BLOCK + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    scale[b] = _mm512_cvtss_f32(s);
    isum[b] = sum;
    xsum[b] = _mm512_cvtss_f32(_mm512_mul_round_ps(s, _mm512_set1_ps(static_cast<float>(sum)), RN));
  }
}

}  // namespace genserve

#endif  // __AVX512F__ && __AVX512BW__
