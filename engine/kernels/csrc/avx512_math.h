// AVX512 helpers shared by genserve's attention kernels (compiled only with AVX512-BF16 + BW).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace genserve {

// e^x for x <= 0 (-inf gives 0), Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial
// in r (relative error ~1e-7), scaled by 2^n with vscalefps.
inline __m512 exp_ps(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 neg_inf = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~neg_inf), _mm512_scalef_ps(p, n));
}

// Two fp32 vectors of 16 lanes each (the even and odd members of 16 pairs: dimensions 2i and
// 2i + 1, or keys 2i and 2i + 1) as 32 bf16 in pair order: even0, odd0, even1, odd1, ...
inline __m512i interleave_bf16(__m512 even, __m512 odd) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);   // words 0-15 even, 16-31 odd
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                       24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                       16, 0);
  return _mm512_permutexvar_epi16(idx, both);
}

}  // namespace genserve

#endif  // __AVX512BF16__ && __AVX512BW__
