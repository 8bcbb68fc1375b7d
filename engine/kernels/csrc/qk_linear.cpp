// y = x @ W^T with W in the GGUF's K-quant blocks, Q4_K or Q6_K (256 weights of one row along k
// per super-block, with sub-block scales), and x rounded to Q8_K inside the call (int8 per row and
// super-block, one fp32 scale, int16 sums of every 16): llama.cpp's arithmetic for these types,
// integer dot products per sub-block, scaled in fp32. The formats, the rounding and the product
// are spelled out in engine/model/kquant.py's docstring (from ggml: `block_q4_K`, `block_q6_K`,
// `quantize_row_q8_K_ref`, `ggml_vec_dot_q4_K_q8_K`, `ggml_vec_dot_q6_K_q8_K`), and
// `engine.model.kquant.qk_linear_reference` does the same steps in torch ops.
//
// Activation rounding, once per call, per row r and super-block b (one IEEE operation each):
//
//   amax     = max |x[r, 256b .. 256b + 255]|                    (x bf16 or fp32, widened exactly)
//   iscale   = fp32(127 / amax)        (amax 0: q = 0, d = 0)
//   q[r, k]  = min(127, round_half_even(fp32(iscale * x[r, k])))
//   d[r, b]  = fp32(1 / iscale)
//   bs16     = Σ q over each 16 k; bs32 = Σ q over each 32 k (exact)
//
// ggml takes iscale = -127 / max with max the signed x of largest |x|: where that x is positive
// its q, d and sums are these negated, and negating both factors of every product below leaves
// every result bit unchanged (IEEE rounding is symmetric), so the outputs are ggml's.
//
// Products, per output column n and row r, over the super-blocks b in k order (fp32 acc from 0,
// rounded once to x's dtype at the end), in every path:
//
//   Q4_K: isum = Σ_{s<8} sc[n,b,s] · Σ_{k in s} q4[n,k] · q[r,k]       (exact int32)
//         imin = Σ_{s<8} m[n,b,s] · bs32[r, 8b + s]                     (exact int32)
//         acc  = fma(fp32(d[r,b] · d4[n,b]), fp32(isum), acc)
//         acc  = fma(-fp32(d[r,b] · dmin[n,b]), fp32(imin), acc)
//   Q6_K: isum = Σ_{s<16} sc[n,b,s] · Σ_{k in s} (q6[n,k] - 32) · q[r,k] (exact int32)
//         acc  = fma(fp32(d[r,b] · d6[n,b]), fp32(isum), acc)
//
// Bounds: a Q4_K sub-block sum is at most 32 · 15 · 127 = 60,960, isum < 8 · 63 · 60,960 < 2^25;
// a Q6_K one at most 16 · 32 · 127 = 65,024 (with the +32 offset and the bs16 correction apart,
// 16 · 63 · 127 + 32 · 2,032), isum < 16 · 128 · 65,024 < 2^28: int32 everywhere, exact.
//
// Layout (`engine.model.kquant.q4_k_pack` / `q6_k_pack`): [N/16 groups][K/256 super-blocks]
// records of 16 output columns:
//
//   Q4_K, 2,368 bytes: d[16] fp16 | dmin[16] fp16 | sc[8 s][16 c] u8 | m[4 p][16 c][2] u8 |
//                      qs[4 p][8 j][16 c][4 i]   (byte: q of weight 64p + 4j + i low,
//                                                 64p + 32 + 4j + i high)
//   Q6_K, 3,360 bytes: d[16] fp16 | sc[16 s][16 c] s8 |
//                      [2 h][8 j]{ A[16 c][4 i] = ql[64h + 4j + i], B = ql[64h + 32 + 4j + i],
//                                  H = qh[32h + 4j + i] }
//
// so a 64-byte row is 16 columns x 4 consecutive k of one sub-block: one vpdpbusd against 4 bytes
// of x broadcast (AVX512-VNNI), or two halves of 8 columns for vpmaddubsw (AVX2).
//
// Paths, chosen at run time (`path`: -1 the best this CPU has, or GENSERVE_QK_PATH, else 0
// scalar, 1 AVX2 (+FMA, F16C), 2 AVX512-VNNI (+BW, VL)); each is compiled with its own target
// attribute, so every build has every x86 path. The integer sums are exact whatever instructions
// add them, and every path runs the fp32 operations above in that order, with vcvtdq2ps / cvtsi2ss
// (round to nearest even) for the int32 to fp32 conversions, so all give the same bits:
//
//   * AVX512-VNNI: vpdpbusd (u8 weights x s8 activations into int32) per sub-block, vpmulld by
//     the sub-block scale, vpdpwssd for the Q4_K mins (int16 pairs); Q6_K's weights go in as
//     q + 32 (0..63, unsigned) and each sub-block's sum starts at -32 · bs16.
//   * AVX2: vpmaddubsw (pairs to int16; a Q4_K sub-block's 16 pair sums per column stay below
//     2^15: 8 · 2 · 15 · 127 = 30,480; Q6_K's in two accumulators of 2 · 2 · 63 · 127 = 32,004),
//     vpmaddwd by the scale repeated in both int16 halves (into int32), Q6_K's -32 · sc · bs16
//     apart with one more vpmaddwd.
//   * scalar: int32 loops, std::fma.
//
// Work: at::parallel_for over panels of up to 64 output columns (4 groups); within a panel, each
// group in turn, row tiles of up to 4 rows. A row's operations and their order never depend on
// the tile it falls in, on M or on the threads, so a row's bits never depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#define GENSERVE_QK_X86 1
#include <immintrin.h>
#endif

#include "genserve_ops.h"
#include "prefetch.h"

namespace {

constexpr int64_t QK_K = 256;
constexpr int64_t KIND_Q4_K = 12;                // gguf.GGMLQuantizationType.Q4_K
constexpr int64_t KIND_Q6_K = 14;                // gguf.GGMLQuantizationType.Q6_K
constexpr int64_t GROUP_N = 16;                  // output columns per record
constexpr int64_t PANEL_GROUPS = 4;              // groups per parallel work unit (64 columns)
constexpr int64_t ROW_TILE = 4;
constexpr int64_t PREFETCH_RECORDS = 4;          // how far ahead a group's first row tile prefetches
constexpr int64_t Q4K_RECORD = 2368, Q4K_D = 0, Q4K_DMIN = 32, Q4K_SC = 64, Q4K_M = 192,
                  Q4K_QS = 320;
constexpr int64_t Q6K_RECORD = 3360, Q6K_D = 0, Q6K_SC = 32, Q6K_Q = 288;
constexpr int PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2;

int64_t record_bytes(int64_t kind) { return kind == KIND_Q4_K ? Q4K_RECORD : Q6K_RECORD; }

// x's rows in Q8_K (the top of the file), once per call.
struct Q8KRows {
  int64_t m = 0, k = 0, nb = 0;
  std::vector<int8_t> q;        // [m, k]
  std::vector<float> d;         // [m, nb]
  std::vector<int16_t> bs16;    // [m, k / 16]
  std::vector<int16_t> bs32;    // [m, k / 32]

  const int8_t* qrow(int64_t r, int64_t b) const { return q.data() + r * k + b * QK_K; }
  float dx(int64_t r, int64_t b) const { return d[r * nb + b]; }
  const int16_t* b16(int64_t r, int64_t b) const { return bs16.data() + r * (k / 16) + b * 16; }
  const int16_t* b32(int64_t r, int64_t b) const { return bs32.data() + r * (k / 32) + b * 8; }
};

// a / b rounded once (a division the compiler may not turn into a reciprocal's product).
inline float div_rn(float a, float b) {
#ifdef GENSERVE_QK_X86
  return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b)));
#else
  volatile float q = a / b;
  return q;
#endif
}

// Keeps `v` as computed (one rounded operation): no later reassociation folds it into another.
template <typename T>
inline void pin(T& v) {
#ifdef GENSERVE_QK_X86
  asm("" : "+x"(v));
#else
  asm("" : "+m"(v));
#endif
}

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, int16_t* bs16, int16_t* bs32) {
  for (int64_t b = 0; b < k / QK_K; ++b) {
    float v[QK_K];
    float amax = 0.f;
    for (int j = 0; j < QK_K; ++j) {
      v[j] = static_cast<float>(x[b * QK_K + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    int8_t* qb = q + b * QK_K;
    if (!(amax > 0.f)) {
      std::memset(qb, 0, QK_K);
      std::fill(bs16 + b * 16, bs16 + b * 16 + 16, int16_t(0));
      std::fill(bs32 + b * 8, bs32 + b * 8 + 8, int16_t(0));
      d[b] = 0.f;
      continue;
    }
    const float iscale = div_rn(127.f, amax);
    for (int j = 0; j < QK_K; ++j) {
      const long t = std::lrint(iscale * v[j]);
      qb[j] = static_cast<int8_t>(std::min<long>(127, t));
    }
    for (int s = 0; s < 16; ++s) {
      int sum = 0;
      for (int i = 0; i < 16; ++i) sum += qb[16 * s + i];
      bs16[b * 16 + s] = static_cast<int16_t>(sum);
    }
    for (int p = 0; p < 8; ++p)
      bs32[b * 8 + p] = static_cast<int16_t>(bs16[b * 16 + 2 * p] + bs16[b * 16 + 2 * p + 1]);
    d[b] = div_rn(1.f, iscale);
  }
}

Q8KRows round_rows(const at::Tensor& x) {
  Q8KRows rows;
  rows.m = x.size(0);
  rows.k = x.size(1);
  rows.nb = rows.k / QK_K;
  rows.q.resize(rows.m * rows.k);
  rows.d.resize(rows.m * rows.nb);
  rows.bs16.resize(rows.m * rows.k / 16);
  rows.bs32.resize(rows.m * rows.k / 32);
  const int64_t k = rows.k, nb = rows.nb;
  at::parallel_for(0, rows.m, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* q = rows.q.data() + r * k;
      float* d = rows.d.data() + r * nb;
      int16_t* b16 = rows.bs16.data() + r * (k / 16);
      int16_t* b32 = rows.bs32.data() + r * (k / 32);
      if (x.scalar_type() == at::kBFloat16)
        quantize_row(x.data_ptr<c10::BFloat16>() + r * k, k, q, d, b16, b32);
      else
        quantize_row(x.data_ptr<float>() + r * k, k, q, d, b16, b32);
    }
  });
  return rows;
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One row tile: rows r0 .. r0 + rows - 1 times groups g .. g + groups - 1 of a segment (records
// from `group0`, `group_bytes` apart) -> fp32 sums into out[r * ldo + 16 g + c].
using PanelFn = void (*)(const Q8KRows& X, int64_t r0, int rows, const uint8_t* group0,
                         int groups, int64_t group_bytes, float* out, int64_t ldo, bool prefetch);

// ---- scalar ------------------------------------------------------------------------------------

void q4k_scalar(const Q8KRows& X, int64_t r0, int rows, const uint8_t* group0, int groups,
                int64_t group_bytes, float* out, int64_t ldo, bool /*prefetch*/) {
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      float acc[GROUP_N] = {};
      for (int64_t b = 0; b < X.nb; ++b) {
        const uint8_t* rec = group0 + g * group_bytes + b * Q4K_RECORD;
        const int8_t* xq = X.qrow(r0 + r, b);
        const int16_t* b32 = X.b32(r0 + r, b);
        const float xd = X.dx(r0 + r, b);
        for (int c = 0; c < GROUP_N; ++c) {
          int32_t isum = 0;
          for (int s = 0; s < 8; ++s) {
            const int p = s >> 1, shift = 4 * (s & 1);
            int32_t a = 0;
            for (int j = 0; j < 8; ++j)
              for (int i = 0; i < 4; ++i) {
                const int w = (rec[Q4K_QS + p * 512 + j * 64 + c * 4 + i] >> shift) & 15;
                a += w * xq[64 * p + 32 * (s & 1) + 4 * j + i];
              }
            isum += a * rec[Q4K_SC + s * 16 + c];
          }
          int32_t imin = 0;
          for (int p = 0; p < 4; ++p)
            imin += rec[Q4K_M + p * 32 + 2 * c] * b32[2 * p] +
                    rec[Q4K_M + p * 32 + 2 * c + 1] * b32[2 * p + 1];
          float t1 = xd * half_at(rec + Q4K_D + 2 * c);
          pin(t1);
          acc[c] = std::fma(t1, static_cast<float>(isum), acc[c]);
          float t2 = xd * half_at(rec + Q4K_DMIN + 2 * c);
          pin(t2);
          acc[c] = std::fma(-t2, static_cast<float>(imin), acc[c]);
          pin(acc[c]);
        }
      }
      for (int c = 0; c < GROUP_N; ++c) out[r * ldo + g * GROUP_N + c] = acc[c];
    }
}

void q6k_scalar(const Q8KRows& X, int64_t r0, int rows, const uint8_t* group0, int groups,
                int64_t group_bytes, float* out, int64_t ldo, bool /*prefetch*/) {
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      float acc[GROUP_N] = {};
      for (int64_t b = 0; b < X.nb; ++b) {
        const uint8_t* rec = group0 + g * group_bytes + b * Q6K_RECORD;
        const int8_t* xq = X.qrow(r0 + r, b);
        const float xd = X.dx(r0 + r, b);
        for (int c = 0; c < GROUP_N; ++c) {
          int32_t sub[16] = {};
          for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 8; ++j) {
              const uint8_t* row = rec + Q6K_Q + (h * 8 + j) * 192 + c * 4;
              for (int i = 0; i < 4; ++i) {
                const int A = row[i], B = row[64 + i], H = row[128 + i];
                const int q6[4] = {(A & 15) | ((H & 3) << 4), (B & 15) | (((H >> 2) & 3) << 4),
                                   (A >> 4) | (((H >> 4) & 3) << 4), (B >> 4) | ((H >> 6) << 4)};
                for (int t = 0; t < 4; ++t) {
                  const int k = 128 * h + 32 * t + 4 * j + i;
                  sub[k / 16] += (q6[t] - 32) * xq[k];
                }
              }
            }
          int32_t isum = 0;
          for (int s = 0; s < 16; ++s)
            isum += sub[s] * static_cast<int8_t>(rec[Q6K_SC + s * 16 + c]);
          float t1 = xd * half_at(rec + Q6K_D + 2 * c);
          pin(t1);
          acc[c] = std::fma(t1, static_cast<float>(isum), acc[c]);
          pin(acc[c]);
        }
      }
      for (int c = 0; c < GROUP_N; ++c) out[r * ldo + g * GROUP_N + c] = acc[c];
    }
}

#ifdef GENSERVE_QK_X86

// Line `line` of the record PREFETCH_RECORDS super-blocks past `rec`, asked for into L2: one
// 64-byte line per call, so a super-block's lines spread over its inner loop. Only a group's first
// row tile asks (it reads the group from memory; later tiles find it in cache). Measured on the
// Zen 4 dev host, 48 distinct 4,096 x 2,048 matrices, one thread: at 4 rows 18.6 GB/s against 9.6
// without and 14.9 prefetching 2 records ahead into L1; at one row within the noise (12-23 GB/s
// either way, on a shared host).
inline void prefetch_line(const uint8_t* rec, int64_t record, int line) {
  if (line * 64 < record) genserve::prefetch_l2(rec + PREFETCH_RECORDS * record + line * 64);
}

// ---- AVX2 ----------------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace avx2 {

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }

// Rows r0 .. r0 + R - 1 times columns 8 hh .. 8 hh + 7 of the group at `grp` (Q4_K).
template <int R>
void q4k_half(const Q8KRows& X, int64_t r0, const uint8_t* grp, int hh, float* out, int64_t ldo,
              bool prefetch) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* rec = grp + b * Q4K_RECORD;
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = X.qrow(r0 + r, b);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const int p = s >> 1, hi = s & 1;
      __m256i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        if (prefetch && hh == 0) prefetch_line(rec, Q4K_RECORD, s * 8 + j);
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(rec + Q4K_QS + p * 512 + j * 64 + 32 * hh));
        const __m256i w = hi ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low)
                             : _mm256_and_si256(v, low);
        for (int r = 0; r < R; ++r)
          a[r] = _mm256_add_epi16(a[r], _mm256_maddubs_epi16(w, bcast4(xq[r] + 64 * p + 32 * hi + 4 * j)));
      }
      const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + Q4K_SC + s * 16 + 8 * hh));
      const __m256i scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s8, s8));   // (sc, sc) per column
      for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(a[r], scale));
    }
    __m256i imin[R];
    for (int r = 0; r < R; ++r) imin[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      const __m256i mins = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + Q4K_M + p * 32 + 16 * hh)));
      for (int r = 0; r < R; ++r)
        imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(load_i32(X.b32(r0 + r, b) + 2 * p))));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + Q4K_D + 16 * hh)));
    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + Q4K_DMIN + 16 * hh)));
    for (int r = 0; r < R; ++r) {
      const __m256 xd = _mm256_set1_ps(X.dx(r0 + r, b));
      __m256 t1 = _mm256_mul_ps(xd, dw);
      __m256 t2 = _mm256_mul_ps(xd, dm);
      pin(t1);
      pin(t2);
      acc[r] = _mm256_fmadd_ps(t1, _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fnmadd_ps(t2, _mm256_cvtepi32_ps(imin[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * hh, acc[r]);
}

// Q6_K row `t` (0: A low, 1: B low, 2: A high, 3: B high) of (h, j) at `row` as q + 32 (0..63).
template <int T>
inline __m256i q6_decode(const uint8_t* row, int hh) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i src = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (T & 1) * 64 + 32 * hh));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 128 + 32 * hh));
  const __m256i nib = T < 2 ? _mm256_and_si256(src, low) : _mm256_and_si256(_mm256_srli_epi16(src, 4), low);
  const __m256i hb = T == 0 ? _mm256_slli_epi16(h, 4) : T == 1 ? _mm256_slli_epi16(h, 2)
                   : T == 2 ? h : _mm256_srli_epi16(h, 2);
  return _mm256_or_si256(nib, _mm256_and_si256(hb, top));
}

// Sub-block s = 8h + jq + 2T of rows r0 .. r0 + R - 1 into isum (Q6_K, columns 8 hh ..).
template <int R, int T>
inline void q6k_sub(const Q8KRows& X, int64_t r0, int64_t b, const uint8_t* rec, int hh, int h,
                    int jq, __m256i* isum, bool prefetch) {
  const int s = 8 * h + jq + 2 * T;
  __m256i a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
  for (int jj = 0; jj < 4; ++jj) {
    const int j = 4 * jq + jj;
    if (prefetch && hh == 0) prefetch_line(rec, Q6K_RECORD, ((h * 2 + jq) * 4 + T) * 4 + jj);
    const __m256i w = q6_decode<T>(rec + Q6K_Q + (h * 8 + j) * 192, hh);
    for (int r = 0; r < R; ++r) {
      const __m256i prod = _mm256_maddubs_epi16(w, bcast4(X.qrow(r0 + r, b) + 128 * h + 32 * T + 4 * j));
      if (jj & 1) a1[r] = _mm256_add_epi16(a1[r], prod);
      else a0[r] = _mm256_add_epi16(a0[r], prod);
    }
  }
  const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + Q6K_SC + s * 16 + 8 * hh));
  const __m256i scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8));      // (sc, sc) per column
  for (int r = 0; r < R; ++r) {
    const __m256i bs = _mm256_set1_epi32(static_cast<uint16_t>(X.b16(r0 + r, b)[s]));   // (bs16, 0)
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(a0[r], scale), _mm256_madd_epi16(a1[r], scale));
    isum[r] = _mm256_add_epi32(isum[r], _mm256_sub_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(scale, bs), 5)));
  }
}

template <int R>
void q6k_half(const Q8KRows& X, int64_t r0, const uint8_t* grp, int hh, float* out, int64_t ldo,
              bool prefetch) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* rec = grp + b * Q6K_RECORD;
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h)
      for (int jq = 0; jq < 2; ++jq) {
        q6k_sub<R, 0>(X, r0, b, rec, hh, h, jq, isum, prefetch);
        q6k_sub<R, 1>(X, r0, b, rec, hh, h, jq, isum, prefetch);
        q6k_sub<R, 2>(X, r0, b, rec, hh, h, jq, isum, prefetch);
        q6k_sub<R, 3>(X, r0, b, rec, hh, h, jq, isum, prefetch);
      }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + Q6K_D + 16 * hh)));
    for (int r = 0; r < R; ++r) {
      __m256 t1 = _mm256_mul_ps(_mm256_set1_ps(X.dx(r0 + r, b)), dw);
      pin(t1);
      acc[r] = _mm256_fmadd_ps(t1, _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * hh, acc[r]);
}

template <bool Q4, int R>
void half_tile(const Q8KRows& X, int64_t r0, const uint8_t* grp, int hh, float* out, int64_t ldo,
               bool prefetch) {
  if constexpr (Q4) q4k_half<R>(X, r0, grp, hh, out, ldo, prefetch);
  else q6k_half<R>(X, r0, grp, hh, out, ldo, prefetch);
}

// Rows in tiles of up to 4 (Q4_K) or 2 (Q6_K, whose two int16 accumulators per row need more
// registers), each group's two halves of 8 columns in turn.
template <bool Q4>
void panel(const Q8KRows& X, int64_t r0, int rows, const uint8_t* group0, int groups,
           int64_t group_bytes, float* out, int64_t ldo, bool prefetch) {
  constexpr int MAX_R = Q4 ? 4 : 2;
  for (int g = 0; g < groups; ++g)
    for (int hh = 0; hh < 2; ++hh)
      for (int r = 0; r < rows; r += MAX_R) {
        const int n = std::min(MAX_R, rows - r);
        const uint8_t* grp = group0 + g * group_bytes;
        float* o = out + r * ldo + g * GROUP_N;
        const bool pf = prefetch && r == 0;
        switch (n) {
          case 4: half_tile<Q4, (MAX_R >= 4 ? 4 : 1)>(X, r0 + r, grp, hh, o, ldo, pf); break;
          case 3: half_tile<Q4, (MAX_R >= 3 ? 3 : 1)>(X, r0 + r, grp, hh, o, ldo, pf); break;
          case 2: half_tile<Q4, 2>(X, r0 + r, grp, hh, o, ldo, pf); break;
          default: half_tile<Q4, 1>(X, r0 + r, grp, hh, o, ldo, pf); break;
        }
      }
}

}  // namespace avx2

#pragma GCC pop_options

// ---- AVX512-VNNI -------------------------------------------------------------------------------

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

namespace avx512 {

constexpr int RN = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// Rows r0 .. r0 + R - 1 times G groups of 16 columns (Q4_K) -> out.
template <int R, int G>
void q4k_tile(const Q8KRows& X, int64_t r0, const uint8_t* group0, int64_t group_bytes,
              float* out, int64_t ldo, bool prefetch) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* rec[G];
    for (int g = 0; g < G; ++g) rec[g] = group0 + g * group_bytes + b * Q4K_RECORD;
    const int8_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = X.qrow(r0 + r, b);
    __m512i isum[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) isum[r][g] = _mm512_setzero_si512();
    for (int s = 0; s < 8; ++s) {
      const int p = s >> 1, hi = s & 1;
      __m512i a[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) a[r][g] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        if (prefetch)
          for (int g = 0; g < G; ++g) prefetch_line(rec[g], Q4K_RECORD, s * 8 + j);
        __m512i w[G];
        for (int g = 0; g < G; ++g) {
          const __m512i v = _mm512_loadu_si512(rec[g] + Q4K_QS + p * 512 + j * 64);
          w[g] = hi ? _mm512_and_si512(_mm512_srli_epi16(v, 4), low) : _mm512_and_si512(v, low);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xb = bcast4(xq[r] + 64 * p + 32 * hi + 4 * j);
          for (int g = 0; g < G; ++g) a[r][g] = _mm512_dpbusd_epi32(a[r][g], w[g], xb);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512i scale = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[g] + Q4K_SC + s * 16)));
        for (int r = 0; r < R; ++r)
          isum[r][g] = _mm512_add_epi32(isum[r][g], _mm512_mullo_epi32(a[r][g], scale));
      }
    }
    __m512i imin[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) imin[r][g] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p)
      for (int g = 0; g < G; ++g) {
        const __m512i mins = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[g] + Q4K_M + p * 32)));
        for (int r = 0; r < R; ++r)
          imin[r][g] = _mm512_dpwssd_epi32(imin[r][g], mins,
                                           _mm512_set1_epi32(load_i32(X.b32(r0 + r, b) + 2 * p)));
      }
    for (int g = 0; g < G; ++g) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[g] + Q4K_D)));
      const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[g] + Q4K_DMIN)));
      for (int r = 0; r < R; ++r) {
        const __m512 xd = _mm512_set1_ps(X.dx(r0 + r, b));
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_round_ps(xd, dw, RN), _mm512_cvtepi32_ps(isum[r][g]), acc[r][g]);
        acc[r][g] = _mm512_fnmadd_ps(_mm512_mul_round_ps(xd, dm, RN), _mm512_cvtepi32_ps(imin[r][g]), acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * ldo + g * GROUP_N, acc[r][g]);
}

// Q6_K row `T` (0: A low, 1: B low, 2: A high, 3: B high) at `row` as q + 32 (0..63).
template <int T>
inline __m512i q6_decode(const uint8_t* row) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i src = _mm512_loadu_si512(row + (T & 1) * 64);
  const __m512i h = _mm512_loadu_si512(row + 128);
  const __m512i nib = T < 2 ? _mm512_and_si512(src, low) : _mm512_and_si512(_mm512_srli_epi16(src, 4), low);
  const __m512i hb = T == 0 ? _mm512_slli_epi16(h, 4) : T == 1 ? _mm512_slli_epi16(h, 2)
                   : T == 2 ? h : _mm512_srli_epi16(h, 2);
  return _mm512_ternarylogic_epi32(nib, hb, top, 0xF8);       // nib | (hb & 0x30)
}

// Sub-block s = 8h + jq + 2T of R rows times G groups, into isum (Q6_K).
template <int R, int G, int T>
inline void q6k_sub(const Q8KRows& X, int64_t r0, int64_t b, const uint8_t* const* rec, int h,
                    int jq, __m512i (*isum)[G], bool prefetch) {
  const int s = 8 * h + jq + 2 * T;
  __m512i a[R][G];
  for (int r = 0; r < R; ++r) {
    const __m512i start = _mm512_set1_epi32(-32 * X.b16(r0 + r, b)[s]);
    for (int g = 0; g < G; ++g) a[r][g] = start;
  }
  for (int jj = 0; jj < 4; ++jj) {
    const int j = 4 * jq + jj;
    if (prefetch)
      for (int g = 0; g < G; ++g) prefetch_line(rec[g], Q6K_RECORD, ((h * 2 + jq) * 4 + T) * 4 + jj);
    __m512i w[G];
    for (int g = 0; g < G; ++g) w[g] = q6_decode<T>(rec[g] + Q6K_Q + (h * 8 + j) * 192);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = bcast4(X.qrow(r0 + r, b) + 128 * h + 32 * T + 4 * j);
      for (int g = 0; g < G; ++g) a[r][g] = _mm512_dpbusd_epi32(a[r][g], w[g], xb);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512i scale = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec[g] + Q6K_SC + s * 16)));
    for (int r = 0; r < R; ++r) isum[r][g] = _mm512_add_epi32(isum[r][g], _mm512_mullo_epi32(a[r][g], scale));
  }
}

template <int R, int G>
void q6k_tile(const Q8KRows& X, int64_t r0, const uint8_t* group0, int64_t group_bytes,
              float* out, int64_t ldo, bool prefetch) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < X.nb; ++b) {
    const uint8_t* rec[G];
    for (int g = 0; g < G; ++g) rec[g] = group0 + g * group_bytes + b * Q6K_RECORD;
    __m512i isum[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) isum[r][g] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h)
      for (int jq = 0; jq < 2; ++jq) {
        q6k_sub<R, G, 0>(X, r0, b, rec, h, jq, isum, prefetch);
        q6k_sub<R, G, 1>(X, r0, b, rec, h, jq, isum, prefetch);
        q6k_sub<R, G, 2>(X, r0, b, rec, h, jq, isum, prefetch);
        q6k_sub<R, G, 3>(X, r0, b, rec, h, jq, isum, prefetch);
      }
    for (int g = 0; g < G; ++g) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[g] + Q6K_D)));
      for (int r = 0; r < R; ++r)
        acc[r][g] = _mm512_fmadd_ps(_mm512_mul_round_ps(_mm512_set1_ps(X.dx(r0 + r, b)), dw, RN),
                                    _mm512_cvtepi32_ps(isum[r][g]), acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * ldo + g * GROUP_N, acc[r][g]);
}

template <bool Q4, int R, int G>
void tile(const Q8KRows& X, int64_t r0, const uint8_t* group0, int64_t group_bytes, float* out,
          int64_t ldo, bool prefetch) {
  if constexpr (Q4) q4k_tile<R, G>(X, r0, group0, group_bytes, out, ldo, prefetch);
  else q6k_tile<R, G>(X, r0, group0, group_bytes, out, ldo, prefetch);
}

// Each group in turn (G = 1), its rows in one tile of up to 4 (ROW_TILE): the group's records
// are then one sequential stream. The tiles take G groups side by side too, but at one row 2 or 4
// groups at a time (2 or 4 interleaved streams, more independent sums) read 48 distinct
// 4,096 x 2,048 Q4_K matrices at 11.6 and 10.1 GB/s against 17.4 for one (one thread, no
// prefetch, the same run), so only G = 1 is used.
template <bool Q4>
void panel(const Q8KRows& X, int64_t r0, int rows, const uint8_t* group0, int groups,
           int64_t group_bytes, float* out, int64_t ldo, bool prefetch) {
  for (int g = 0; g < groups; ++g) {
    const uint8_t* grp = group0 + g * group_bytes;
    float* o = out + g * GROUP_N;
    switch (rows) {
      case 4: tile<Q4, 4, 1>(X, r0, grp, group_bytes, o, ldo, prefetch); break;
      case 3: tile<Q4, 3, 1>(X, r0, grp, group_bytes, o, ldo, prefetch); break;
      case 2: tile<Q4, 2, 1>(X, r0, grp, group_bytes, o, ldo, prefetch); break;
      default: tile<Q4, 1, 1>(X, r0, grp, group_bytes, o, ldo, prefetch); break;
    }
  }
}

}  // namespace avx512

#pragma GCC pop_options

#endif  // GENSERVE_QK_X86

// The best path this CPU runs (at run time; the OS's AVX512 state counts, as GCC checks it).
int detect_path() {
#ifdef GENSERVE_QK_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    return PATH_AVX512;
  if (avx2) return PATH_AVX2;
#endif
  return PATH_SCALAR;
}

const char* path_name(int path) {
  return path == PATH_AVX512 ? "avx512" : path == PATH_AVX2 ? "avx2" : "scalar";
}

int resolve_path(int64_t path) {
  static const int best = detect_path();
  if (path < 0) {
    const char* env = std::getenv("GENSERVE_QK_PATH");
    if (env == nullptr || *env == '\0') return best;
    const std::string name(env);
    TORCH_CHECK(name == "scalar" || name == "avx2" || name == "avx512",
                "qk_linear: GENSERVE_QK_PATH=", name, " names no path (scalar, avx2, avx512)");
    path = name == "avx512" ? PATH_AVX512 : name == "avx2" ? PATH_AVX2 : PATH_SCALAR;
  }
  TORCH_CHECK(path <= PATH_AVX512, "qk_linear: path ", path, " is not 0 (scalar), 1 (avx2) or 2 (avx512)");
  TORCH_CHECK(path <= best, "qk_linear: the ", path_name(static_cast<int>(path)),
              " path cannot run on this CPU (its best is ", path_name(best), ")");
  return static_cast<int>(path);
}

PanelFn panel_fn(int path, int64_t kind) {
  const bool q4 = kind == KIND_Q4_K;
#ifdef GENSERVE_QK_X86
  if (path == PATH_AVX512) return q4 ? &avx512::panel<true> : &avx512::panel<false>;
  if (path == PATH_AVX2) return q4 ? &avx2::panel<true> : &avx2::panel<false>;
#endif
  return q4 ? &q4k_scalar : &q6k_scalar;
}

}  // namespace

namespace genserve {

// x: bf16 or fp32 [M, K] contiguous, K a positive multiple of 256; weights: row segments of W,
// each uint8 [n_i, K / 256 · 148] (Q4_K, `engine.model.kquant.q4_k_pack`) or [n_i, K / 256 · 210]
// (Q6_K, `q6_k_pack`) as `kinds` says (12 Q4_K, 14 Q6_K, gguf's type numbers), n_i a positive
// multiple of 16; path: -1 (GENSERVE_QK_PATH, else the best this CPU runs), 0 scalar, 1 AVX2,
// 2 AVX512-VNNI. Returns [M, Σ n_i] in x's dtype: the segments' columns in turn. Raises
// (RuntimeError) on another dtype, layout or shape, K not a multiple of 256 (such a matrix keeps
// its bf16 product), and a path this CPU lacks.
// Checks one row segment of a weight against K (`qk_linear`'s rules) and returns its rows.
int64_t segment_rows(const at::Tensor& w, int64_t kind, int64_t nb, int64_t k, size_t i) {
  TORCH_CHECK(kind == KIND_Q4_K || kind == KIND_Q6_K, "qk_linear: segment ", i,
              " has kind ", kind, ", neither Q4_K (12) nor Q6_K (14)");
  const int64_t per_column = record_bytes(kind) / GROUP_N;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kByte,
              "qk_linear: segment ", i, " must be a contiguous uint8 [n, K / 256 * ", per_column, "] tensor");
  TORCH_CHECK(w.size(0) > 0 && w.size(0) % GROUP_N == 0, "qk_linear: segment ", i,
              " has ", w.size(0), " rows, not a positive multiple of 16");
  TORCH_CHECK(w.size(1) == nb * per_column, "qk_linear: x has K = ", k, ", segment ", i,
              " holds K = ", w.size(1) / per_column * QK_K);
  return w.size(0);
}

// The products of row groups of x by their own weights: group g's rows [offsets[g], offsets[g+1])
// times the weight made of segments first[g] .. first[g+1] - 1 (every weight with the same N).
// Each (group, segment, panel) is one unit of work, all shared by the threads; a row's bits are
// those `qk_linear` gives it alone (its Q8_K rounding and its sums are its own).
at::Tensor qk_grouped(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                      const std::vector<int64_t>& first, const std::vector<int64_t>& offsets,
                      int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "qk_linear: x must be a contiguous bf16 or fp32 [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0 && k % QK_K == 0, "qk_linear: K must be a positive multiple of 256 (one "
              "Q4_K/Q6_K super-block), got K = ", k);
  TORCH_CHECK(!weights.empty() && weights.size() == kinds.size(),
              "qk_linear: one kind per weight segment, and at least one segment");
  const int64_t nb = k / QK_K;
  const size_t groups = first.size() - 1;
  std::vector<int64_t> col0(weights.size());
  int64_t n = -1;
  for (size_t g = 0; g < groups; ++g) {
    int64_t cols = 0;
    for (int64_t i = first[g]; i < first[g + 1]; ++i) {
      col0[i] = cols;
      cols += segment_rows(weights[i], kinds[i], nb, k, static_cast<size_t>(i));
    }
    TORCH_CHECK(n < 0 || cols == n, "qk_linear_grouped: every group's weight must have ", n,
                " rows, group ", g, " has ", cols);
    n = cols;
  }
  const int chosen = resolve_path(path);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Q8KRows rows = round_rows(x);

  struct Unit { size_t segment, group; int64_t panel; int panels; };
  std::vector<Unit> units;
  for (size_t g = 0; g < groups; ++g) {
    if (offsets[g + 1] <= offsets[g]) continue;
    for (int64_t i = first[g]; i < first[g + 1]; ++i) {
      const int64_t count = weights[i].size(0) / GROUP_N;
      for (int64_t p = 0; p < count; p += PANEL_GROUPS)
        units.push_back({static_cast<size_t>(i), g, p, static_cast<int>(std::min(PANEL_GROUPS, count - p))});
    }
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    float tile[ROW_TILE * PANEL_GROUPS * GROUP_N];
    constexpr int64_t ldo = PANEL_GROUPS * GROUP_N;
    for (int64_t u = begin; u < end; ++u) {
      const Unit& unit = units[u];
      const int64_t kind = kinds[unit.segment];
      const int64_t group_bytes = nb * record_bytes(kind);
      const uint8_t* group0 = weights[unit.segment].data_ptr<uint8_t>() + unit.panel * group_bytes;
      const PanelFn fn = panel_fn(chosen, kind);
      const int64_t c0 = col0[unit.segment] + unit.panel * GROUP_N;
      const int64_t cols = unit.panels * GROUP_N;
      const int64_t lo = offsets[unit.group], hi = offsets[unit.group + 1];
      for (int64_t r0 = lo; r0 < hi; r0 += ROW_TILE) {
        const int count = static_cast<int>(std::min(ROW_TILE, hi - r0));
        fn(rows, r0, count, group0, unit.panels, group_bytes, tile, ldo, r0 == lo);
        for (int r = 0; r < count; ++r) {
          const float* t = tile + r * ldo;
          if (bf16) {
            c10::BFloat16* yr = y.data_ptr<c10::BFloat16>() + (r0 + r) * n + c0;
            for (int64_t c = 0; c < cols; ++c) yr[c] = c10::BFloat16(t[c]);
          } else {
            std::memcpy(y.data_ptr<float>() + (r0 + r) * n + c0, t, cols * sizeof(float));
          }
        }
      }
    }
  });
  return y;
}

at::Tensor qk_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                     int64_t path) {
  const std::vector<int64_t> first = {0, static_cast<int64_t>(weights.size())};
  const std::vector<int64_t> offsets = {0, x.dim() == 2 ? x.size(0) : 0};
  return qk_grouped(x, weights, kinds, first, offsets, path);
}

// x: as for `qk_linear`; rows of group g at [offsets[g], offsets[g + 1]) (a mixture of experts'
// step, its (token, expert) pairs sorted by expert); weights, kinds: every group's segments in
// turn, `segments[g]` of them for group g (its weight, e.g. an expert's gate|up as two segments),
// each group's weight with the same N. Returns [M, N] in x's dtype; row r of group g equals
// `qk_linear(x[r], group g's segments)` bit for bit. One call serves every expert of a step,
// the threads sharing every (expert, panel) of the work.
at::Tensor qk_linear_grouped(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                             at::IntArrayRef segments, at::IntArrayRef offsets, int64_t path) {
  TORCH_CHECK(!segments.empty() && offsets.size() == segments.size() + 1,
              "qk_linear_grouped: groups + 1 offsets, one segment count per group");
  std::vector<int64_t> first = {0};
  for (int64_t c : segments) {
    TORCH_CHECK(c > 0, "qk_linear_grouped: every group needs at least one segment");
    first.push_back(first.back() + c);
  }
  TORCH_CHECK(first.back() == static_cast<int64_t>(weights.size()),
              "qk_linear_grouped: the segment counts add up to ", first.back(), ", not the ",
              weights.size(), " weights given");
  const std::vector<int64_t> ends(offsets.begin(), offsets.end());
  TORCH_CHECK(x.dim() == 2 && ends.front() == 0 && ends.back() == x.size(0),
              "qk_linear_grouped: offsets must run from 0 to M");
  for (size_t g = 0; g + 1 < ends.size(); ++g)
    TORCH_CHECK(ends[g] <= ends[g + 1], "qk_linear_grouped: offsets must not decrease");
  return qk_grouped(x, weights, kinds, first, ends, path);
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("qk_linear(Tensor x, Tensor[] weights, int[] kinds, int path) -> Tensor");
  m.def("qk_linear_grouped(Tensor x, Tensor[] weights, int[] kinds, int[] segments, int[] offsets, "
        "int path) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("qk_linear", &genserve::qk_linear);
  m.impl("qk_linear_grouped", &genserve::qk_linear_grouped);
}
