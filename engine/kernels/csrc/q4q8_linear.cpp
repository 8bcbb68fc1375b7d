// y = x @ W^T with W in the GGUF's 4-bit Q4_1 blocks (w = d * q + m, q in 0..15, 32 weights of one
// row along k per block, d and m fp16) and x rounded to int8 per row and block of 32 (ggml's
// Q8_1), the products as exact integer sums of u8 nibbles x s8 activations: on AVX512-VNNI's
// vpdpbusd, or, on CPUs with AVX2 alone, on vpmaddubsw (u8 x s8 pairs summed to int16) and
// vpmaddwd (int16 pairs summed to int32). Not the bf16 engine's arithmetic (that is
// q4_linear.cpp): llama.cpp's default arithmetic on a Q4_1 file. Prototype and measurements:
// benchmarks/q4q8_vnni_proto/. Also `q8q8_linear`: Q8_0 weights times the same 8-bit rows
// (llama.cpp's Q8_0 x Q8_0, the file's output projection), further below.
//
// Activation rounding, fused, once per call into a scratch buffer, per row r and block b of 32 k
// (every step one IEEE operation whose rounding the intrinsic fixes, so -ffast-math cannot
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
// Both builds run these operations in this order (the integer sums are exact in any order), so
// an AVX2 host and an AVX512-VNNI host give the same bits (bf16 rounding: vcvtneps2bf16 there,
// c10::BFloat16's round-to-nearest-even here, which differ only on fp32 subnormals and NaN).
//
// Layout (`engine.model.quant.q4q8_pack`), 320 bytes per 16 output columns x 32 k:
//
//   [N/16 groups][K/32 blocks]{ d[16] fp16, m[16] fp16, nib[4 j][16 columns c][4 bytes i] }
//
// d and m stay the file's fp16 (widened exactly by vcvtph2ps where a block is used): at one row
// the product waits on reading these bytes, and fp32 copies made them 384.
//
// where byte i of (j, c) holds q[c][k = 4j + i] in its low nibble and q[c][k = 16 + 4j + i] in
// its high one (which is byte 4j + i of the GGUF block's nibbles). vpdpbusd multiplies each of
// the 16 lanes' 4 bytes with the same 4 bytes of x broadcast, so the low nibbles pair with
// x[4j .. 4j + 3] and the high nibbles with x[16 + 4j .. 16 + 4j + 3]. On AVX2 a ymm holds 8 of
// the 16 columns' 4 bytes; vpmaddubsw sums them in pairs (|q·x + q·x| <= 2 · 15 · 127 = 3,810),
// the 8 such sums of a block (4 j, low and high) are added in int16 (<= 30,480 < 2^15: exact),
// and vpmaddwd against ones adds each column's 2 int16 lanes into its int32 sum.
//
// Work: panels of 32 columns (2 groups) split across threads (at::parallel_for); within a panel,
// tiles of 4 rows. A row's operations and their order are the same in every tile position and
// at every M, so a row's bits never depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "genserve_ops.h"
#include "q8_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENSERVE_Q4Q8_LINEAR 1
#define GENSERVE_Q4Q8_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GENSERVE_Q4Q8_LINEAR 1
#define GENSERVE_Q4Q8_AVX2 1
#endif

#ifdef GENSERVE_Q4Q8_LINEAR
#include <immintrin.h>

#include "prefetch.h"

#include <algorithm>
#include <optional>
#include <vector>
#endif

namespace {

constexpr int64_t QK = 32;                       // weights per Q4_1 block (along k)
constexpr int64_t GROUP_N = 16;                  // output columns per packed group
constexpr int64_t PANEL_N = 32;                  // columns per parallel panel (2 groups)
constexpr int64_t GROUP_BYTES = 32 + 32 + 256;   // d[16] f16, m[16] f16, 4 x 64 nibble bytes
constexpr int64_t Q8_D_BYTES = 32;               // Q8_0 weights: d[16] f16, then
constexpr int64_t Q8_GROUP_BYTES = Q8_D_BYTES + 512;   // 8 x 64 int8 bytes
constexpr int64_t Q8_GROUP_BYTES_PER_COLUMN = Q8_GROUP_BYTES / GROUP_N;   // 34, as in the file
constexpr int64_t PREFETCH_BLOCKS = 4;           // how far ahead a panel's first row tile prefetches
constexpr int64_t Q8_PREFETCH_BLOCKS = 8;        // the same for Q8_0 blocks, into L2, a line per j

#ifdef GENSERVE_Q4Q8_LINEAR
constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Calls run(std::integral_constant<int, R>{}) for R = rows (1 .. 4; a row tile's size), so each
// tile size has its own fully unrolled kernel.
template <class Run>
void with_rows(int rows, Run&& run) {
  switch (rows) {
    case 4: return run(std::integral_constant<int, 4>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 2: return run(std::integral_constant<int, 2>{});
    default: return run(std::integral_constant<int, 1>{});
  }
}

// The block PREFETCH_BLOCKS ahead of `blk` in its group's stream (blocks of `block_bytes`, a
// multiple of 64), asked for now. Only a Q4_1 panel's first row tile calls it: that tile reads
// the panel from memory, where at 1-32 rows each block is used once and the hardware prefetcher
// alone kept the cores at about 20 GB/s; later tiles find the panel in cache. (`q8q8_linear`
// asks for its lines one at a time into L2 instead: these bursts into L1 made its product
// slower, docs/benchmarks/linear.md.)
inline void prefetch_ahead(const uint8_t* blk, int64_t block_bytes) {
  const char* ahead = reinterpret_cast<const char*>(blk + PREFETCH_BLOCKS * block_bytes);
  for (int64_t line = 0; line < block_bytes; line += 64) genserve::prefetch_l1(ahead + line);
}
#endif

#ifdef GENSERVE_Q4Q8_AVX512

// Row `in` (bf16 bits, k values) rounded per block of 32 into xq, scale, xsum and isum (the
// exact int sum Σ_k xq of each block; see above): q8_rows.h, shared with `lora_delta_`.
inline void quantize_row(const uint16_t* in, int64_t k, int8_t* xq, float* scale, float* xsum,
                         int32_t* isum) {
  genserve::round_row_q8(in, k, xq, scale, xsum, isum);
}

// ROWS rows from r0 (ROWS <= 4) times one panel of 32 columns -> y (bf16). Each (row, group)
// sums a block's low-nibble and high-nibble products in two int32 accumulators, added once per
// block: one accumulator would chain all 8 of a block's vpdpbusd one after another, two halve
// that chain (benchmarks/results/kernels/history.md, "Where a 32-stream round goes, and two small
// kernel changes", has the measurement). The sum is exact either way, so
// the bits are the same.
template <int ROWS>
void panel_tile(const int8_t* X, const float* XS, const float* XSUM, const uint8_t* panel,
                int64_t k, int64_t r0, c10::BFloat16* Y, int64_t n, int64_t col0) {
  constexpr int G = 2;
  const int64_t kb_count = k / QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[ROWS][G];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb_count; ++b) {
    __m512i lacc[ROWS][G], hacc[ROWS][G];
    for (int r = 0; r < ROWS; ++r)
      for (int g = 0; g < G; ++g) lacc[r][g] = hacc[r][g] = _mm512_setzero_si512();
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) blk[g] = panel + (g * kb_count + b) * GROUP_BYTES;
    if (r0 == 0)
      for (int g = 0; g < G; ++g) prefetch_ahead(blk[g], GROUP_BYTES);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i wl[G], wh[G];
      for (int g = 0; g < G; ++g) {
        const __m512i v = _mm512_loadu_si512(blk[g] + 64 + 64 * j);
        wl[g] = _mm512_and_si512(v, low);
        wh[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = X + (r0 + r) * k + b * QK;
        const __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
        const __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16 + 4 * j));
        for (int g = 0; g < G; ++g) {
          lacc[r][g] = _mm512_dpbusd_epi32(lacc[r][g], wl[g], xl);
          hacc[r][g] = _mm512_dpbusd_epi32(hacc[r][g], wh[g], xh);
        }
      }
    }
    __m512 dv[G], mv[G];
    for (int g = 0; g < G; ++g) {
      dv[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g])));
      mv[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g] + 32)));
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 s = _mm512_set1_ps(XS[(r0 + r) * kb_count + b]);
      const __m512 sm = _mm512_set1_ps(XSUM[(r0 + r) * kb_count + b]);
      for (int g = 0; g < G; ++g) {
        const __m512i isum = _mm512_add_epi32(lacc[r][g], hacc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(isum), s, RN),
                                    dv[g], acc[r][g]);
        acc[r][g] = _mm512_fmadd_ps(mv[g], sm, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < G; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Y + (r0 + r) * n + col0 + g * GROUP_N),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][g]));
}

// Rows r0 .. r0 + rows - 1 (rows <= 4) times one panel of 32 columns -> y (bf16).
void panel_rows(const int8_t* X, const float* XS, const float* XSUM, const uint8_t* panel,
                int64_t k, int64_t r0, int rows, c10::BFloat16* Y, int64_t n, int64_t col0) {
  with_rows(rows, [&](auto r) {
    panel_tile<decltype(r)::value>(X, XS, XSUM, panel, k, r0, Y, n, col0);
  });
}

#elif defined(GENSERVE_Q4Q8_AVX2)

// 8 bf16 (bits) widened exactly to fp32.
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The same rounding as the AVX512 build's `quantize_row` (see the top of the file): the scalar
// steps on SSE intrinsics (one IEEE operation each), the per-element ones on ymm.
void quantize_row(const uint16_t* in, int64_t k, int8_t* xq, float* scale, float* xsum,
                  int32_t* isum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // bytes 0-3 of each 128-bit half of vpacksswb's result, in k order (see below)
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / QK; ++b) {
    const uint16_t* p = in + b * QK;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = widen8(p + 8 * i);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    __m128 s = _mm_mul_ss(m4, _mm_set_ss(1.0f / 127.0f));
    if (_mm_cvtss_f32(s) == 0.0f) s = _mm_set_ss(1.0f);
    const __m256 inv = _mm256_set1_ps(_mm_cvtss_f32(_mm_div_ss(_mm_set_ss(1.0f), s)));
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), RN));
    // vpackssdw / vpacksswb interleave the 128-bit halves: the bytes come out as 4-byte groups
    // q0[0..3] q1[0..3] q2[0..3] q3[0..3] | q0[4..7] q1[4..7] ...; `order` puts them back.
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                              _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * QK),
                        _mm256_permutevar8x32_epi32(packed, order));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    scale[b] = _mm_cvtss_f32(s);
    isum[b] = _mm_cvtsi128_si32(t4);
    xsum[b] = _mm_cvtss_f32(_mm_mul_ss(s, _mm_set_ss(static_cast<float>(isum[b]))));
  }
}

// ROWS rows from r0 times one group of 16 columns (at `group`, its kb_count blocks) -> y (bf16).
template <int ROWS>
void group_rows(const int8_t* X, const float* XS, const float* XSUM, const uint8_t* group,
                int64_t k, int64_t r0, c10::BFloat16* Y, int64_t n, int64_t col0) {
  const int64_t kb_count = k / QK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // The fp32 sums live in memory (L1), touched once per block: in registers beside the 8 int16
  // accumulators, the 4 weight vectors and the 2 broadcast activations they did not fit, and GCC
  // spilled the int16 accumulators inside the j loop instead (about 10 % slower).
  alignas(32) float acc[ROWS][16];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < 16; ++c) acc[r][c] = 0.f;
  for (int64_t b = 0; b < kb_count; ++b) {
    const uint8_t* blk = group + b * GROUP_BYTES;
    __m256i iacc[ROWS][2];                      // int16 pair sums, per column 2 lanes
    for (int r = 0; r < ROWS; ++r) iacc[r][0] = iacc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i wl[2], wh[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * j + 32 * h));
        wl[h] = _mm256_and_si256(v, low);
        wh[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = X + (r0 + r) * k + b * QK;
        const __m256i xl = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
        const __m256i xh = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16 + 4 * j));
        for (int h = 0; h < 2; ++h)
          iacc[r][h] = _mm256_add_epi16(iacc[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(wl[h], xl),
                                                                     _mm256_maddubs_epi16(wh[h], xh)));
      }
      // Integer adds may be regrouped at will, and GCC then computed all 64 products of a
      // block before adding any, spilling them to the stack (2x slower): the empty asm pins
      // each accumulator in a register after every j.
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h) asm("" : "+x"(iacc[r][h]));
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 s = _mm256_set1_ps(XS[(r0 + r) * kb_count + b]);
      const __m256 sm = _mm256_set1_ps(XSUM[(r0 + r) * kb_count + b]);
      for (int h = 0; h < 2; ++h) {
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(iacc[r][h], ones));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
        __m256 a = _mm256_fmadd_ps(_mm256_mul_ps(isum, s), d, _mm256_load_ps(acc[r] + 8 * h));
        _mm256_store_ps(acc[r] + 8 * h, _mm256_fmadd_ps(m, sm, a));
      }
    }
    asm volatile("" : : "r"(&acc[0][0]) : "memory");   // keeps acc in memory (see above)
  }
  for (int r = 0; r < ROWS; ++r) {
    c10::BFloat16* y = Y + (r0 + r) * n + col0;
    for (int c = 0; c < 16; ++c) y[c] = c10::BFloat16(acc[r][c]);
  }
}

// Rows r0 .. r0 + rows - 1 (rows <= 4) times one panel of 32 columns -> y (bf16).
void panel_rows(const int8_t* X, const float* XS, const float* XSUM, const uint8_t* panel,
                int64_t k, int64_t r0, int rows, c10::BFloat16* Y, int64_t n, int64_t col0) {
  const int64_t group_bytes = (k / QK) * GROUP_BYTES;
  for (int g = 0; g < PANEL_N / GROUP_N; ++g) {
    const uint8_t* group = panel + g * group_bytes;
    const int64_t c0 = col0 + g * GROUP_N;
    with_rows(rows, [&](auto r) {
      group_rows<decltype(r)::value>(X, XS, XSUM, group, k, r0, Y, n, c0);
    });
  }
}

#endif  // GENSERVE_Q4Q8_AVX512 / GENSERVE_Q4Q8_AVX2

#ifdef GENSERVE_Q4Q8_LINEAR

// Q8_0 weights (ggml's block_q8_0: fp16 d, 32 int8 q; w = d * q) times the same 8-bit rows:
// `q8q8_linear`, llama.cpp's Q8_0 x Q8_0 product (the rows' xsum is not needed).
//
// Per output column n, row r and block b (fp32 accumulation in block order, one rounding):
//
//   acc += fp32(Σ_k q[n,k] · xq[r,k]) * scale[r,b] * d[n,b]        (exact int32 sum; vfmadd)
//
// Both operands are signed, and vpmaddubsw and vpdpbusd take one unsigned. On AVX2, as in ggml's
// AVX2 dot product, |q| goes in as the unsigned operand and xq with q's sign (vpsignb) as the
// signed one, which gives the same products; a pair's sum is at most 2 * 128 * 127 = 32,512 <
// 2^15 (exact), but two pairs may not be, so each vpmaddubsw result is widened at once (vpmaddwd
// against ones). On AVX512-VNNI the unsigned operand is q + 128 (q with its top bit flipped) and
// vpdpbusd's exact sum Σ (q + 128) · xq less 128 · Σ xq (the row's `isum`) is Σ q · xq: the same
// int32 sum, then the same fp32 operations, so both builds give the same bits.
//
// Layout (`engine.model.quant.q8q8_pack`), 544 bytes per 16 output columns x 32 k (the file's
// 34 per column and block):
//
//   [N/16 groups][K/32 blocks]{ d[16] fp16, q[8 j][16 columns c][4 bytes i] }
//
// where byte i of (j, c) is q[c][4j + i]; d stays the file's fp16, widened exactly (vcvtph2ps)
// where a block is used: at one row the product waits on reading these bytes, and fp32 copies of
// d made them 36 per column and block. Work as `q4q8_linear`'s: panels of 32 columns across
// threads; within a panel, tiles of up to 4 rows times 32 columns (two zmm of fp32 each) on
// AVX512, 4 rows times 8 columns (one ymm) on AVX2. On AVX512 a panel's first row tile asks for
// the block Q8_PREFETCH_BLOCKS ahead in each group's stream into L2, one line per j (as
// `qk_linear` does), which measured faster than no prefetch at 1-32 rows on a Zen 4 host, where
// `prefetch_ahead`'s bursts of 9 lines per block into L1 were slower than none
// (docs/benchmarks/linear.md has the figures).
#ifdef GENSERVE_Q4Q8_AVX512

// ROWS rows from r0 (ROWS <= 4) times one panel of 32 Q8_0 columns -> y (bf16).
template <int ROWS>
void q8_panel_tile(const int8_t* X, const float* XS, const int32_t* ISUM, const uint8_t* panel,
                   int64_t k, int64_t r0, c10::BFloat16* Y, int64_t n, int64_t col0) {
  constexpr int G = 2;
  const int64_t kb_count = k / QK;
  const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[ROWS][G];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb_count; ++b) {
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) blk[g] = panel + (g * kb_count + b) * Q8_GROUP_BYTES;
    __m512i iacc[ROWS][G];
    for (int r = 0; r < ROWS; ++r) {
      // -128 · Σ xq to start with, so the sum over (q + 128) · xq ends as Σ q · xq
      const __m512i start = _mm512_set1_epi32(-128 * ISUM[(r0 + r) * kb_count + b]);
      for (int g = 0; g < G; ++g) iacc[r][g] = start;
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (r0 == 0)          // the first row tile reads the panel from memory: ask for a line ahead
        for (int g = 0; g < G; ++g) {
          genserve::prefetch_l2(blk[g] + Q8_PREFETCH_BLOCKS * Q8_GROUP_BYTES + 64 * j);
          if (j == 7) genserve::prefetch_l2(blk[g] + Q8_PREFETCH_BLOCKS * Q8_GROUP_BYTES + 512);
        }
      __m512i w[G];
      for (int g = 0; g < G; ++g)
        w[g] = _mm512_xor_si512(_mm512_loadu_si512(blk[g] + Q8_D_BYTES + 64 * j), top);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = X + (r0 + r) * k + b * QK;
        const __m512i xb = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
        for (int g = 0; g < G; ++g) iacc[r][g] = _mm512_dpbusd_epi32(iacc[r][g], w[g], xb);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 s = _mm512_set1_ps(XS[(r0 + r) * kb_count + b]);
      for (int g = 0; g < G; ++g) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk[g])));
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_round_ps(_mm512_cvtepi32_ps(iacc[r][g]), s, RN),
                                    d, acc[r][g]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < G; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(Y + (r0 + r) * n + col0 + g * GROUP_N),
                          (__m256i)_mm512_cvtneps_pbh(acc[r][g]));
}

// Rows r0 .. r0 + rows - 1 (rows <= 4) times one panel of 32 Q8_0 columns -> y (bf16).
void q8_panel_rows(const int8_t* X, const float* XS, const int32_t* ISUM, const uint8_t* panel,
                   int64_t k, int64_t r0, int rows, c10::BFloat16* Y, int64_t n, int64_t col0) {
  with_rows(rows, [&](auto r) {
    q8_panel_tile<decltype(r)::value>(X, XS, ISUM, panel, k, r0, Y, n, col0);
  });
}

#else  // AVX2

template <int ROWS>
void q8_half_rows(const int8_t* X, const float* XS, const uint8_t* group, int64_t k, int64_t r0,
                  int h, c10::BFloat16* Y, int64_t n, int64_t col0) {
  const int64_t kb_count = k / QK;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb_count; ++b) {
    const uint8_t* blk = group + b * Q8_GROUP_BYTES;
    __m256i iacc[ROWS];
    for (int r = 0; r < ROWS; ++r) iacc[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + Q8_D_BYTES + 64 * j + 32 * h));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = X + (r0 + r) * k + b * QK;
        const __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w));
        iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
    for (int r = 0; r < ROWS; ++r) {
      const __m256 s = _mm256_set1_ps(XS[(r0 + r) * kb_count + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(iacc[r]), s), d, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    c10::BFloat16* y = Y + (r0 + r) * n + col0 + 8 * h;
    for (int c = 0; c < 8; ++c) y[c] = c10::BFloat16(out[c]);
  }
}

// Rows r0 .. r0 + rows - 1 (rows <= 4) times one panel of 32 Q8_0 columns -> y (bf16).
void q8_panel_rows(const int8_t* X, const float* XS, const int32_t* /*ISUM*/, const uint8_t* panel,
                   int64_t k, int64_t r0, int rows, c10::BFloat16* Y, int64_t n, int64_t col0) {
  const int64_t group_bytes = (k / QK) * Q8_GROUP_BYTES;
  for (int g = 0; g < PANEL_N / GROUP_N; ++g)
    for (int h = 0; h < 2; ++h) {
      const uint8_t* group = panel + g * group_bytes;
      const int64_t c0 = col0 + g * GROUP_N;
      with_rows(rows, [&](auto r) {
        q8_half_rows<decltype(r)::value>(X, XS, group, k, r0, h, Y, n, c0);
      });
    }
}

#endif  // GENSERVE_Q4Q8_AVX512 / AVX2

#endif  // GENSERVE_Q4Q8_LINEAR

}  // namespace

namespace genserve {

namespace {

// Checks shared by both ops: x bf16 [M, K] contiguous, K a positive multiple of 32; packed uint8
// [n, K / 32 * col_bytes] contiguous; n a positive multiple of 32.
void check_operands(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                    int64_t col_bytes) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              op, ": x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) % col_bytes == 0,
              op, ": packed must be a contiguous uint8 [N, K / 32 * ", col_bytes, "] tensor");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % QK == 0 && k > 0, op, ": K must be a positive multiple of ", QK, ", got ", k);
  TORCH_CHECK(n > 0 && n % PANEL_N == 0, op, ": N must be a positive multiple of ", PANEL_N,
              ", got ", n);
  TORCH_CHECK(packed.size(0) == n, op, ": packed has ", packed.size(0), " rows, n = ", n);
  TORCH_CHECK(packed.size(1) / col_bytes * QK == k, op, ": x has K = ", k, ", the weight ",
              packed.size(1) / col_bytes * QK);
#ifndef GENSERVE_Q4Q8_LINEAR
  TORCH_CHECK(false, op, ": this build of genserve's kernels has no int8 product (it needs a "
              "compiler targeting AVX512-VNNI, AVX512-BF16 and AVX512BW, or AVX2, FMA and F16C; "
              "engine.kernels.q4q8_linear_available() is False here)");
#endif
}

#ifdef GENSERVE_Q4Q8_LINEAR
// x's rows rounded to 8 bits per block of 32 (the top of the file), once per call.
genserve::Q8Rows round_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), kb_count = k / QK;
  genserve::Q8Rows rows(m, k);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * k, k, rows.xq.get() + r * k, rows.scale.get() + r * kb_count,
                   rows.xsum.get() + r * kb_count, rows.isum.get() + r * kb_count);
  });
  return rows;
}

// y = x @ W^T for packed weights of `group_bytes` per 16 columns and 32 k: x's rows rounded
// once (RoundedRows), then panel(rows, the panel's weights, r0, count, y, first column) for every
// panel of 32 columns (split across threads) and row tile of up to 4 rows.
template <typename Panel>
at::Tensor rounded_rows_times(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                              int64_t group_bytes, const Panel& panel,
                              const genserve::Q8Rows* rounded = nullptr) {
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  std::optional<genserve::Q8Rows> own;
  if (rounded == nullptr) own.emplace(round_rows(x));
  const genserve::Q8Rows& rows = rounded != nullptr ? *rounded : *own;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t panel_bytes = (PANEL_N / GROUP_N) * (x.size(1) / QK) * group_bytes;
  at::parallel_for(0, n / PANEL_N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r0 = 0; r0 < m; r0 += 4)
        panel(rows, w + p * panel_bytes, r0, static_cast<int>(std::min<int64_t>(4, m - r0)), yp,
              p * PANEL_N);
  });
  return y;
}
#endif

}  // namespace

// x: bf16 [M, K] contiguous, K % 32 == 0; packed: uint8 [N, K / 32 * 20] contiguous, W's Q4_1
// blocks in the layout above (`engine.model.quant.q4q8_pack`); n: N, a multiple of 32. Returns
// bf16 [M, N]. Raises (RuntimeError) on another dtype or shape, and on a build whose compiler
// targeted neither AVX512-VNNI with AVX512-BF16 and AVX512BW nor AVX2 with FMA and F16C
// (`engine.kernels.q4q8_linear_available()` says whether this build has it). rounded: x's rows
// as `q8_round_rows` gives them (null: rounded here), for a caller that needs them again.
at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const genserve::Q8Rows* rounded) {
  check_operands("q4q8_linear", x, packed, n, GROUP_BYTES / GROUP_N);
  TORCH_CHECK(rounded == nullptr || rounded->k == x.size(1), "q4q8_linear: rounded rows of another K");
#ifdef GENSERVE_Q4Q8_LINEAR
  return rounded_rows_times(x, packed, n, GROUP_BYTES,
                            [&](const genserve::Q8Rows& rows, const uint8_t* panel, int64_t r0,
                                int count, c10::BFloat16* y, int64_t col0) {
    panel_rows(rows.xq.get(), rows.scale.get(), rows.xsum.get(), panel, x.size(1), r0, count,
               y, n, col0);
  }, rounded);
#else
  return at::Tensor();     // unreachable: check_operands raised
#endif
}

// x: bf16 [M, K] contiguous, K % 32 == 0 -> its rows rounded as `q4q8_linear` rounds them (q8_rows.h).
// Raises (RuntimeError) where `q4q8_linear` would.
genserve::Q8Rows q8_round_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) % QK == 0,
              "q8_round_rows: x must be a contiguous bf16 [M, K] tensor, K a multiple of ", QK);
#ifdef GENSERVE_Q4Q8_LINEAR
  return round_rows(x);
#else
  TORCH_CHECK(false, "q8_round_rows: this build of genserve's kernels has no int8 product");
#endif
}

// x: bf16 [M, K] contiguous, K % 32 == 0; packed: uint8 [N, K / 32 * 34] contiguous, W's Q8_0
// blocks in `q8q8_linear`'s layout (`engine.model.quant.q8q8_pack`); n: N, a multiple of 32.
// Returns bf16 [M, N]: llama.cpp's Q8_0 x Q8_0 product (above). Raises as `q4q8_linear`.
at::Tensor q8q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_operands("q8q8_linear", x, packed, n, Q8_GROUP_BYTES_PER_COLUMN);
#ifdef GENSERVE_Q4Q8_LINEAR
  return rounded_rows_times(x, packed, n, Q8_GROUP_BYTES,
                            [&](const genserve::Q8Rows& rows, const uint8_t* panel, int64_t r0,
                                int count, c10::BFloat16* y, int64_t col0) {
    q8_panel_rows(rows.xq.get(), rows.scale.get(), rows.isum.get(), panel, x.size(1), r0,
                  count, y, n, col0);
  });
#else
  return at::Tensor();     // unreachable: check_operands raised
#endif
}

// The op: `q4q8_linear` rounding x itself.
at::Tensor q4q8_linear_op(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  return q4q8_linear(x, packed, n, nullptr);
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("q4q8_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("q8q8_linear(Tensor x, Tensor packed, int n) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("q4q8_linear", &genserve::q4q8_linear_op);
  m.impl("q8q8_linear", &genserve::q8q8_linear);
}
