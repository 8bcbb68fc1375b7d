// Causal prefill attention of one piece over its paged context, bf16, head_dim 64:
// flash-attention style (Dao et al. 2022) online softmax in fp32.
//
//   out[t, h, :] = softmax_j(q[t, h] · k[j] * scale) · v[j],   j <= start + t
//
// Two builds of the same op, whichever the compiler targets:
//
// * AVX512-BF16 (vdpbf16ps). Work item = (KV head, tile of 16 query positions): the tile's 16 · G
//   query rows (its G = heads per KV head, GQA) sit in the lanes of G zmm registers, so one key is
//   broadcast against all of them and the row max / sum of the softmax are lane-wise (no
//   horizontal reductions):
//
//     S[j][r] = Σ_p (q[r][2p], q[r][2p+1]) · (k[j][2p], k[j][2p+1])       Q packed once per tile
//     O[d][r] += Σ_jp (P[2jp][r], P[2jp+1][r]) · (v[2jp][d], v[2jp+1][d])   V packed once per piece
//
//   Keys go 64 at a time: scores, causal mask (-inf past the row's position), new running max,
//   P = exp(S - max) (probabilities rounded to bf16 for P·V, as torch's flash kernel does), O and
//   the running sum rescaled, P·V accumulated in fp32. Blocks past a tile's last position are
//   skipped.
//
// * AVX2 + FMA without AVX512-BF16. The same design on 8-lane ymm registers in fp32: work item =
//   (KV head, tile of 8 query positions), the tile's 8 · G rows in the lanes of G ymm registers
//   (Q widened to fp32 and pre-scaled once per tile); the piece's context K and V are widened once
//   per piece into fp32 scratch [kv_heads, context + 8, D] (read there in position order, no
//   block table), so a key element is one broadcast against G registers of rows:
//
//     S[j][r] = Σ_d (q[r][d] · scale) · k[j][d]          fp32 FMAs, a few keys per register block
//     O[d][r] += Σ_j P[j][r] · v[j][d]                   fp32 FMAs, P in fp32
//
//   Keys go 64 at a time, the last block cut at the tile's last position (past it only the rest
//   of a register block of keys is computed, masked): scores, causal mask, running max,
//   P = exp(S - max), running sum and O rescaled by exp(old max - new max) (on the load of O for
//   P·V), P·V accumulated in fp32. Widening K and V once per piece measured faster than widening
//   each 64-key block per tile (benchmarks/results/kernels/history.md, "Prefill attention on CPUs
//   with AVX2 alone").
//
// Every loop runs in an order fixed by the piece alone, so the result never depends on other
// requests in the step or on the thread count. Built only where the compiler targets one of the
// two; elsewhere the op is absent and attention uses torch's SDPA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx2_math.h"
#include "avx512_math.h"
#include "bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENSERVE_PREFILL_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define GENSERVE_PREFILL_AVX2 1
#endif

#if defined(GENSERVE_PREFILL_AVX512) || defined(GENSERVE_PREFILL_AVX2)

#include <algorithm>
#include <type_traits>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int D = 64;        // head_dim
constexpr int KB = 64;       // keys per softmax block

// Tile indices 0, T-1, 1, T-2, ... of a piece's T tiles: later tiles see more keys (causal), so in
// this order the contiguous ranges at::parallel_for hands each thread carry about equal work.
std::vector<int64_t> balanced_tile_order(int64_t tiles) {
  std::vector<int64_t> order;
  for (int64_t a = 0, b = tiles - 1; a <= b; ++a, --b) {
    order.push_back(a);
    if (a != b) order.push_back(b);
  }
  return order;
}

#if defined(GENSERVE_PREFILL_AVX512)

using genserve::exp_ps;
using genserve::interleave_bf16;

constexpr int P = D / 2;     // bf16 pairs per head vector
constexpr int TQ = 16;       // query positions per tile

struct Piece {
  const uint32_t* q;         // [q_len, heads, P] bf16 pairs
  const c10::BFloat16* k;    // pool [blocks, block, kv_heads, D]
  const uint32_t* vpk;       // [kv_heads, len_pad / 2, D] pairs of consecutive keys' values
  const int64_t* table;
  c10::BFloat16* out;        // [q_len, heads, D]
  int64_t q_len, start, heads, kv_heads, block, len_pad;
  float scale;
};

template <int G>
void tile(const Piece& pc, int64_t h, int64_t t0) {
  constexpr int R = TQ * G;                            // rows: position-major, r = t · G + g
  constexpr int KC = G <= 3 ? 8 : (G == 4 ? 6 : 3);    // keys per register block
  alignas(64) uint32_t qp[P][R];
  alignas(64) float s[KB][R];
  alignas(64) uint32_t pp[KB / 2][R];
  alignas(64) float o[D][R];
  alignas(64) static const uint32_t zero_row[P] = {};
  const int64_t rows_valid = std::min<int64_t>(TQ, pc.q_len - t0) * G;
  for (int r = 0; r < R; ++r) {
    const int64_t t = t0 + r / G;
    const uint32_t* src = pc.q + (t * pc.heads + h * G + r % G) * P;
    for (int p = 0; p < P; ++p) qp[p][r] = r < rows_valid ? src[p] : 0u;
  }
  __m512i qpos[G];                                     // each row's query position
  for (int v = 0; v < G; ++v) {
    alignas(64) int32_t pos[16];
    for (int i = 0; i < 16; ++i)
      pos[i] = static_cast<int32_t>(pc.start + t0 + std::min<int64_t>((v * 16 + i) / G, TQ - 1));
    qpos[v] = _mm512_load_si512(pos);
  }
  __m512 m[G], l[G];
  for (int v = 0; v < G; ++v) {
    m[v] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[v] = _mm512_setzero_ps();
  }
  std::memset(o, 0, sizeof o);
  const int64_t kend = pc.start + t0 + rows_valid / G;          // keys [0, kend) are needed
  const int64_t token_stride = pc.kv_heads * D;
  const uint32_t* vpk = pc.vpk + h * (pc.len_pad / 2) * D;
  for (int64_t kb = 0; kb < kend; kb += KB) {
    // S = Q · Kᵀ for keys [kb, kb + KB), KC keys at a time held in registers.
    for (int k0 = 0; k0 < KB; k0 += KC) {
      const uint32_t* key[KC];
      for (int k = 0; k < KC; ++k) {
        const int64_t j = kb + k0 + k;
        key[k] = (k0 + k < KB && j < kend)
                     ? reinterpret_cast<const uint32_t*>(
                           pc.k + (pc.table[j / pc.block] * pc.block + j % pc.block) * token_stride +
                           h * D)
                     : zero_row;
      }
      __m512 acc[KC][G];
      for (int k = 0; k < KC; ++k)
        for (int v = 0; v < G; ++v) acc[k][v] = _mm512_setzero_ps();
      for (int p = 0; p < P; ++p) {
        __m512bh qv[G];
        for (int v = 0; v < G; ++v) qv[v] = (__m512bh)_mm512_load_si512(&qp[p][v * 16]);
        for (int k = 0; k < KC; ++k) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(key[k][p]));
          for (int v = 0; v < G; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], qv[v], b);
        }
      }
      for (int k = 0; k < KC && k0 + k < KB; ++k)
        for (int v = 0; v < G; ++v) _mm512_store_ps(&s[k0 + k][v * 16], acc[k][v]);
    }
    // Scale, causal mask, running max.
    const __m512 scale = _mm512_set1_ps(pc.scale);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 mnew[G];
    for (int v = 0; v < G; ++v) mnew[v] = m[v];
    for (int k = 0; k < KB; ++k) {
      const __m512i j = _mm512_set1_epi32(static_cast<int32_t>(kb + k));
      for (int v = 0; v < G; ++v) {
        const __mmask16 past = _mm512_cmpgt_epi32_mask(j, qpos[v]);
        const __m512 x = _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_load_ps(&s[k][v * 16]), scale),
                                            past, ninf);
        _mm512_store_ps(&s[k][v * 16], x);
        mnew[v] = _mm512_max_ps(mnew[v], x);
      }
    }
    // P = exp(S - max), running sum, O rescaled by exp(old max - new max).
    for (int v = 0; v < G; ++v) {
      const __m512 corr = exp_ps(_mm512_sub_ps(m[v], mnew[v]));
      l[v] = _mm512_mul_ps(l[v], corr);
      if (kb > 0)
        for (int d = 0; d < D; ++d)
          _mm512_store_ps(&o[d][v * 16], _mm512_mul_ps(_mm512_load_ps(&o[d][v * 16]), corr));
      m[v] = mnew[v];
    }
    for (int k = 0; k < KB; k += 2)
      for (int v = 0; v < G; ++v) {
        const __m512 p0 = exp_ps(_mm512_sub_ps(_mm512_load_ps(&s[k][v * 16]), m[v]));
        const __m512 p1 = exp_ps(_mm512_sub_ps(_mm512_load_ps(&s[k + 1][v * 16]), m[v]));
        const __m512i pair = interleave_bf16(p0, p1);
        // The sum uses the rounded probabilities P·V will use, so the weights sum to exactly 1.
        const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        const __m512 r1 = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(0xffff0000)));
        l[v] = _mm512_add_ps(l[v], _mm512_add_ps(r0, r1));
        _mm512_store_si512(&pp[k / 2][v * 16], pair);
      }
    // O += P · V, 8 head dimensions at a time held in registers.
    const int jp_end = static_cast<int>(std::min<int64_t>(KB, kend - kb) + 1) / 2;
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m512 acc[8][G];
      for (int dd = 0; dd < 8; ++dd)
        for (int v = 0; v < G; ++v) acc[dd][v] = _mm512_load_ps(&o[d0 + dd][v * 16]);
      for (int jp = 0; jp < jp_end; ++jp) {
        const uint32_t* vrow = vpk + (kb / 2 + jp) * D + d0;
        __m512bh pv[G];
        for (int v = 0; v < G; ++v) pv[v] = (__m512bh)_mm512_load_si512(&pp[jp][v * 16]);
        for (int dd = 0; dd < 8; ++dd) {
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(vrow[dd]));
          for (int v = 0; v < G; ++v) acc[dd][v] = _mm512_dpbf16_ps(acc[dd][v], pv[v], b);
        }
      }
      for (int dd = 0; dd < 8; ++dd)
        for (int v = 0; v < G; ++v) _mm512_store_ps(&o[d0 + dd][v * 16], acc[dd][v]);
    }
  }
  alignas(64) float inv_l[R];
  for (int v = 0; v < G; ++v) _mm512_store_ps(&inv_l[v * 16], _mm512_div_ps(_mm512_set1_ps(1.f), l[v]));
  for (int r = 0; r < rows_valid; ++r) {
    c10::BFloat16* dst = pc.out + ((t0 + r / G) * pc.heads + h * G + r % G) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(o[d][r] * inv_l[r]);
  }
}

template <int G>
void run(const Piece& pc) {
  const int64_t tiles = (pc.q_len + TQ - 1) / TQ;
  const std::vector<int64_t> order = balanced_tile_order(tiles);
  at::parallel_for(0, tiles * pc.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item)
      tile<G>(pc, item % pc.kv_heads, order[item / pc.kv_heads] * TQ);
  });
}

// Items [b, e) of a context's V packing (item = KV head · len_pad / 2 + pair): pairs of
// consecutive keys' values, [kv_heads, len_pad / 2, D] at vp, zeros past the `len` keys of the
// block table `tb`.
void pack_values(const at::Tensor& v_pool, const int64_t* tb, int64_t len, int64_t len_pad,
                 uint32_t* vp, int64_t b, int64_t e) {
  const int64_t kv_heads = v_pool.size(2), block = v_pool.size(1);
  const uint16_t* vsrc = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<c10::BFloat16>());
  for (int64_t item = b; item < e; ++item) {
    const int64_t h = item / (len_pad / 2), jp = item % (len_pad / 2);
    uint32_t* dst = vp + item * D;
    const uint16_t* row[2] = {nullptr, nullptr};
    for (int i = 0; i < 2; ++i) {
      const int64_t j = 2 * jp + i;
      if (j < len) row[i] = vsrc + ((tb[j / block] * block + j % block) * kv_heads + h) * D;
    }
    for (int d = 0; d < D; ++d)
      dst[d] = (row[0] ? row[0][d] : 0u) | (static_cast<uint32_t>(row[1] ? row[1][d] : 0u) << 16);
  }
}

// Every prefill piece of a step in one call (`paged_prefill_pieces` below): each context's V
// packed once for all its pieces, then one parallel loop over every piece's (KV head, tile)
// items. A piece's tiles read the keys and values of their own context only (keys past a row's
// position get probability 0, and a probability-0 pair slot adds 0 · v, the same as the zero a
// context of the piece's own length would hold there, for any finite v), so each piece has the
// bits `prefill` gives it alone.
at::Tensor prefill_pieces(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& tables, const at::Tensor& pieces, double scale) {
  const int64_t kv_heads = k_pool.size(2), block = k_pool.size(1), heads = q.size(1);
  const int64_t seqs = tables.size(0), width = tables.size(1), n = pieces.size(0);
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* pc4 = pieces.data_ptr<int64_t>();      // [n, 4]: q offset, length, start, context
  std::vector<int64_t> len(seqs, 0), pad(seqs), base(seqs + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    len[pc4[4 * i + 3]] = std::max(len[pc4[4 * i + 3]], pc4[4 * i + 2] + pc4[4 * i + 1]);
  for (int64_t c = 0; c < seqs; ++c) {
    pad[c] = (len[c] + KB - 1) / KB * KB;
    base[c + 1] = base[c] + kv_heads * (pad[c] / 2) * D;
  }
  at::Tensor vpk = at::empty({std::max<int64_t>(base[seqs], 1)}, q.options().dtype(at::kInt));
  uint32_t* vp = reinterpret_cast<uint32_t*>(vpk.data_ptr<int32_t>());
  at::parallel_for(0, seqs, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c)
      pack_values(v_pool, tb + c * width, len[c], pad[c], vp + base[c], 0, kv_heads * (pad[c] / 2));
  });
  at::Tensor out = at::empty_like(q);
  std::vector<Piece> pcs;
  struct Item { int64_t piece, head, t0, keys; };
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t off = pc4[4 * i], q_len = pc4[4 * i + 1], start = pc4[4 * i + 2], c = pc4[4 * i + 3];
    pcs.push_back(Piece{reinterpret_cast<const uint32_t*>(q.data_ptr<c10::BFloat16>()) + off * heads * P,
                        k_pool.data_ptr<c10::BFloat16>(), vp + base[c], tb + c * width,
                        out.data_ptr<c10::BFloat16>() + off * heads * D, q_len, start, heads,
                        kv_heads, block, pad[c], static_cast<float>(scale)});
    for (int64_t t0 = 0; t0 < q_len; t0 += TQ)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back(Item{i, h, t0, start + std::min(t0 + TQ, q_len)});
  }
  // Largest first, then alternately from each end (`balanced_tile_order` across pieces), so the
  // contiguous ranges at::parallel_for hands the threads carry about equal work.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.keys > b.keys; });
  std::vector<int64_t> order = balanced_tile_order(static_cast<int64_t>(items.size()));
  const auto go = [&](auto g) {
    constexpr int G = decltype(g)::value;
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) {
        const Item& it = items[order[k]];
        tile<G>(pcs[it.piece], it.head, it.t0);
      }
    });
  };
  switch (heads / kv_heads) {
    case 1: go(std::integral_constant<int, 1>{}); break;
    case 2: go(std::integral_constant<int, 2>{}); break;
    case 3: go(std::integral_constant<int, 3>{}); break;
    case 4: go(std::integral_constant<int, 4>{}); break;
    case 8: go(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
  }
  return out;
}

at::Tensor prefill(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const int64_t* tb, int64_t start, double scale) {
  const int64_t q_len = q.size(0), kv_heads = k_pool.size(2), block = k_pool.size(1);
  const int64_t len = start + q_len, len_pad = (len + KB - 1) / KB * KB;
  // V as pairs of consecutive keys, [kv_heads, len_pad / 2, D] (zeros past the context).
  at::Tensor vpk = at::empty({kv_heads, len_pad / 2, D}, q.options().dtype(at::kInt));
  uint32_t* vp = reinterpret_cast<uint32_t*>(vpk.data_ptr<int32_t>());
  at::parallel_for(0, kv_heads * (len_pad / 2), 64, [&](int64_t b, int64_t e) {
    pack_values(v_pool, tb, len, len_pad, vp, b, e);
  });
  at::Tensor out = at::empty_like(q);
  const Piece pc{reinterpret_cast<const uint32_t*>(q.data_ptr<c10::BFloat16>()),
                 k_pool.data_ptr<c10::BFloat16>(), vp, tb, out.data_ptr<c10::BFloat16>(),
                 q_len, start, q.size(1), kv_heads, block, len_pad, static_cast<float>(scale)};
  switch (q.size(1) / kv_heads) {
    case 1: run<1>(pc); break;
    case 2: run<2>(pc); break;
    case 3: run<3>(pc); break;
    case 4: run<4>(pc); break;
    case 8: run<8>(pc); break;
    default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
  }
  return out;
}
#else  // GENSERVE_PREFILL_AVX2

using genserve::exp256_ps;
using genserve::load_bf16x8;
using genserve::to_float;

constexpr int TQ = 8;        // query positions per tile: one per lane of a ymm
constexpr int KPAD = 8;      // zero keys past the context in the fp32 scratch (a register block's tail)

struct Piece {
  const c10::BFloat16* q;    // [q_len, heads, D]
  const float* kf;           // [kv_heads, len_pad, D] keys in fp32, zeros past the context
  const float* vf;           // [kv_heads, len_pad, D] values likewise
  c10::BFloat16* out;        // [q_len, heads, D]
  int64_t q_len, start, heads, kv_heads, len_pad;
  float scale;
};

// Register blocking for G ymm registers of rows (16 ymm registers): KC keys' scores at a time
// (KC · G accumulators) and DC head dimensions of O at a time (DC · G accumulators).
template <int G> constexpr int score_keys() { return G == 1 ? 8 : G == 2 ? 6 : G == 3 ? 4 : G == 4 ? 3 : 1; }
template <int G> constexpr int pv_dims() { return G == 1 ? 8 : G <= 3 ? 4 : G == 4 ? 2 : 1; }

// x, kept in a register: GCC otherwise folds the loads of the G row vectors into every FMA that
// uses them (G loads per broadcast key element instead of G per head dimension), and Zen 3's two
// 256-bit loads per cycle, not its two FMA pipes, then bound the inner loops.
inline __m256 in_register(__m256 x) {
  asm("" : "+x"(x));
  return x;
}

template <int G>
void tile(const Piece& pc, int64_t h, int64_t t0) {
  constexpr int R = TQ * G;                            // rows: position-major, r = t · G + g
  constexpr int KC = score_keys<G>(), DC = pv_dims<G>();
  static_assert(KC <= KPAD && D % DC == 0, "register blocks");
  alignas(32) float qf[D][R];                          // Q · scale, transposed
  alignas(32) float s[KB + KPAD][R];                   // scores, then probabilities
  alignas(32) float o[D][R];
  alignas(32) float corr[R];
  const int64_t rows_valid = std::min<int64_t>(TQ, pc.q_len - t0) * G;
  for (int r = 0; r < R; ++r) {
    const c10::BFloat16* src = pc.q + ((t0 + r / G) * pc.heads + h * G + r % G) * D;
    for (int d = 0; d < D; ++d) qf[d][r] = r < rows_valid ? to_float(src[d]) * pc.scale : 0.f;
  }
  __m256i qpos[G];                                     // each row's query position
  for (int v = 0; v < G; ++v) {
    alignas(32) int32_t pos[8];
    for (int i = 0; i < 8; ++i)
      pos[i] = static_cast<int32_t>(pc.start + t0 + std::min<int64_t>((v * 8 + i) / G, TQ - 1));
    qpos[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pos));
  }
  // A finite "minus infinity" (-ffast-math assumes no infinities): its exp, and exp(it - max),
  // are exactly 0, and every row sees key 0 in the first block, so the max is finite after it.
  const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
  __m256 m[G], l[G];
  for (int v = 0; v < G; ++v) {
    m[v] = lowest;
    l[v] = _mm256_setzero_ps();
  }
  std::memset(o, 0, sizeof o);
  const int64_t kend = pc.start + t0 + rows_valid / G;          // keys [0, kend) are needed
  const int64_t first_pos = pc.start + t0;                      // keys past it are masked
  const float* kh = pc.kf + h * pc.len_pad * D;
  const float* vh = pc.vf + h * pc.len_pad * D;
  for (int64_t kb = 0; kb < kend; kb += KB) {
    const int nk = static_cast<int>(std::min<int64_t>(KB, kend - kb));
    // S = (Q · scale) · Kᵀ for keys [kb, kb + nk), KC keys at a time held in registers (the last
    // block's tail reads the following keys or the zero padding; they are masked below).
    for (int k0 = 0; k0 < nk; k0 += KC) {
      const float* kr = kh + (kb + k0) * D;
      __m256 acc[KC][G];
      for (int k = 0; k < KC; ++k)
        for (int v = 0; v < G; ++v) acc[k][v] = _mm256_setzero_ps();
      for (int d = 0; d < D; ++d) {
        __m256 qv[G];
        for (int v = 0; v < G; ++v) qv[v] = in_register(_mm256_load_ps(&qf[d][v * 8]));
        for (int k = 0; k < KC; ++k) {
          const __m256 b = _mm256_broadcast_ss(kr + k * D + d);
          for (int v = 0; v < G; ++v) acc[k][v] = _mm256_fmadd_ps(qv[v], b, acc[k][v]);
        }
      }
      for (int k = 0; k < KC; ++k)
        for (int v = 0; v < G; ++v) _mm256_store_ps(&s[k0 + k][v * 8], acc[k][v]);
    }
    // Causal mask (only where a key lies past a row's position), running max.
    __m256 mnew[G];
    for (int v = 0; v < G; ++v) mnew[v] = m[v];
    const bool diagonal = kb + nk - 1 > first_pos;
    for (int k = 0; k < nk; ++k) {
      const __m256i j = _mm256_set1_epi32(static_cast<int32_t>(kb + k));
      for (int v = 0; v < G; ++v) {
        __m256 x = _mm256_load_ps(&s[k][v * 8]);
        if (diagonal) {
          x = _mm256_blendv_ps(x, lowest, _mm256_castsi256_ps(_mm256_cmpgt_epi32(j, qpos[v])));
          _mm256_store_ps(&s[k][v * 8], x);
        }
        mnew[v] = _mm256_max_ps(mnew[v], x);
      }
    }
    // P = exp(S - max), running sum rescaled by exp(old max - new max) (O is, on its load below).
    for (int v = 0; v < G; ++v) {
      const __m256 c = exp256_ps(_mm256_sub_ps(m[v], mnew[v]));
      _mm256_store_ps(&corr[v * 8], c);
      l[v] = _mm256_mul_ps(l[v], c);
      m[v] = mnew[v];
    }
    for (int k = 0; k < nk; ++k)
      for (int v = 0; v < G; ++v) {
        const __m256 p = exp256_ps(_mm256_sub_ps(_mm256_load_ps(&s[k][v * 8]), m[v]));
        l[v] = _mm256_add_ps(l[v], p);
        _mm256_store_ps(&s[k][v * 8], p);
      }
    // O = O · corr + P · V, DC head dimensions at a time held in registers.
    for (int d0 = 0; d0 < D; d0 += DC) {
      __m256 acc[DC][G];
      for (int dd = 0; dd < DC; ++dd)
        for (int v = 0; v < G; ++v)
          acc[dd][v] = _mm256_mul_ps(_mm256_load_ps(&o[d0 + dd][v * 8]), _mm256_load_ps(&corr[v * 8]));
      const float* vr = vh + kb * D + d0;
      for (int j = 0; j < nk; ++j, vr += D) {
        __m256 pv[G];
        for (int v = 0; v < G; ++v) pv[v] = in_register(_mm256_load_ps(&s[j][v * 8]));
        for (int dd = 0; dd < DC; ++dd) {
          const __m256 b = _mm256_broadcast_ss(vr + dd);
          for (int v = 0; v < G; ++v) acc[dd][v] = _mm256_fmadd_ps(pv[v], b, acc[dd][v]);
        }
      }
      for (int dd = 0; dd < DC; ++dd)
        for (int v = 0; v < G; ++v) _mm256_store_ps(&o[d0 + dd][v * 8], acc[dd][v]);
    }
  }
  alignas(32) float inv_l[R];
  for (int v = 0; v < G; ++v) _mm256_store_ps(&inv_l[v * 8], _mm256_div_ps(_mm256_set1_ps(1.f), l[v]));
  for (int r = 0; r < rows_valid; ++r) {
    c10::BFloat16* dst = pc.out + ((t0 + r / G) * pc.heads + h * G + r % G) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(o[d][r] * inv_l[r]);
  }
}

template <int G>
void run(const Piece& pc) {
  const int64_t tiles = (pc.q_len + TQ - 1) / TQ;
  // Items head-major (each head's tiles in `balanced_tile_order`), so a thread's tiles share one
  // or two heads' keys and values in its caches.
  const std::vector<int64_t> order = balanced_tile_order(tiles);
  at::parallel_for(0, tiles * pc.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item)
      tile<G>(pc, item / tiles, order[item % tiles] * TQ);
  });
}

at::Tensor prefill(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const int64_t* tb, int64_t start, double scale) {
  const int64_t q_len = q.size(0), kv_heads = k_pool.size(2), block = k_pool.size(1);
  const int64_t len = start + q_len, len_pad = len + KPAD;
  // K and V widened to fp32 in position order, [2, kv_heads, len_pad, D] (zeros past the context).
  at::Tensor kv = at::empty({2, kv_heads, len_pad, D}, q.options().dtype(at::kFloat));
  float* kvf = kv.data_ptr<float>();
  const c10::BFloat16* pools[2] = {k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>()};
  at::parallel_for(0, 2 * kv_heads * len_pad, 64, [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t which = item / (kv_heads * len_pad), h = item / len_pad % kv_heads,
                    j = item % len_pad;
      float* dst = kvf + item * D;
      if (j < len) {
        const c10::BFloat16* src = pools[which] + ((tb[j / block] * block + j % block) * kv_heads + h) * D;
        for (int c = 0; c < D / 8; ++c) _mm256_storeu_ps(dst + 8 * c, load_bf16x8(src + 8 * c));
      } else {
        std::memset(dst, 0, D * sizeof(float));
      }
    }
  });
  at::Tensor out = at::empty_like(q);
  const Piece pc{q.data_ptr<c10::BFloat16>(), kvf, kvf + kv_heads * len_pad * D,
                 out.data_ptr<c10::BFloat16>(), q_len, start, q.size(1), kv_heads, len_pad,
                 static_cast<float>(scale)};
  switch (q.size(1) / kv_heads) {
    case 1: run<1>(pc); break;
    case 2: run<2>(pc); break;
    case 3: run<3>(pc); break;
    case 4: run<4>(pc); break;
    case 8: run<8>(pc); break;
    default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
  }
  return out;
}


// Every prefill piece of a step in one call: `prefill` per piece, in order, into one output
// (this build widens each piece's context to fp32 anyway, so there is no packing to share).
at::Tensor prefill_pieces(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& tables, const at::Tensor& pieces, double scale) {
  const int64_t* pc4 = pieces.data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  at::Tensor out = at::empty_like(q);
  for (int64_t i = 0; i < pieces.size(0); ++i) {
    const int64_t off = pc4[4 * i], q_len = pc4[4 * i + 1];
    out.narrow(0, off, q_len).copy_(prefill(q.narrow(0, off, q_len), k_pool, v_pool,
                                            tables.data_ptr<int64_t>() + pc4[4 * i + 3] * width,
                                            pc4[4 * i + 2], scale));
  }
  return out;
}

#endif  // GENSERVE_PREFILL_AVX512 / GENSERVE_PREFILL_AVX2

// The op: arguments checked once for both builds, then `prefill` of the build the compiler targets.
// q [T, H, D] bf16, pools [blocks, block, kv_heads, D] bf16, table int64 [>= ceil((start + T) /
// block)] of pool blocks in position order, `start` = the piece's first position; returns
// [T, H, D] bf16.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                         const at::Tensor& table, int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "q [T, H, D], pools [blocks, block, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16 &&
                  v_pool.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  table.is_contiguous() && table.scalar_type() == at::kLong, "contiguous inputs");
  TORCH_CHECK(q.size(2) == D && k_pool.size(3) == D && q.size(1) % k_pool.size(2) == 0,
              "head_dim 64 and whole GQA groups");
  const int64_t block = k_pool.size(1), len = start + q.size(0);
  TORCH_CHECK(start >= 0 && table.numel() * block >= len, "block table of ", table.numel(),
              " blocks cannot hold ", len, " tokens");
  const int64_t* tb = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (len + block - 1) / block; ++i)
    TORCH_CHECK(tb[i] >= 0 && tb[i] < k_pool.size(0), "block ", tb[i], " outside the pool");
  return prefill(q, k_pool, v_pool, tb, start, scale);
}

// Every prefill piece of a step in one call, each with the bits `paged_prefill` gives it alone.
// q [T, H, D] bf16 (the pieces' rows), pools as `paged_prefill`'s; tables int64 [S, W]: the
// block tables of the step's S contexts (requests), block ids in position order, padded;
// pieces int64 [P, 4]: per piece (its first row in q, its rows, its first position, its
// context's row in `tables`). Returns [T, H, D] bf16; rows no piece covers are left
// uninitialized. Raises (RuntimeError) naming the bad argument.
at::Tensor paged_prefill_pieces(const at::Tensor& q, const at::Tensor& k_pool,
                                const at::Tensor& v_pool, const at::Tensor& tables,
                                const at::Tensor& pieces, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "q [T, H, D], pools [blocks, block, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_pool.scalar_type() == at::kBFloat16 &&
                  v_pool.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(),
              "contiguous q and pools");
  TORCH_CHECK(q.size(2) == D && k_pool.size(3) == D && q.size(1) % k_pool.size(2) == 0,
              "head_dim 64 and whole GQA groups");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong,
              "tables must be a contiguous int64 [S, W] tensor");
  TORCH_CHECK(pieces.dim() == 2 && pieces.size(1) == 4 && pieces.is_contiguous() &&
                  pieces.scalar_type() == at::kLong,
              "pieces must be a contiguous int64 [P, 4] tensor");
  const int64_t block = k_pool.size(1), width = tables.size(1);
  const int64_t* pc4 = pieces.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < pieces.size(0); ++i) {
    const int64_t off = pc4[4 * i], q_len = pc4[4 * i + 1], start = pc4[4 * i + 2],
                  c = pc4[4 * i + 3], len = start + q_len;
    TORCH_CHECK(q_len > 0 && off >= 0 && off + q_len <= q.size(0), "piece ", i, ": rows [", off,
                ", ", off + q_len, ") outside q's ", q.size(0));
    TORCH_CHECK(start >= 0 && c >= 0 && c < tables.size(0), "piece ", i, ": start ", start,
                " or context ", c, " out of range");
    TORCH_CHECK(width * block >= len, "piece ", i, ": block table of ", width, " blocks cannot hold ",
                len, " tokens");
    for (int64_t b = 0; b < (len + block - 1) / block; ++b)
      TORCH_CHECK(tb[c * width + b] >= 0 && tb[c * width + b] < k_pool.size(0), "block ",
                  tb[c * width + b], " outside the pool");
  }
  return prefill_pieces(q, k_pool, v_pool, tables, pieces, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("paged_prefill(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, int start, "
        "float scale) -> Tensor");
  m.def("paged_prefill_pieces(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, "
        "Tensor pieces, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_prefill_pieces", &paged_prefill_pieces);
}

#endif  // GENSERVE_PREFILL_AVX512 || GENSERVE_PREFILL_AVX2
