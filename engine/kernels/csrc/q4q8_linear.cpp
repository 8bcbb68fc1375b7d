// y = x @ W^T with W in the GGUF's 4-bit Q4_1 blocks (w = d * q + m, q in 0..15, 32 weights of one
// row along k per block, d and m fp16) and x rounded to int8 per row and block of 32 (ggml's
// Q8_1), the products on AVX512-VNNI's vpdpbusd (u8 nibbles x s8 activations, exact int32 sums).
// Not the bf16 engine's arithmetic (that is q4_linear.cpp): llama.cpp's default arithmetic on a
// Q4_1 file. Prototype and measurements: benchmarks/q4q8_vnni_proto/.
//
// Activation rounding, fused, once per call into a scratch buffer, per row r and block b of 32 k
// (every step an IEEE operation with its rounding fixed by the intrinsic, so -ffast-math cannot
// change it):
//
//   amax       = max |x[r, 32b .. 32b + 31]|                      (x bf16, widened exactly)
//   scale[r,b] = fp32(amax * fp32(1/127)), or 1 where that is 0
//   inv        = fp32(1 / scale[r,b])
//   xq[r, k]   = round_half_even(fp32(x[r, k] * inv))             (|xq| <= 127)
//   xsum[r,b]  = fp32(scale[r,b] * Σ_k xq[r, k])                  (the int sum exact)
//
// Products, per output column n (fp32 accumulation in block order, one rounding to bf16):
//
//   acc += fp32(Σ_k q[n,k] · xq[r,k]) * scale[r,b] * d[n,b]       (exact int32 sum; vfmadd)
//   acc += m[n,b] * xsum[r,b]                                     (vfmadd)
//
// Layout (`engine.model.quant.q4q8_pack`), 384 bytes per 16 output columns x 32 k:
//
//   [N/16 groups][K/32 blocks]{ d[16] fp32, m[16] fp32, nib[4 j][16 columns c][4 bytes i] }
//
// where byte i of (j, c) holds q[c][k = 4j + i] in its low nibble and q[c][k = 16 + 4j + i] in
// its high one (which is byte 4j + i of the GGUF block's nibbles). vpdpbusd multiplies each of
// the 16 lanes' 4 bytes with the same 4 bytes of x broadcast, so the low nibbles pair with
// x[4j .. 4j + 3] and the high nibbles with x[16 + 4j .. 16 + 4j + 3].
//
// Work: panels of 32 columns (2 groups) split across threads (at::parallel_for); within a panel,
// tiles of 4 rows. A row's operations and their order are the same in every tile position and
// at every M, so a row's bits never depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENSERVE_Q4Q8_LINEAR 1
#include <immintrin.h>

#include <algorithm>
#include <vector>
#endif

namespace {

constexpr int64_t QK = 32;                       // weights per Q4_1 block (along k)
constexpr int64_t GROUP_N = 16;                  // output columns per packed group
constexpr int64_t PANEL_N = 32;                  // columns per parallel panel (2 groups)
constexpr int64_t GROUP_BYTES = 64 + 64 + 256;   // d[16] f32, m[16] f32, 4 x 64 nibble bytes

#ifdef GENSERVE_Q4Q8_LINEAR

constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Row `in` (bf16 bits, k values) rounded per block of 32 into xq, scale and xsum (see above).
void quantize_row(const uint16_t* in, int64_t k, int8_t* xq, float* scale, float* xsum) {
  const __m512 inv_qmax = _mm512_set1_ps(1.0f / 127.0f);
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t b = 0; b < k / QK; ++b) {
    const uint16_t* p = in + b * QK;
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
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    scale[b] = _mm512_cvtss_f32(s);
    xsum[b] = _mm512_cvtss_f32(
        _mm512_mul_round_ps(s, _mm512_set1_ps(static_cast<float>(sum)), RN));
  }
}

// Rows r0 .. r0 + rows - 1 (rows <= 4) times one panel of 32 columns -> y (bf16).
void panel_rows(const int8_t* X, const float* XS, const float* XSUM, const uint8_t* panel,
                int64_t k, int64_t r0, int rows, c10::BFloat16* Y, int64_t n, int64_t col0) {
  constexpr int R = 4, G = 2;
  const int64_t kb_count = k / QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb_count; ++b) {
    __m512i iacc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) iacc[r][g] = _mm512_setzero_si512();
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) blk[g] = panel + (g * kb_count + b) * GROUP_BYTES;
    for (int j = 0; j < 4; ++j) {
      __m512i wl[G], wh[G];
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(blk[g] + 128 + 64 * j);
        wl[g] = _mm512_and_si512(v, low);
        wh[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const int8_t* xr = X + (r0 + r) * k + b * QK;
        const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
        const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16 + 4 * j));
        for (int g = 0; g < G; ++g) {
          iacc[r][g] = _mm512_dpbusd_epi32(iacc[r][g], wl[g], xl);
          iacc[r][g] = _mm512_dpbusd_epi32(iacc[r][g], wh[g], xh);
        }
      }
    }
    __m512 dv[G], mv[G];
    for (int g = 0; g < G; ++g) {
      dv[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk[g]));
      mv[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk[g] + 64));
    }
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const __m512 s = _mm512_set1_ps(XS[(r0 + r) * kb_count + b]);
      const __m512 sm = _mm512_set1_ps(XSUM[(r0 + r) * kb_count + b]);
      for (int g = 0; g < G; ++g) {
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(iacc[r][g]), s, RN),
                                    dv[g], acc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(mv[g], sm, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Y + (r0 + r) * n + col0 + g * GROUP_N),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][g]));
}

#endif  // GENSERVE_Q4Q8_LINEAR

}  // namespace

namespace genserve {

// x: bf16 [M, K] contiguous, K % 32 == 0; packed: uint8 [N, K / 32 * 24] contiguous, W's Q4_1
// blocks in the layout above (`engine.model.quant.q4q8_pack`); n: N, a multiple of 32. Returns
// bf16 [M, N]. Raises (RuntimeError) on another dtype or shape, and on a build whose compiler
// did not target AVX512-VNNI, AVX512-BF16 and AVX512BW (`engine.kernels.q4q8_linear_available()`
// says whether this build has it).
at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "q4q8_linear: x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) % (GROUP_BYTES / GROUP_N) == 0,
              "q4q8_linear: packed must be a contiguous uint8 [N, K / 32 * 24] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % QK == 0 && k > 0, "q4q8_linear: K must be a positive multiple of ", QK,
              ", got ", k);
  TORCH_CHECK(n > 0 && n % PANEL_N == 0, "q4q8_linear: N must be a positive multiple of ",
              PANEL_N, ", got ", n);
  TORCH_CHECK(packed.size(0) == n, "q4q8_linear: packed has ", packed.size(0), " rows, n = ", n);
  TORCH_CHECK(packed.size(1) / (GROUP_BYTES / GROUP_N) * QK == k, "q4q8_linear: x has K = ", k,
              ", the weight ", packed.size(1) / (GROUP_BYTES / GROUP_N) * QK);
#ifdef GENSERVE_Q4Q8_LINEAR
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const int64_t kb_count = k / QK;
  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * kb_count), xsum(m * kb_count);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * k, k, xq.data() + r * k, xs.data() + r * kb_count,
                   xsum.data() + r * kb_count);
  });
  const uint8_t* w = packed.data_ptr<uint8_t>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t panel_bytes = (PANEL_N / GROUP_N) * kb_count * GROUP_BYTES;
  at::parallel_for(0, n / PANEL_N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += 4)
        panel_rows(xq.data(), xs.data(), xsum.data(), w + p * panel_bytes, k, r0,
                   static_cast<int>(std::min<int64_t>(4, m - r0)), yp, n, p * PANEL_N);
  });
  return y;
#else
  (void)m;
  TORCH_CHECK(false, "q4q8_linear: this build of genserve's kernels has no AVX512-VNNI product "
              "(it needs a compiler targeting AVX512-VNNI, AVX512-BF16 and AVX512BW; "
              "engine.kernels.q4q8_linear_available() is False here)");
  return at::Tensor();
#endif
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("q4q8_linear(Tensor x, Tensor packed, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("q4q8_linear", &genserve::q4q8_linear); }
