// Paged decode attention on CPU: one query token per row, keys and values read in place from the
// block pools through each row's block table (no gather copy, no padding). The pools hold bf16
// or fp32 numbers, or (bf16 queries on AVX512-BF16 CPUs) rows of the 8-bit format
// (engine/attention/kv_quant.py), turned in registers into the numbers a bf16 pool holding them would hold,
// so the result has those bits at about half the bytes read.
//
//   out[b, h, :] = softmax_j(q[b, h] · k[b, j] * scale) · v[b, j],  j < context_lens[b]
//
// A KV head's `group` query heads share its keys and values (GQA): they are computed together,
// so each key and value is read once per row. Scores, softmax and the P·V accumulation are fp32.
// Three loops: bf16 on CPUs with AVX512-BF16 (the serving case) runs the one-pass kernel further
// down (AMX tiles for the scores where the CPU and OS have them); bf16 on CPUs with AVX2 alone
// runs `decode_kernel_avx2`; other dtypes and CPUs run `decode_kernel`. The last two: work item
// = (row, KV head), two passes over the keys' scores. Every loop's
// order is fixed by the row's own context length, so a row gives the same bits whatever else is in
// the batch (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_math.h"
#include "avx512_math.h"
#include "bf16.h"
#include "genserve_ops.h"
#include "prefetch.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

using genserve::to_float;

// The generic loop (any dtype, any x86 build): head_dim D, and with `window` > 0 only the row's
// last `window` positions are read (a sliding-window layer; 0: the whole context).
template <typename T, int G, int D = 64>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                   double scale, int64_t window = 0) {
  const int64_t heads = q.size(1);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2), table_width = tables.size(1);
  const int64_t block_stride = block * kv_heads * D, token_stride = kv_heads * D;
  const T* qd = q.data_ptr<T>();
  const T* kd = k_pool.data_ptr<T>();
  const T* vd = v_pool.data_ptr<T>();
  const int64_t* td = tables.data_ptr<int64_t>();
  const int64_t* ld = lens.data_ptr<int64_t>();
  T* od = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, q.size(0) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    alignas(64) float qf[G][D], acc[G][D], kf[D];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, end_pos = ld[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0;
      const int64_t len = end_pos - first;                // positions read
      const int64_t* table = td + b * table_width;
      scores.resize(G * len);
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          qf[g][d] = to_float(qd[(b * heads + h * G + g) * D + d]) * fscale;
      float mx[G];
      for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::max();
      // Walks positions first .. end_pos - 1 in order through the row's block table; for each
      // loads that token's head vector from `pool` into kf (fp32) and calls visit(its index
      // among the positions read).
      auto each_token = [&](const T* pool, auto&& visit) {
        for (int64_t pos = first; pos < end_pos;) {
          const int64_t in = pos % block, n = std::min(block - in, end_pos - pos);
          const T* base = pool + table[pos / block] * block_stride + in * token_stride + h * D;
          for (int64_t t = 0; t < n; ++t) {
            const T* row = base + t * token_stride;
            for (int d = 0; d < D; ++d) kf[d] = to_float(row[d]);
            visit(pos - first + t);
          }
          pos += n;
        }
      };
      each_token(kd, [&](int64_t j) {
        for (int g = 0; g < G; ++g) {
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += qf[g][d] * kf[d];
          scores[g * len + j] = s;
          mx[g] = std::max(mx[g], s);
        }
      });
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - mx[g]);
          sum += sg[j];
        }
        inv_sum[g] = 1.f / sum;
      }
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
      each_token(vd, [&](int64_t j) {
        for (int g = 0; g < G; ++g) {
          const float pr = scores[g * len + j];
          for (int d = 0; d < D; ++d) acc[g][d] += pr * kf[d];
        }
      });
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          od[(b * heads + h * G + g) * D + d] = static_cast<T>(acc[g][d] * inv_sum[g]);
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#define GENSERVE_DECODE_AVX2 1

// How many blocks ahead the AVX2 kernel's walks prefetch (benchmarks/results/kernels/history.md,
// "Decode attention on AVX2: the prefetches spread over the walk").
constexpr int64_t AVX2_PREFETCH_BLOCKS = 2;

// `decode_kernel` for bf16 pools on CPUs with AVX2 alone, its loops on ymm. A 256-bit load of
// 16 bf16 is widened to fp32 without a shuffle: a left shift by 16 gives the even elements
// (0, 2, .., 14) and a mask of the high halves gives the odd ones (1, 3, .., 15), so the query is
// held in that even/odd order and the output written back from it. A score is 8 FMAs in two
// chains; the 8 lanes of 8 positions' scores are summed together by one `vhaddps` tree
// (`score_tile`) instead of a horizontal sum per score. The softmax's exp is `exp256_ps` over 8
// scores at a time (the generic loop calls libm's expf once per score); P·V runs in two halves of
// 32 dimensions, each G x 4 accumulators in registers across the whole context. Every order is
// fixed by the row's own context length, so a row's bits do not depend on the batch.
//
// The 8 sums of 8 vectors' lanes, t[i] -> lane i, in a fixed order: pairs (vhaddps), then quads,
// then the two 128-bit halves.
inline __m256 score_tile(const __m256* t) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 16 bf16 at p widened exactly to fp32: lane i of `even` is element 2i, of `odd` element 2i + 1.
inline void load_bf16x16_split(const void* p, __m256& even, __m256& odd) {
  const __m256i x = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int G>
void decode_kernel_avx2(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                        double scale) {
  using genserve::exp256_ps;
  using genserve::hsum256_ps;
  constexpr int D = 64;                                   // head_dim (checked by the caller)
  const int64_t heads = q.size(1);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2), table_width = tables.size(1);
  const int64_t block_stride = block * kv_heads * D, token_stride = kv_heads * D;
  const auto* qd = q.data_ptr<c10::BFloat16>();
  const auto* kd = k_pool.data_ptr<c10::BFloat16>();
  const auto* vd = v_pool.data_ptr<c10::BFloat16>();
  const int64_t* td = tables.data_ptr<int64_t>();
  const int64_t* ld = lens.data_ptr<int64_t>();
  c10::BFloat16* od = out.data_ptr<c10::BFloat16>();
  const __m256 vscale = _mm256_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, q.size(0) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    __m256 qf[G][8];                                      // scaled query, even/odd per 16 dims
    __m256 tile[G][8];                                    // per-position lanes, 8 positions
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = ld[b];
      const int64_t padded = (len + 7) / 8 * 8;           // scores of G heads, 8-aligned rows
      const int64_t* table = td + b * table_width;
      scores.resize(G * padded);
      for (int g = 0; g < G; ++g) {
        const c10::BFloat16* qrow = qd + (b * heads + h * G + g) * D;
        for (int c = 0; c < 4; ++c) {
          load_bf16x16_split(qrow + 16 * c, qf[g][2 * c], qf[g][2 * c + 1]);
          qf[g][2 * c] = _mm256_mul_ps(qf[g][2 * c], vscale);
          qf[g][2 * c + 1] = _mm256_mul_ps(qf[g][2 * c + 1], vscale);
        }
        for (int t = 0; t < 8; ++t) tile[g][t] = _mm256_setzero_ps();
      }
      // Walks the row's context in position order through its block table, calling visit(j,
      // the token's head vector from `offset` on) for each token j, and prefetches the block
      // AVX2_PREFETCH_BLOCKS ahead (`lines` cache lines of each of its rows from `offset` on):
      // blocks lie anywhere in the pool, and the hardware prefetcher loses the stride at every
      // jump. One row's lines are asked for at each token visited, so the misses stay in flight
      // all through the work instead of queueing up at the start of each block. Blocks 1 ..
      // AVX2_PREFETCH_BLOCKS − 1 are asked for at the start of the walk; block 0 is read at once.
      auto each_token = [&](const c10::BFloat16* pool, int64_t offset, int lines, auto&& visit) {
        const auto prefetch_block = [&](int64_t i, int64_t t) {   // row t of block i, if any
          if (i * block + t >= len) return;
          const char* row = reinterpret_cast<const char*>(
              pool + table[i] * block_stride + t * token_stride + h * D + offset);
          for (int l = 0; l < lines; ++l) genserve::prefetch_l2(row + 64 * l);
        };
        for (int64_t i = 1; i < AVX2_PREFETCH_BLOCKS; ++i)
          for (int64_t t = 0; t < block; ++t) prefetch_block(i, t);
        for (int64_t start = 0; start < len; start += block) {
          const int64_t i = start / block;
          const c10::BFloat16* base = pool + table[i] * block_stride + h * D + offset;
          const int64_t n = std::min(block, len - start);
          for (int64_t t = 0; t < n; ++t) {
            prefetch_block(i + AVX2_PREFETCH_BLOCKS, t);
            visit(start + t, base + t * token_stride);
          }
        }
      };
      auto flush = [&](int64_t j0) {                      // positions j0 .. j0 + 7
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(&scores[g * padded + j0], score_tile(tile[g]));
      };
      each_token(kd, 0, 2, [&](int64_t j, const c10::BFloat16* row) {
        __m256 k[8];
        for (int c = 0; c < 4; ++c) load_bf16x16_split(row + 16 * c, k[2 * c], k[2 * c + 1]);
        for (int g = 0; g < G; ++g) {
          __m256 a0 = _mm256_mul_ps(qf[g][0], k[0]);
          __m256 a1 = _mm256_mul_ps(qf[g][1], k[1]);
          for (int c = 2; c < 8; c += 2) {
            a0 = _mm256_fmadd_ps(qf[g][c], k[c], a0);
            a1 = _mm256_fmadd_ps(qf[g][c + 1], k[c + 1], a1);
          }
          tile[g][j & 7] = _mm256_add_ps(a0, a1);
        }
        if ((j & 7) == 7) flush(j - 7);
      });
      if (len & 7) {                                      // the last, partial group of 8
        flush(len & ~int64_t{7});
        for (int g = 0; g < G; ++g)
          std::fill(scores.begin() + g * padded + len, scores.begin() + (g + 1) * padded,
                    -std::numeric_limits<float>::max());
      }
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * padded;
        __m256 mv = _mm256_loadu_ps(sg);
        for (int64_t j = 8; j < padded; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + j));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mv);
        const __m256 mx = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < padded; j += 8) {      // the padding's exp is 0
          const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mx));
          _mm256_storeu_ps(sg + j, e);
          sum = _mm256_add_ps(sum, e);
        }
        inv_sum[g] = 1.f / hsum256_ps(sum);
      }
      for (int half = 0; half < 2; ++half) {
        __m256 acc[G][4];                                 // dims 2i, 2i+1, 16+2i, 17+2i of the half
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
        // The first half's walk asks for both lines of each value row, the second for its own.
        each_token(vd, 32 * half, 2 - half, [&](int64_t j, const c10::BFloat16* row) {
          __m256 v[4];
          load_bf16x16_split(row, v[0], v[1]);
          load_bf16x16_split(row + 16, v[2], v[3]);
          for (int g = 0; g < G; ++g) {
            const __m256 pr = _mm256_broadcast_ss(&scores[g * padded + j]);
            for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_fmadd_ps(pr, v[c], acc[g][c]);
          }
        });
        for (int g = 0; g < G; ++g) {
          alignas(32) float o[4][8];
          const __m256 inv = _mm256_set1_ps(inv_sum[g]);
          for (int c = 0; c < 4; ++c) _mm256_store_ps(o[c], _mm256_mul_ps(acc[g][c], inv));
          c10::BFloat16* dst = od + (b * heads + h * G + g) * D + 32 * half;
          for (int i = 0; i < 8; ++i) {
            dst[2 * i] = static_cast<c10::BFloat16>(o[0][i]);
            dst[2 * i + 1] = static_cast<c10::BFloat16>(o[1][i]);
            dst[16 + 2 * i] = static_cast<c10::BFloat16>(o[2][i]);
            dst[17 + 2 * i] = static_cast<c10::BFloat16>(o[3][i]);
          }
        }
      }
    }
  });
}
#endif  // AVX2 without AVX512-BF16

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bf16 kernel for CPUs with AVX512-BF16, with AMX-BF16 where the compiler targets it and the
// OS grants the tile state.
//
// Work item = (row, chunk of its context, run of up to 16 / G KV heads — all 3 of SmolLM2's): the
// run's query heads sit in the lanes of one zmm, lane = (KV head − first) · G + g. A chunk is
// CHUNK_TOKENS positions (rounded up to whole blocks), the row's last chunk what is left, so a row
// of 1,250 tokens is 5 items per run and one row alone keeps every thread busy. A chunk goes
// 16 tokens at a time (a tile, never across a block boundary), in position order, in one pass
// (online softmax, Milakov & Gimelshein 2018):
//
//   S[t][lane] = q[lane] · k[t]      AMX: S = Σₖ K[:, slice k] · Qᵀ[slice k] over the run's
//                                    32-dimension slices, one TDPBF16PS each, the 16 keys' slices
//                                    loaded straight from the pool (row stride = one token), Qᵀ
//                                    packed block-diagonally once per row; else vdpbf16ps per
//                                    key and query head, then one transpose-and-add tree
//                                    (`lane_sums`) per key for all the run's query heads
//   m' = max(m, maxₜ S·scale)         lane-wise running max, one exp per token for every lane
//   p[t] = exp(S·scale − m'),  l = l·exp(m − m') + Σₜ p[t]
//   O[lane] = O[lane]·exp(m − m') + Σₜ p[t]·v[t]          fp32 FMAs, P in fp32
//
// so each key and value is read once; the block PREFETCH_BLOCKS ahead is prefetched into L2,
// spread over the work on this one (blocks are scattered in the pool, which defeats the hardware
// prefetcher at every block boundary); an item's last blocks prefetch the first blocks of the
// thread's next item, so the stream does not start cold at every item. A row of one chunk writes O / l. A longer row's chunks
// leave (m, l, O), and the thread that finishes the row's last item merges them in chunk order
// (the split-KV decoding of FlashDecoding, Dao et al. 2023):
//
//   M = maxᶜ mᶜ,   L = Σᶜ lᶜ·exp(mᶜ − M),   out = (Σᶜ Oᶜ·exp(mᶜ − M)) / L
//
// A lane's arithmetic is the same whichever heads share its item and however the items are
// split between threads, and the chunks are fixed by the row's own length: a row gives the same
// bits whatever else is in the batch.
constexpr int TILE = 16;                   // tokens per score tile
constexpr int LANES = 16;                  // fp32 lanes of a zmm: query heads per item at most
constexpr int64_t PREFETCH_BLOCKS = 2;     // how far ahead the next blocks are prefetched
constexpr int AMX_HEADS = 3;               // KV heads per item with AMX: 6 Qᵀ tiles of 8
// Context positions per work item (whole blocks). Smaller chunks balance one short row better but
// cost more per chunk where many rows keep the threads busy anyway; docs/benchmarks/kernels.md
// ("Context chunks: one row keeps both cores busy") has the measurements behind this choice.
// A constant: the chunks, and so a row's bits, must not depend on the batch or the threads.
constexpr int64_t CHUNK_TOKENS = 256;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GENSERVE_DECODE_AMX 1
// Linux keeps AMX's tile data off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM
// with XFEATURE_XTILEDATA; the kernel's Documentation/arch/x86/xstate.rst). Asked once; false
// where the kernel refuses (then the vdpbf16ps scores run).
bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// Tile palette 1 (Intel SDM vol. 2, LDTILECFG), every tile 16 rows × 64 bytes: tile 0 = S [16
// keys × 16 lanes] fp32, tile 1 = one 32-dimension slice of 16 keys, tiles 2-7 = Qᵀ's slices
// [16 bf16 pairs × 16 lanes] (two per KV head, so at most AMX_HEADS heads per item).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// How a pool row (one token's head vector, 64 numbers) is read:
//   load:   as two registers of 32 bf16 (dimensions 0-31, 32-63), the AMX / vdpbf16ps operands;
//   values: as four registers of 16 fp32, the P·V operands, in the accumulator's order;
//   store:  the row's output from those accumulators (fp32, that order) as 64 bf16.
// bf16 rows keep the pairs' interleaving (even dimensions, then odd, of 0-31, then of 32-63),
// which costs one shift or mask per register; 8-bit rows are read in dimension order.
struct Bf16Rows {
  using Elem = uint16_t;
  static constexpr int64_t WIDTH = 64;     // elements per row
  static inline void load(const Elem* row, __m512i& x0, __m512i& x1) {
    x0 = _mm512_loadu_si512(row);
    x1 = _mm512_loadu_si512(row + 32);
  }
  static inline void values(const Elem* row, __m512 v[4]) {
    const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    const __m512i x0 = _mm512_loadu_si512(row), x1 = _mm512_loadu_si512(row + 32);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(x0, odd_mask));
    v[2] = _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16));
    v[3] = _mm512_castsi512_ps(_mm512_and_si512(x1, odd_mask));
  }
  static inline void store(uint16_t* dst, const __m512 o[4]) {
    _mm512_storeu_si512(dst, genserve::interleave_bf16(o[0], o[1]));
    _mm512_storeu_si512(dst + 32, genserve::interleave_bf16(o[2], o[3]));
  }
};

// The 8-bit format (engine/attention/kv_quant.py): 64 int8 q, then the bytes E0 (dimensions 0-31) and E1
// (32-63); a number is q * 2^(E - 133), exact in fp32 and in bf16 (at most 7 significant bits,
// an fp32 normal), so one conversion and one exact multiply give the numbers a bf16 pool holding
// them would give, and converting them to bf16 rounds nothing.
struct Q8Rows {
  using Elem = int8_t;
  static constexpr int64_t WIDTH = 66;
  static inline __m512 scale(const Elem* row, int group) {     // 2^(E - 133) from its bits
    const int e = static_cast<uint8_t>(row[64 + group]) - genserve::KV8_Q_BITS;
    return _mm512_castsi512_ps(_mm512_set1_epi32(e << 23));
  }
  static inline __m512 numbers(const Elem* q16, __m512 d) {
    return _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16)))), d);
  }
  static inline void values(const Elem* row, __m512 v[4]) {
    const __m512 d0 = scale(row, 0), d1 = scale(row, 1);
    v[0] = numbers(row, d0);
    v[1] = numbers(row + 16, d0);
    v[2] = numbers(row + 32, d1);
    v[3] = numbers(row + 48, d1);
  }
  static inline void load(const Elem* row, __m512i& x0, __m512i& x1) {
    __m512 v[4];
    values(row, v);
    x0 = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
    x1 = (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2]);
  }
  static inline void store(uint16_t* dst, const __m512 o[4]) {
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(o[1], o[0]));
    _mm512_storeu_si512(dst + 32, (__m512i)_mm512_cvtne2ps_pbh(o[3], o[2]));
  }
};

template <class R>
struct DecodeArgs {
  const uint16_t* q;                       // [B, heads, D]
  const typename R::Elem *k, *v;           // pools [blocks, block, kv_heads, R::WIDTH]
  const int64_t *tables, *lens;
  uint16_t* out;                           // [B, heads, D]
  int64_t heads, kv_heads, block, table_width, block_stride, token_stride;   // strides in Elems
  float scale;
  int64_t chunk;                           // tokens per chunk, a multiple of `block`
  float* partial;                          // [chunks of rows with 2+, kv_heads, G, PARTIAL]
  const int64_t* partial_base;             // [B]: a row's first chunk in `partial`
};

// A chunk's (m, l, O) for one query head: O in R::values's order of the dimensions.
constexpr int64_t PARTIAL = 2 + 64;

// Chunks of a row of `len` positions.
inline int64_t chunks_of(int64_t len, int64_t chunk) { return len <= 0 ? 1 : (len + chunk - 1) / chunk; }

// Where a work item reads: its row's block table, its positions [first, last) and its first KV
// head (table null: no item). The last blocks of an item prefetch the thread's next item's first
// ones, so a thread's stream of blocks stays prefetched across items.
struct ItemReads {
  const int64_t* table = nullptr;
  int64_t first = 0, last = 0, h0 = 0;
};

// Chunk `c` of row `b` from KV head h0: its reads.
template <class R>
ItemReads reads_of(const DecodeArgs<R>& a, int64_t b, int64_t c, int64_t h0) {
  const int64_t first = c * a.chunk;
  return {a.tables + b * a.table_width, first, std::min(a.lens[b], first + a.chunk), h0};
}

// Lane i of the result = the sum of v[i]'s 16 lanes, for i < count (≤ 16); lanes from count on
// are 0. A transpose-and-add tree: 15 adds and 30 shuffles for 16 vectors, against about 8
// instructions per vector for a horizontal sum each (`_mm512_reduce_add_ps`). Lane i's sum adds
// v[i]'s lanes in a fixed order — lanes (j, j + 2) within each 128-bit chunk, then the chunk's two
// pair sums, then chunks (0, 1) and (2, 3), then those two — that involves no other vector: its
// bits do not depend on what the other lanes hold.
inline __m512 lane_sums(const __m512* v, int count) {
  const __m512 z = _mm512_setzero_ps();
  __m512 t[8], u[4], w[2];
  // a = v[2i], b = v[2i + 1]; 128-bit chunk c of t[i]: a[c,0] + a[c,2], b[c,0] + b[c,2],
  // a[c,1] + a[c,3], b[c,1] + b[c,3] (x[c,j]: lane 4c + j of x).
  for (int i = 0; i < 8; ++i) {
    if (2 * i >= count) { t[i] = z; continue; }
    const __m512 a = v[2 * i], b = 2 * i + 1 < count ? v[2 * i + 1] : z;
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  // Chunk c of u[i]: the sums of chunk c of v[4i], .., v[4i + 3].
  for (int i = 0; i < 4; ++i) {
    if (4 * i >= count) { u[i] = z; continue; }
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Chunks of w[i]: u[2i]'s chunks 0 + 1, 2 + 3, then u[2i + 1]'s; the last step adds those pairs.
  for (int i = 0; i < 2; ++i) {
    if (8 * i >= count) { w[i] = z; continue; }
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Prefetches (into L2) pool row `t` of KV head `hl` from `base` (a block's first row of the
// item's first KV head) when `t` < `rows`: its bytes span two cache lines at most.
template <class R>
inline void prefetch_row(const char* base, int64_t t, int64_t rows, int64_t hl, int64_t ts) {
  if (t >= rows) return;
  constexpr int64_t bytes = R::WIDTH * sizeof(typename R::Elem);
  const char* p = base + (t * ts + hl * R::WIDTH) * sizeof(typename R::Elem);
  genserve::prefetch_l2(p);
  genserve::prefetch_l2(p + bytes - 1);
}

// Chunk `c` of row `b`, KV heads h0 .. h0 + nh − 1. `load_q`: pack and load the row's Qᵀ tiles
// (false when this thread's previous item was the same row and run, whose tiles are still loaded).
// `next`: the thread's next item, whose first blocks this one's last blocks prefetch.
template <int G, bool AMX, class R>
void decode_item(const DecodeArgs<R>& a, int64_t b, int64_t c, int64_t h0, int nh, bool load_q,
                 const ItemReads& next) {
  constexpr int D = 64;
  constexpr int64_t W = R::WIDTH;          // a row's elements in the pool
  constexpr bool DIRECT = std::is_same_v<R, Bf16Rows>;   // AMX reads keys from the pool itself
  constexpr int HMAX = LANES / G;          // KV heads an item may hold
  const int64_t len = a.lens[b];
  const ItemReads reads = reads_of(a, b, c, h0);
  const int64_t first = reads.first, last = reads.last;
  const bool whole = chunks_of(len, a.chunk) == 1;
  const int64_t* table = reads.table;
  const uint16_t* q = a.q + (b * a.heads + h0 * G) * D;
  uint16_t* out = a.out + (b * a.heads + h0 * G) * D;
  if (len <= 0) {
    std::memset(out, 0, sizeof(uint16_t) * nh * G * D);
    return;
  }
  alignas(64) float s[TILE][LANES] = {};            // scores, then probabilities, of a tile
  alignas(64) float corr[LANES];
  alignas(64) float acc[HMAX][G][4][16];            // O, in R::values's order of the dimensions
  std::memset(acc, 0, sizeof(acc[0]) * nh);
  // The 8-bit path's keys of a tile as bf16: [token][KV head's dimensions 0-31, 32-63].
  alignas(64) __m512i kbuf[DIRECT || !AMX ? 1 : TILE][2 * AMX_HEADS];
#ifdef GENSERVE_DECODE_AMX
  // Qᵀ block-diagonal, as bf16 pairs: slice k (dimensions 32k'..32k'+31 of KV head k / 2, k' =
  // k % 2) holds pair p of each of that head's G query heads in their lanes, zeros elsewhere.
  alignas(64) uint32_t qt[AMX_HEADS * 2][16][LANES];
  if (AMX && load_q) {
    std::memset(qt, 0, sizeof(uint32_t) * nh * 2 * 16 * LANES);
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(q);
    for (int hl = 0; hl < nh; ++hl)
      for (int g = 0; g < G; ++g)
        for (int p = 0; p < D / 2; ++p)
          qt[hl * 2 + p / 16][p % 16][hl * G + g] = qp[(hl * G + g) * D / 2 + p];
    // Tiles 2.. hold the slices for the whole row.
    _tile_loadd(2, qt[0], LANES * 4);
    _tile_loadd(3, qt[1], LANES * 4);
    if (nh > 1) { _tile_loadd(4, qt[2], LANES * 4); _tile_loadd(5, qt[3], LANES * 4); }
    if (nh > 2) { _tile_loadd(6, qt[4], LANES * 4); _tile_loadd(7, qt[5], LANES * 4); }
  }
#endif
  __m512bh qv[AMX ? 1 : HMAX][G][2];                 // the query heads, for vdpbf16ps scores
  if constexpr (!AMX)
    for (int hl = 0; hl < nh; ++hl)
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2; ++i)
          qv[hl][g][i] = (__m512bh)_mm512_loadu_si512(q + (hl * G + g) * D + 32 * i);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf, l = _mm512_setzero_ps();
  const int64_t ts = a.token_stride;
  for (int64_t start = first; start < last; start += a.block) {
    const int64_t blk = table[start / a.block];
    // The block PREFETCH_BLOCKS ahead, prefetched (into L2) token by token and spread over this
    // block's work: its keys by the score loop (with AMX, whose scores have no per-token loop, by
    // the softmax's), its values by the value loop. Prefetching both in the value loop alone left
    // the memory idle through the scores and the softmax, half of the block's work.
    // Past this item's last block: the next item's blocks, in its order.
    int64_t ahead = start + PREFETCH_BLOCKS * a.block, ahead_end = last, ahead_h0 = h0;
    const int64_t* ahead_table = table;
    if (ahead >= last && next.table != nullptr) {
      ahead = next.first + (ahead - (first + (last - first + a.block - 1) / a.block * a.block));
      ahead_end = next.last;
      ahead_h0 = next.h0;
      ahead_table = next.table;
    }
    const int64_t ahead_rows = ahead < ahead_end ? std::min(a.block, ahead_end - ahead) : 0;
    const int64_t ahead_blk = ahead < ahead_end ? ahead_table[ahead / a.block] : blk;
    const char* kahead =
        reinterpret_cast<const char*>(a.k + ahead_blk * a.block_stride + ahead_h0 * W);
    const char* vahead =
        reinterpret_cast<const char*>(a.v + ahead_blk * a.block_stride + ahead_h0 * W);
    const typename R::Elem* kblock = a.k + blk * a.block_stride + h0 * W;
    const typename R::Elem* vblock = a.v + blk * a.block_stride + h0 * W;
    for (int64_t t0 = 0; t0 < a.block && start + t0 < last; t0 += TILE) {
      const int n = static_cast<int>(std::min<int64_t>({TILE, a.block - t0, last - start - t0}));
      const typename R::Elem* krow = kblock + t0 * ts;
      const typename R::Elem* vrow = vblock + t0 * ts;
      // S [16 keys × lanes]: one column per query head of the run.
#ifdef GENSERVE_DECODE_AMX
      if constexpr (AMX) {
        // S = Σₖ K[:, slice k] · Qᵀ[slice k]: the keys' 32-dimension slices straight from the
        // pool (row stride = one token), or from kbuf where the 8-bit rows were decoded to the
        // same bf16 keys; a lane's other slices are zeros and add exact zeros.
        const uint16_t* kk;
        int64_t kstride;                                   // bytes between keys
        if constexpr (DIRECT) {
          kk = krow;
          kstride = ts * 2;
        } else {
          for (int t = 0; t < n; ++t)
            for (int hl = 0; hl < nh; ++hl)
              R::load(krow + t * ts + hl * W, kbuf[t][2 * hl], kbuf[t][2 * hl + 1]);
          kk = reinterpret_cast<const uint16_t*>(kbuf);
          kstride = sizeof(kbuf[0]);
        }
        _tile_zero(0);
        _tile_loadd(1, kk, kstride);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(1, kk + 32, kstride);
        _tile_dpbf16ps(0, 1, 3);
        if (nh > 1) {
          _tile_loadd(1, kk + 64, kstride);
          _tile_dpbf16ps(0, 1, 4);
          _tile_loadd(1, kk + 96, kstride);
          _tile_dpbf16ps(0, 1, 5);
        }
        if (nh > 2) {
          _tile_loadd(1, kk + 128, kstride);
          _tile_dpbf16ps(0, 1, 6);
          _tile_loadd(1, kk + 160, kstride);
          _tile_dpbf16ps(0, 1, 7);
        }
        _tile_stored(0, s[0], LANES * 4);
      }
#endif
      if constexpr (!AMX) {
        // Per token: each query head's 16 partial sums (vdpbf16ps), then all heads' sums at once.
        for (int t = 0; t < n; ++t) {
          __m512 part[LANES];
          for (int hl = 0; hl < nh; ++hl) {
            prefetch_row<R>(kahead, t0 + t, ahead_rows, hl, ts);
            __m512i k0, k1;
            R::load(krow + t * ts + hl * W, k0, k1);
            for (int g = 0; g < G; ++g)
              part[hl * G + g] = _mm512_dpbf16_ps(
                  _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[hl][g][0], (__m512bh)k0), qv[hl][g][1],
                  (__m512bh)k1);
          }
          _mm512_store_ps(s[t], lane_sums(part, nh * G));
        }
      }
      // Online softmax over the tile (keys past the context masked to -inf).
      __m512 mnew = m;
      for (int t = 0; t < TILE; ++t) {
        const __m512 x = t < n ? _mm512_mul_ps(_mm512_load_ps(s[t]), scale) : ninf;
        _mm512_store_ps(s[t], x);
        mnew = _mm512_max_ps(mnew, x);
      }
      const __m512 c = genserve::exp_ps(_mm512_sub_ps(m, mnew));
      _mm512_store_ps(corr, c);
      m = mnew;
      l = _mm512_mul_ps(l, c);
      for (int t = 0; t < n; ++t) {
        if constexpr (AMX)                 // the scores ran on tiles: the keys' prefetches go here
          for (int hl = 0; hl < nh; ++hl) prefetch_row<R>(kahead, t0 + t, ahead_rows, hl, ts);
        const __m512 p = genserve::exp_ps(_mm512_sub_ps(_mm512_load_ps(s[t]), m));
        _mm512_store_ps(s[t], p);
        l = _mm512_add_ps(l, p);
      }
      // O = O · corr + P · V, one KV head's G query heads in registers at a time.
      for (int hl = 0; hl < nh; ++hl) {
        __m512 o[G][4];
        for (int g = 0; g < G; ++g) {
          const __m512 cg = _mm512_set1_ps(corr[hl * G + g]);
          for (int i = 0; i < 4; ++i) o[g][i] = _mm512_mul_ps(_mm512_load_ps(acc[hl][g][i]), cg);
        }
        for (int t = 0; t < n; ++t) {
          prefetch_row<R>(vahead, t0 + t, ahead_rows, hl, ts);
          __m512 v[4];
          R::values(vrow + t * ts + hl * W, v);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(s[t][hl * G + g]);
            for (int i = 0; i < 4; ++i) o[g][i] = _mm512_fmadd_ps(p, v[i], o[g][i]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < 4; ++i) _mm512_store_ps(acc[hl][g][i], o[g][i]);
      }
    }
  }
  if (!whole) {                            // (m, l, O) of each query head, for merge_chunks
    alignas(64) float ms[LANES], ls[LANES];
    _mm512_store_ps(ms, m);
    _mm512_store_ps(ls, l);
    for (int hl = 0; hl < nh; ++hl)
      for (int g = 0; g < G; ++g) {
        float* p = a.partial + (((a.partial_base[b] + c) * a.kv_heads + h0 + hl) * G + g) * PARTIAL;
        p[0] = ms[hl * G + g];
        p[1] = ls[hl * G + g];
        std::memcpy(p + 2, acc[hl][g], sizeof(float) * D);
      }
    return;
  }
  alignas(64) float inv[LANES];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
  for (int hl = 0; hl < nh; ++hl)
    for (int g = 0; g < G; ++g) {
      const __m512 r = _mm512_set1_ps(inv[hl * G + g]);
      __m512 o[4];
      for (int i = 0; i < 4; ++i) o[i] = _mm512_mul_ps(_mm512_load_ps(acc[hl][g][i]), r);
      R::store(out + (hl * G + g) * D, o);
    }
}

// Row b's output for KV head h from its chunks' (m, l, O), merged in chunk order.
template <int G, class R>
void merge_chunks(const DecodeArgs<R>& a, int64_t b, int64_t h) {
  const int64_t chunks = chunks_of(a.lens[b], a.chunk);
  for (int g = 0; g < G; ++g) {
    const float* p0 = a.partial + ((a.partial_base[b] * a.kv_heads + h) * G + g) * PARTIAL;
    const int64_t stride = a.kv_heads * G * PARTIAL;          // between a row's chunks
    float mx = p0[0];
    for (int64_t c = 1; c < chunks; ++c) mx = std::max(mx, p0[c * stride]);
    float sum = 0.f;
    __m512 o[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = p0 + c * stride;
      const float w = std::exp(p[0] - mx);
      sum += p[1] * w;
      const __m512 wv = _mm512_set1_ps(w);
      for (int i = 0; i < 4; ++i) o[i] = _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 + 16 * i), wv, o[i]);
    }
    const __m512 r = _mm512_set1_ps(1.f / sum);
    for (int i = 0; i < 4; ++i) o[i] = _mm512_mul_ps(o[i], r);
    R::store(a.out + (b * a.heads + h * G + g) * 64, o);
  }
}

template <int G, bool AMX, class R>
void decode_kernel_avx512(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                          double scale) {
  constexpr int64_t W = R::WIDTH;
  const int64_t rows = q.size(0), kv_heads = k_pool.size(2), block = k_pool.size(1);
  const int64_t chunk = (CHUNK_TOKENS + block - 1) / block * block;
  const int64_t* ld = lens.data_ptr<int64_t>();
  // The (row, chunk) pairs in order, and where each row with two chunks or more keeps its
  // partials (partial_base[b]: that row's first chunk among them).
  std::vector<int64_t> item_row, item_chunk, partial_base(rows);
  int64_t partials = 0;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t n = chunks_of(ld[b], chunk);
    partial_base[b] = partials;
    if (n > 1) partials += n;
    for (int64_t c = 0; c < n; ++c) {
      item_row.push_back(b);
      item_chunk.push_back(c);
    }
  }
  // A row's KV heads go together (contiguous reads, one exp per token for all of them) when
  // there are chunks enough to keep every thread busy; else one KV head per item. Same bits.
  const int64_t most = AMX ? std::min<int64_t>(AMX_HEADS, LANES / G) : LANES / G;
  const int64_t chunks = static_cast<int64_t>(item_row.size());
  const int64_t run = chunks >= at::get_num_threads() ? std::min<int64_t>(kv_heads, most) : 1;
  const int64_t per_row = (kv_heads + run - 1) / run;
  std::unique_ptr<float[]> partial(new float[partials * kv_heads * G * PARTIAL]);   // not zeroed
  // A row's items still running; the thread that finishes its last one merges its chunks.
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[rows]);
  for (int64_t b = 0; b < rows; ++b)
    left[b].store(chunks_of(ld[b], chunk) * per_row, std::memory_order_relaxed);
  const DecodeArgs<R> a{reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()),
                        static_cast<const typename R::Elem*>(k_pool.data_ptr()),
                        static_cast<const typename R::Elem*>(v_pool.data_ptr()),
                        tables.data_ptr<int64_t>(), ld,
                        reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()),
                        q.size(1), kv_heads, block, tables.size(1), block * kv_heads * W,
                        kv_heads * W, static_cast<float>(scale), chunk, partial.get(),
                        partial_base.data()};
  at::parallel_for(0, chunks * per_row, 1, [&](int64_t begin, int64_t end) {
#ifdef GENSERVE_DECODE_AMX
    if constexpr (AMX) {
      TileConfig cfg;
      for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
      }
      _tile_loadconfig(&cfg);
    }
#endif
    int64_t loaded_row = -1, loaded_h0 = -1;           // whose Qᵀ the tiles hold
    // Item `item`'s reads: (row, chunk) pair item / per_row, KV heads from item % per_row * run.
    const auto item_reads = [&](int64_t item) {
      const int64_t i = item / per_row;
      return reads_of(a, item_row[i], item_chunk[i], item % per_row * run);
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / per_row, h0 = item % per_row * run, b = item_row[i];
      decode_item<G, AMX, R>(a, b, item_chunk[i], h0, static_cast<int>(std::min(run, kv_heads - h0)),
                             b != loaded_row || h0 != loaded_h0,
                             item + 1 < end ? item_reads(item + 1) : ItemReads{});
      loaded_row = b;
      loaded_h0 = h0;
      // acq_rel: the merging thread sees every other thread's partials of the row.
      if (left[b].fetch_sub(1, std::memory_order_acq_rel) == 1 && chunks_of(ld[b], chunk) > 1)
        for (int64_t h = 0; h < kv_heads; ++h) merge_chunks<G, R>(a, b, h);
    }
#ifdef GENSERVE_DECODE_AMX
    if constexpr (AMX) _tile_release();
#endif
  });
}

template <int G, class R>
void decode_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
#ifdef GENSERVE_DECODE_AMX
  // AMX tiles hold 16 keys, and a tile never crosses a block boundary. GENSERVE_DECODE_AMX=0
  // (read at every call) runs the vdpbf16ps scores instead, so both are tested on AMX machines.
  const char* env = std::getenv("GENSERVE_DECODE_AMX");
  if (k_pool.size(1) % TILE == 0 && !(env && std::strcmp(env, "0") == 0) && amx_permitted())
    return decode_kernel_avx512<G, true, R>(q, k_pool, v_pool, tables, lens, out, scale);
#endif
  decode_kernel_avx512<G, false, R>(q, k_pool, v_pool, tables, lens, out, scale);
}

// bf16 queries over bf16 pools, or over pools in the 8-bit format (int8).
template <int G>
void decode_bf16(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                 const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
  if (k_pool.scalar_type() == at::kChar)
    return decode_rows<G, Q8Rows>(q, k_pool, v_pool, tables, lens, out, scale);
  decode_rows<G, Bf16Rows>(q, k_pool, v_pool, tables, lens, out, scale);
}

// bf16 decode rows of head_dim D (64, 128 or 256) over bf16 pools, optionally over a sliding
// window (`window` > 0: the row's last `window` positions), for `paged_decode_window`: the layers
// the one-pass kernel above does not serve (Qwen3's 128, Gemma 3's 256, sliding layers).
//
// Work item = (row, KV head), its G query heads in the lanes of one zmm. Two passes over the
// positions read, in position order:
//   S[t][g] = q[g] · k[t] · scale     vdpbf16ps over D / 32 pairs of registers (two chains),
//                                     then one `lane_sums` tree per key for the G heads
//   p[t] = exp(S[t] − max S), l = Σ p  lane-wise (one exp per key for every head)
//   out[g] = Σₜ p[t][g] · v[t] / l[g]  fp32 FMAs, 64 dimensions at a time
// Every order is fixed by the row's own length and window, so a row's bits do not depend on the
// batch or on how the items are split between threads.
template <int G, int D>
void decode_wide_avx512(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                        double scale, int64_t window) {
  static_assert(G <= LANES && D % 64 == 0, "G query heads in one zmm, whole 64-dimension chunks");
  constexpr int NQ = D / 32;                              // 32-bf16 registers per head vector
  const int64_t heads = q.size(1);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2), table_width = tables.size(1);
  const int64_t block_stride = block * kv_heads * D, token_stride = kv_heads * D;
  const auto* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kd = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<c10::BFloat16>());
  const auto* vd = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<c10::BFloat16>());
  const int64_t* td = tables.data_ptr<int64_t>();
  const int64_t* ld = lens.data_ptr<int64_t>();
  auto* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  at::parallel_for(0, q.size(0) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;                            // [positions read, LANES]
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, end_pos = ld[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, end_pos - window) : 0;
      const int64_t len = end_pos - first;
      const int64_t* table = td + b * table_width;
      scores.resize(len * LANES);
      // Positions first .. end_pos - 1 in order: visit(index among them, the token's head
      // vector from `offset` on).
      auto each_token = [&](const uint16_t* pool, int64_t offset, auto&& visit) {
        for (int64_t pos = first; pos < end_pos;) {
          const int64_t in = pos % block, n = std::min(block - in, end_pos - pos);
          const uint16_t* base = pool + table[pos / block] * block_stride + in * token_stride + h * D + offset;
          for (int64_t t = 0; t < n; ++t) visit(pos - first + t, base + t * token_stride);
          pos += n;
        }
      };
      __m512i qv[G][NQ];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < NQ; ++i)
          qv[g][i] = _mm512_loadu_si512(qd + (b * heads + h * G + g) * D + 32 * i);
      const __m512 zero = _mm512_setzero_ps();
      __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::max());
      each_token(kd, 0, [&](int64_t t, const uint16_t* row) {
        __m512i k[NQ];
        for (int i = 0; i < NQ; ++i) k[i] = _mm512_loadu_si512(row + 32 * i);
        __m512 part[G];
        for (int g = 0; g < G; ++g) {
          __m512 a0 = _mm512_dpbf16_ps(zero, (__m512bh)qv[g][0], (__m512bh)k[0]);
          __m512 a1 = _mm512_dpbf16_ps(zero, (__m512bh)qv[g][1], (__m512bh)k[1]);
          for (int i = 2; i < NQ; i += 2) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)qv[g][i], (__m512bh)k[i]);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)qv[g][i + 1], (__m512bh)k[i + 1]);
          }
          part[g] = _mm512_add_ps(a0, a1);
        }
        const __m512 s = _mm512_mul_ps(lane_sums(part, G), vscale);
        _mm512_storeu_ps(&scores[t * LANES], s);
        mx = _mm512_max_ps(mx, s);
      });
      __m512 l = zero;
      for (int64_t t = 0; t < len; ++t) {
        const __m512 p = genserve::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(&scores[t * LANES]), mx));
        _mm512_storeu_ps(&scores[t * LANES], p);
        l = _mm512_add_ps(l, p);
      }
      alignas(64) float inv[LANES];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t c = 0; c < D / 64; ++c) {
        __m512 o[G][4];
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < 4; ++i) o[g][i] = zero;
        each_token(vd, 64 * c, [&](int64_t t, const uint16_t* row) {
          __m512 v[4];
          Bf16Rows::values(row, v);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(scores[t * LANES + g]);
            for (int i = 0; i < 4; ++i) o[g][i] = _mm512_fmadd_ps(p, v[i], o[g][i]);
          }
        });
        for (int g = 0; g < G; ++g) {
          const __m512 r = _mm512_set1_ps(inv[g]);
          for (int i = 0; i < 4; ++i) o[g][i] = _mm512_mul_ps(o[g][i], r);
          Bf16Rows::store(od + (b * heads + h * G + g) * D + 64 * c, o[g]);
        }
      }
    }
  });
}
#endif  // __AVX512BF16__ && __AVX512BW__

// Calls run(std::integral_constant<int, G>{}) for G = the query heads per KV head, one of the
// group sizes the kernels are instantiated for (1, 2, 3, 4, 8); raises (RuntimeError) otherwise.
template <class Run>
void with_group(int64_t group, Run&& run) {
  switch (group) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
  }
}

template <typename T>
void dispatch_group(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
  with_group(q.size(1) / k_pool.size(2), [&](auto group) {
    constexpr int G = decltype(group)::value;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return decode_bf16<G>(q, k_pool, v_pool, tables, lens, out, scale);
#elif defined(GENSERVE_DECODE_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return decode_kernel_avx2<G>(q, k_pool, v_pool, tables, lens, out, scale);
#endif
    return decode_kernel<T, G>(q, k_pool, v_pool, tables, lens, out, scale);
  });
}

// paged_decode_window's loops: head_dim D, the group from q and the pools.
template <typename T, int D>
void dispatch_window(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                     const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                     double scale, int64_t window) {
  with_group(q.size(1) / k_pool.size(2), [&](auto group) {
    constexpr int G = decltype(group)::value;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      return decode_wide_avx512<G, D>(q, k_pool, v_pool, tables, lens, out, scale, window);
#endif
    return decode_kernel<T, G, D>(q, k_pool, v_pool, tables, lens, out, scale, window);
  });
}

// The checks both ops make of q, the pools and the block tables: every block a row reads is in
// its table and in the pool (the kernels do not check again).
void check_decode_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& tables, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "q [B, H, D], pools [blocks, block, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  tables.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "K and V pools share a dtype");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lens.numel() == q.size(0),
              "tables [B, blocks per row] and lens [B] for q's B rows");
  const int64_t block = k_pool.size(1), blocks = k_pool.size(0), width = tables.size(1);
  const int64_t* ld = lens.data_ptr<int64_t>();
  const int64_t* td = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(ld[b] >= 1 && ld[b] <= width * block, "lens[", b, "] = ", ld[b],
                ": a row's context is 1 to ", width * block,
                " tokens (its block table's width times the block size)");
    for (int64_t i = 0; i < (ld[b] + block - 1) / block; ++i)
      TORCH_CHECK(td[b * width + i] >= 0 && td[b * width + i] < blocks, "tables[", b, ", ", i,
                  "] = ", td[b * width + i], ": not a block of the pool (0 to ", blocks - 1, ")");
  }
}

}  // namespace

at::Tensor genserve::paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& tables,
                                  const at::Tensor& lens, double scale) {
  check_decode_inputs(q, k_pool, v_pool, tables, lens);
  at::Tensor out = at::empty_like(q);
  if (k_pool.scalar_type() == at::kChar) {           // the 8-bit format
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(2) == 64 &&
                    k_pool.size(3) == genserve::kv8_row_bytes(64) && q.size(1) % k_pool.size(2) == 0,
                "8-bit pools: bf16 q, head_dim 64 (rows of 66 bytes) and whole GQA groups");
    dispatch_group<c10::BFloat16>(q, k_pool, v_pool, tables, lens, out, scale);
    return out;
#else
    TORCH_CHECK(false, "8-bit KV pools need the AVX512-BF16 build of genserve's kernels");
#endif
  }
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type(), "q and pools share a dtype");
  TORCH_CHECK(q.size(2) == 64 && k_pool.size(3) == 64 && q.size(1) % k_pool.size(2) == 0,
              "head_dim 64 and whole GQA groups");
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_group<c10::BFloat16>(q, k_pool, v_pool, tables, lens, out, scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or fp32");
    dispatch_group<float>(q, k_pool, v_pool, tables, lens, out, scale);
  }
  return out;
}

at::Tensor genserve::paged_decode_window(const at::Tensor& q, const at::Tensor& k_pool,
                                         const at::Tensor& v_pool, const at::Tensor& tables,
                                         const at::Tensor& lens, double scale, int64_t window) {
  check_decode_inputs(q, k_pool, v_pool, tables, lens);
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "q and pools: bf16 or fp32, one dtype (not the 8-bit format)");
  const int64_t hd = q.size(2);
  TORCH_CHECK((hd == 64 || hd == 128 || hd == 256) && k_pool.size(3) == hd &&
                  q.size(1) % k_pool.size(2) == 0,
              "head_dim 64, 128 or 256 and whole GQA groups");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: the whole context)");
  at::Tensor out = at::empty_like(q);
  auto run = [&](auto head_dim) {
    constexpr int D = decltype(head_dim)::value;
    if (q.scalar_type() == at::kBFloat16)
      dispatch_window<c10::BFloat16, D>(q, k_pool, v_pool, tables, lens, out, scale, window);
    else
      dispatch_window<float, D>(q, k_pool, v_pool, tables, lens, out, scale, window);
  };
  if (hd == 64) run(std::integral_constant<int, 64>{});
  else if (hd == 128) run(std::integral_constant<int, 128>{});
  else run(std::integral_constant<int, 256>{});
  return out;
}

TORCH_LIBRARY(genserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lens, float scale) -> Tensor");
  m.def("paged_decode_window(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lens, "
        "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("paged_decode", &genserve::paged_decode);
  m.impl("paged_decode_window", &genserve::paged_decode_window);
}
