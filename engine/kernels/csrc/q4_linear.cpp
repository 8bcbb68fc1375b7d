// y = x @ W^T read from the GGUF's 4-bit Q4_1 blocks of W, with the bits of `packed_linear` over
// the bf16 weights those blocks load as.
//
// The bf16 engine's weight w[n][k] is round_to_bf16(d * q + m) of its Q4_1 block (32 weights of
// one row along k: fp16 scale d, fp16 min m, a 4-bit q per weight; `gguf.quants` dequantizes in
// fp32, torch's `.to(bfloat16)` rounds to nearest even). This kernel computes the same value in
// registers: d and m widened to fp32 (exact), q to fp32, d * q + m in one FMA (d * q has at most
// 11 + 4 significant bits, so it is exact and the FMA rounds once, where numpy rounds once in the
// add), then vcvtne2ps2bf16 (round to nearest even). The result is the zmm of bf16 weight pairs
// `packed_linear` would have loaded from the packed bf16 copy, and the products then run exactly
// as there: per output column one vdpbf16ps chain per k chunk, k pairs in order, the chunks'
// sums added in order, one rounding to bf16 at the end. Same operands, same instructions, same
// order per output: the same bits, at every row count, so a row's result never depends on the
// batch. It reads 20 bytes per 32 weights instead of 64 (3.2x fewer).
//
// Layout (`engine.model.quant.q4_pack`): the same 4-bit blocks, re-interleaved at load for the
// vdpbf16ps order, 1,280 bytes per 64 output columns x 32 k:
//
//   [N/64][K/32]{ scales: [4 groups of 16 columns]{ d[16] fp16, m[16] fp16 }             256 B
//                 nibbles: [16 k pairs j][4 groups][16 bytes] }                         1,024 B
//
// where byte t of (j, group) holds q[col t/2][k 2j + t%2] in its low nibble and q[col 8 + t/2]
// [k 2j + t%2] in its high nibble (columns of the group). Zero-extending those 16 bytes to 16
// int32 lanes, the low nibbles are columns 0-7 and the high nibbles columns 8-15, each as
// (even k, odd k) lane pairs; with d and m spread to the same lane pairs, vcvtne2ps2bf16 of the
// two halves is directly the 16-column pair register (no shuffle). Each thread streams its
// 64-column blocks from one contiguous run of memory.
//
// Work: blocks of 64 columns split across threads (at::parallel_for). Up to ROWS rows the
// weights are decoded in registers as they are used; with more rows a block is decoded once into
// a per-thread bf16 buffer in `packed_linear`'s layout and every group of ROWS rows reads it from
// cache.
//
// On CPUs where genserve runs oneDNN's AMX kernel, `q4_amx_linear` (amx_linear.cpp) runs the
// 4-bit products instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 64;              // output columns per packed block
constexpr int64_t QK = 32;                   // weights per Q4_1 block (along k)
constexpr int64_t PAIRS = QK / 2;            // k pairs per Q4_1 block
constexpr int GROUPS = BLOCK_N / 16;         // 16-column zmm groups per block
constexpr int64_t SCALE_BYTES = GROUPS * 64;                     // d[16], m[16] fp16 per group
constexpr int64_t KB_BYTES = SCALE_BYTES + PAIRS * GROUPS * 16;  // 1,280: 64 columns x 32 k
constexpr int ROWS = 6;                      // rows per pass over a block (as packed_linear)

// d and m of one 16-column group, widened to fp32 and spread to (even k, odd k) lane pairs:
// lo for columns 0-7, hi for columns 8-15.
struct Scales {
  __m512 dlo, dhi, mlo, mhi;
};

inline Scales load_scales(const uint8_t* group) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)));
  const __m512 m =
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32)));
  return {_mm512_permutexvar_ps(lo_idx, d), _mm512_permutexvar_ps(hi_idx, d),
          _mm512_permutexvar_ps(lo_idx, m), _mm512_permutexvar_ps(hi_idx, m)};
}

// 16 columns x one k pair as bf16 pairs, from the group's 16 nibble bytes of that pair.
inline __m512bh decode_pair(const uint8_t* nibbles, const Scales& s) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles)));
  const __m512 lo = _mm512_fmadd_ps(
      s.dlo, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF))), s.mlo);
  const __m512 hi = _mm512_fmadd_ps(s.dhi, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), s.mhi);
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// `R` rows of x (bf16 pairs, `kp` per row) times one Q4 block of 64 columns -> y[R][64], the
// weights decoded as they are used. Per output column the vdpbf16ps chain is packed_linear's.
template <int R>
void block_rows_q4(const uint32_t* x, const uint8_t* block, int64_t kp, int64_t chunk_pairs,
                   c10::BFloat16* y, int64_t y_stride) {
  __m512 total[R][GROUPS];
  for (int64_t c0 = 0; c0 < kp; c0 += chunk_pairs) {
    __m512 acc[R][GROUPS];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_setzero_ps();
    const int64_t c1 = std::min(kp, c0 + chunk_pairs);
    for (int64_t kb = c0 / PAIRS; kb < c1 / PAIRS; ++kb) {
      const uint8_t* blk = block + kb * KB_BYTES;
      const uint32_t* xk = x + kb * PAIRS;
      for (int g = 0; g < GROUPS; ++g) {
        const Scales s = load_scales(blk + g * 64);
        const uint8_t* nib = blk + SCALE_BYTES + g * 16;
        for (int j = 0; j < PAIRS; ++j) {
          const __m512bh w = decode_pair(nib + j * GROUPS * 16, s);
          for (int r = 0; r < R; ++r)
            acc[r][g] = _mm512_dpbf16_ps(
                acc[r][g], (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[r * kp + j])), w);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GROUPS; ++g)
        total[r][g] = c0 == 0 ? acc[r][g] : _mm512_add_ps(total[r][g], acc[r][g]);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GROUPS; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + g * 16),
                          (__m256i)_mm512_cvtneps_pbh(total[r][g]));
}

// One Q4 block of 64 columns decoded to bf16 in packed_linear's layout [kp][64][2].
void decode_block(const uint8_t* block, int64_t kp, uint16_t* out) {
  for (int64_t kb = 0; kb < kp / PAIRS; ++kb) {
    const uint8_t* blk = block + kb * KB_BYTES;
    for (int g = 0; g < GROUPS; ++g) {
      const Scales s = load_scales(blk + g * 64);
      const uint8_t* nib = blk + SCALE_BYTES + g * 16;
      for (int j = 0; j < PAIRS; ++j)
        _mm512_storeu_si512(out + ((kb * PAIRS + j) * BLOCK_N + g * 16) * 2,
                            (__m512i)decode_pair(nib + j * GROUPS * 16, s));
    }
  }
}

// `R` rows of x times one decoded bf16 block [kp][64][2] -> y[R][64]: packed_linear's loop.
template <int R>
void block_rows_bf16(const uint32_t* x, const uint16_t* block, int64_t kp, int64_t chunk_pairs,
                     c10::BFloat16* y, int64_t y_stride) {
  __m512 total[R][GROUPS];
  for (int64_t c0 = 0; c0 < kp; c0 += chunk_pairs) {
    __m512 acc[R][GROUPS];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_setzero_ps();
    const int64_t c1 = std::min(kp, c0 + chunk_pairs);
    for (int64_t j = c0; j < c1; ++j) {
      const uint16_t* w_row = block + j * BLOCK_N * 2;
      __m512bh w[GROUPS];
      for (int g = 0; g < GROUPS; ++g) w[g] = (__m512bh)_mm512_loadu_si512(w_row + g * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + j]));
        for (int g = 0; g < GROUPS; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, w[g]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GROUPS; ++g)
        total[r][g] = c0 == 0 ? acc[r][g] : _mm512_add_ps(total[r][g], acc[r][g]);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < GROUPS; ++g)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + g * 16),
                          (__m256i)_mm512_cvtneps_pbh(total[r][g]));
}

template <int R>
void q4_rows_upto(int rows, const uint32_t* x, const uint8_t* block, int64_t kp,
                  int64_t chunk_pairs, c10::BFloat16* y, int64_t y_stride) {
  if constexpr (R > 1) {
    if (rows < R) return q4_rows_upto<R - 1>(rows, x, block, kp, chunk_pairs, y, y_stride);
  }
  block_rows_q4<R>(x, block, kp, chunk_pairs, y, y_stride);
}

template <int R>
void bf16_rows_upto(int rows, const uint32_t* x, const uint16_t* block, int64_t kp,
                    int64_t chunk_pairs, c10::BFloat16* y, int64_t y_stride) {
  if constexpr (R > 1) {
    if (rows < R) return bf16_rows_upto<R - 1>(rows, x, block, kp, chunk_pairs, y, y_stride);
  }
  block_rows_bf16<R>(x, block, kp, chunk_pairs, y, y_stride);
}

}  // namespace

namespace genserve {

// x: bf16 [M, K] contiguous; q4: uint8 [N, K / 32 * 20], W's Q4_1 blocks in the layout above
// (`engine.model.quant.q4_pack`; N % 64 == 0, K % 32 == 0); k_chunk: the k chunk of the
// `packed_linear` product to reproduce (a multiple of 32, > 0). Returns bf16 [M, N], bit for bit
// `packed_linear(x, vnni_pack(W_bf16), k_chunk)` where W_bf16 is the blocks dequantized in fp32
// and rounded to bf16. Raises (RuntimeError) on another dtype or shape, or a k_chunk that is not
// a multiple of 32.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q4, int64_t k_chunk) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "q4_linear: x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(q4.dim() == 2 && q4.is_contiguous() && q4.scalar_type() == at::kByte &&
                  q4.size(1) % 20 == 0,
              "q4_linear: q4 must be a contiguous uint8 [N, K / 32 * 20] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = q4.size(0);
  TORCH_CHECK(q4.size(1) / 20 * QK == k, "q4_linear: x has K = ", k, ", the weight ",
              q4.size(1) / 20 * QK);
  TORCH_CHECK(n % BLOCK_N == 0 && k % QK == 0, "q4_linear: N must be a multiple of ", BLOCK_N,
              " and K of ", QK, ", got N = ", n, ", K = ", k);
  TORCH_CHECK(k_chunk > 0 && k_chunk % QK == 0, "q4_linear: k_chunk must be a multiple of ", QK,
              " and > 0, got ", k_chunk);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* w = q4.data_ptr<uint8_t>();
  const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t kp = k / 2, chunk_pairs = k_chunk / 2;
  const int64_t block_bytes = k / QK * KB_BYTES;
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> decoded(m > ROWS ? kp * BLOCK_N * 2 : 0);
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = w + b * block_bytes;
      if (m <= ROWS) {
        q4_rows_upto<ROWS>(static_cast<int>(m), xs, block, kp, chunk_pairs, ys + b * BLOCK_N, n);
        continue;
      }
      decode_block(block, kp, decoded.data());
      for (int64_t r = 0; r < m; r += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, m - r));
        bf16_rows_upto<ROWS>(rows, xs + r * kp, decoded.data(), kp, chunk_pairs,
                             ys + r * n + b * BLOCK_N, n);
      }
    }
  });
  return y;
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("q4_linear(Tensor x, Tensor q4, int k_chunk) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("q4_linear", &genserve::q4_linear);
}

#endif  // __AVX512BF16__ && __AVX512BW__
