// A step's LoRA deltas on one fused projection in one call: for every adapter row r of the step,
//
//   y[r, lo:hi] = bf16( y[r, lo:hi] + bf16(x[r] · A_p^T) · B_p^T )   for each part p (lo, hi)
//
// (the shrink rounded to bf16, the expand added to y in fp32 and rounded once)
//
// (gather, shrink, expand and add in place; `engine.model.lora` documents the parts and scales).
// The adapters' matrices are read where they lie, one buffer per adapter (`blob`, bf16) with
// an int64 table (`index`) saying where each fused matrix of each layer is in it:
//
//   index[slot] (slot = 4 · layer + kind, kind 0..3 = wqkv, wo, w13, w2), LORA_SLOT_FIELDS int64:
//     a_off, R, K, parts,              A [R, K] row-major at blob[a_off]; R = 0: no delta here
//     then per part (at most LORA_MAX_PARTS): lo, hi, r_lo, r_hi, b_off
//       output columns [lo, hi) of y take the product through A's rows [r_lo, r_hi) and B_p at
//       blob[b_off]: r_p = r_hi - r_lo, pairs = ceil(r_p / 2); blocks of 64 columns (the last
//       narrower), each [pairs][cols][2] (the VNNI pair order: for each pair of ranks, the
//       block's columns' two weights side by side; an odd rank's last pair holds a zero), so
//       that a block is one contiguous run of bytes.
//
// Only the targeted parts' ranks are stored: no rank padding, and no zero blocks of the fused
// B's block-diagonal layout.
//
// Arithmetic per row, fixed whatever the batch (so a row's bits are those of its row alone):
// the shrink s_j = sum over k of x_k A_jk is one vdpbf16ps chain over k in chunks of 32 (16
// fp32 lanes, each a pair of k) from zero, then the 16 lanes summed by _mm512_reduce_add_ps and
// rounded to bf16 (nearest even); the expand is, per output column, one vdpbf16ps chain over
// the rank pairs from zero, added to y's value in fp32 and rounded to bf16 once. Rows go 4 at a
// time through the same per-row instructions; the column blocks a task covers change nothing
// per column.
//
// The 8-bit format (`engine.model.lora.kernel_tables_q8`; buffers uint8, offsets in bytes): the
// table's fields as above, but each part's own record at b_off (a_off: the first part's record):
//
//   A  [ceil(r_p/16)][K/32][8][16][4] uint8   q + 128 of A_p's rows (16 ranks per group, zero
//                                              ranks past r_p), for each block of 32 k and j,
//                                              the 16 ranks' k = 4j .. 4j + 3
//   a_scale [16 · ceil(r_p/16)] fp32          per rank: A_p[j] ≈ a_scale[j] · q[j]
//   B  [ceil(n/16)][ceil(r_p/4)][16][4] uint8  q + 128 of B_p's rows (the part's n output
//                                              columns, zero past n and past r_p), for each 16
//                                              columns and 4 ranks, the columns' 4 weights
//   b_scale [16 · ceil(n/16)] fp32            per output column
//
// (`q8_part_bytes`; K a multiple of 32). Arithmetic per row, fixed whatever the batch: x rounded
// to int8 per block of 32 as the 8-bit base products round it (q8_rows.h), once per call or by
// the caller for its own product too (`rounded`, decode_layers.cpp); the shrink's int32 dot per
// block (vpdpbusd of q + 128 against x's int8, less 128 · Σ x's int8), times the block's
// scale, summed over the blocks in order in fp32, times the rank's scale; those r_p values
// rounded to int8 with one scale (max / 127); the expand's int32 dot per column over the ranks
// (likewise), times (that scale · the column's scale), added to y in fp32 and rounded to bf16
// once. This is llama.cpp's kind of arithmetic (8-bit blocks, an int32 dot, fp32 scales), for a
// model whose block products already run it (`q4q8`); the bf16 format keeps the adapters' bf16
// values.
//
// Work: tasks (adapter, part, column block of the part) shared by the threads
// (at::parallel_for); each computes its rows' shrink of its part (a few µs of arithmetic for
// r_p · K values per row) and expands its columns. A part is split into column blocks only when
// the step has fewer (adapter, part) pairs than twice the threads (few adapters, few rows), so
// the shrink is not repeated where there is enough other work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "genserve_ops.h"

#ifdef GENSERVE_LORA_DELTA

#include "prefetch.h"
#include "q8_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int TILE = 4;          // rows per pass
constexpr int VECS = 4;          // 16-column vectors per pass of the expand
constexpr int64_t COLS = 16 * VECS;

// Software prefetch running PREFETCH_AHEAD bytes ahead of a task's reads, over its two runs
// of bytes (its rows of A, then its blocks of B): at one row the arithmetic between two lines is
// too short for the hardware's prefetchers to hide the memory's latency.
constexpr int64_t PREFETCH_AHEAD = 4096;
struct Cursor {
  const char* run[2];
  int64_t size[2];
  int64_t done = 0, fetched = 0;     // bytes read, bytes prefetched, of both runs
  void advance(int64_t bytes) {
    done += bytes;
    for (; fetched < done + PREFETCH_AHEAD && fetched < size[0] + size[1]; fetched += 64)
      genserve::prefetch_l1(fetched < size[0] ? run[0] + fetched : run[1] + (fetched - size[0]));
  }
};

struct Part {
  int64_t lo, hi, r_lo, r_hi, b_off;
};

struct Task {
  int64_t group;
  const uint16_t* a;      // bf16: the adapter's A, [R, K]
  const uint16_t* b;      // bf16: the part's B, blocks of 64 columns [pairs][cols][2]
  const uint8_t* record;  // 8-bit: the part's record
  int64_t lo, n, r_lo, rank, c0, c1;   // part columns [lo, lo + n), its rank, task columns [c0, c1) of the part
};

// out[0:16] = bf16(out + v) for the lanes of `m` (nearest even), the others left as they are. A
// whole vector takes plain loads and stores, since masked stores are slow on AMD's Zen 4.
inline void add_to_bf16(c10::BFloat16* out, __mmask16 m, __m512 v) {
  if (m == __mmask16(0xFFFF)) {
    const __m256i old = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out));
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(sum));
    return;
  }
  const __m256i old = _mm256_maskz_loadu_epi16(m, out);
  const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), v);
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(sum));
}

// bf16 bits, rounded to nearest even (NaN kept a NaN).
inline uint16_t round_bf16(float f) { return c10::BFloat16(f).x; }

// s[t][j] (bf16 bits) = bf16(x_t · a_j) for `T` rows and `J` consecutive rows j of A.
template <int T, int J>
void shrink_rows(const uint16_t* const* x, const uint16_t* a, int64_t k, uint16_t* s, int64_t s_stride,
                 Cursor& cursor) {
  __m512 acc[T][J];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) acc[t][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 32) {
    cursor.advance(J * 64);
    const __mmask32 m = k - c >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - c)) - 1;
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, a + j * k + c);
    for (int t = 0; t < T; ++t) {
      const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + c);
      for (int j = 0; j < J; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], v, w[j]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) s[t * s_stride + j] = round_bf16(_mm512_reduce_add_ps(acc[t][j]));
}

// The shrink of `rank` rows of A, 4 at a time.
template <int T>
void shrink(const uint16_t* const* x, const uint16_t* a, int64_t k, int64_t rank, uint16_t* s,
            int64_t s_stride, Cursor& cursor) {
  int64_t j = 0;
  for (; j + 4 <= rank; j += 4) shrink_rows<T, 4>(x, a + j * k, k, s + j, s_stride, cursor);
  switch (rank - j) {
    case 3: shrink_rows<T, 3>(x, a + j * k, k, s + j, s_stride, cursor); break;
    case 2: shrink_rows<T, 2>(x, a + j * k, k, s + j, s_stride, cursor); break;
    case 1: shrink_rows<T, 1>(x, a + j * k, k, s + j, s_stride, cursor); break;
    default: break;
  }
}

// y_t[c0:c1] += bf16(s_t · B^T) for `T` rows: B in blocks of 64 columns (the last of the part
// narrower), each [pairs][cols][2]; c0 a multiple of 64, c1 one or the part's end; s_t `pairs`
// bf16 pairs.
template <int T>
void expand(const uint32_t* s, int64_t pairs, const uint16_t* b, int64_t c0, int64_t c1,
            c10::BFloat16* const* y, Cursor& cursor) {
  for (int64_t c = c0; c < c1; c += COLS) {
    const int64_t cols = std::min(COLS, c1 - c);
    const uint16_t* block = b + c * pairs * 2;
    __mmask16 m[VECS];
    for (int v = 0; v < VECS; ++v) {
      const int64_t left = cols - 16 * v;
      m[v] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    }
    __m512 acc[T][VECS];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < VECS; ++v) acc[t][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      cursor.advance(cols * 4);
      __m512bh w[VECS];
      for (int v = 0; v < VECS; ++v)
        w[v] = (__m512bh)_mm512_maskz_loadu_epi32(m[v], block + (p * cols + 16 * v) * 2);
      for (int t = 0; t < T; ++t) {
        const __m512bh sv = (__m512bh)_mm512_set1_epi32(static_cast<int>(s[t * pairs + p]));
        for (int v = 0; v < VECS; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], sv, w[v]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < VECS; ++v) {
        if (m[v] == 0) continue;
        add_to_bf16(y[t] + c + 16 * v, m[v], acc[t][v]);
      }
  }
}

// One task's rows `rows` (indices into x and y), `T` at a time.
template <int T>
void run_rows(const Task& task, const int64_t* rows, const uint16_t* x, int64_t x_stride, int64_t k,
              c10::BFloat16* y, int64_t y_stride) {
  const uint16_t* xr[T];
  c10::BFloat16* yr[T];
  for (int t = 0; t < T; ++t) {
    xr[t] = x + rows[t] * x_stride;
    yr[t] = y + rows[t] * y_stride + task.lo;
  }
  const int64_t pairs = (task.rank + 1) / 2;
  uint16_t s[T * 2 * 64];          // ranks up to 128 per part
  for (int t = 0; t < T; ++t) s[t * 2 * pairs + 2 * pairs - 1] = 0;     // an odd rank's zero
  const uint16_t* a = task.a + task.r_lo * k;
  const uint16_t* b = task.b + task.c0 * pairs * 2;
  Cursor cursor{{reinterpret_cast<const char*>(a), reinterpret_cast<const char*>(b)},
                {task.rank * k * 2, (task.c1 - task.c0) * pairs * 4}};
  cursor.advance(0);
  shrink<T>(xr, a, k, task.rank, s, 2 * pairs, cursor);
  expand<T>(reinterpret_cast<const uint32_t*>(s), pairs, task.b, task.c0, task.c1, yr, cursor);
}

// ---- The 8-bit format ----

constexpr int64_t Q8_BLOCK = 32;       // k per block of x's and A's int8 values

// Bytes of one part's record (the 8-bit format above): rank r_p, K = k, n output columns.
int64_t q8_part_bytes(int64_t rank, int64_t k, int64_t n) {
  const int64_t r16 = (rank + 15) / 16 * 16, r4 = (rank + 3) / 4 * 4, n16 = (n + 15) / 16 * 16;
  return r16 / 16 * (k / Q8_BLOCK) * 512 + r16 * 4 + n16 / 16 * (r4 / 4) * 64 + n16 * 4;
}

// `T` rows (`rows`: indices into x and y; `xr` holds them rounded) of one task: the part's
// shrink, its rounding to int8, and the expand of the task's columns into y.
template <int T>
void q8_run_rows(const Task& task, const int64_t* rows, const genserve::Q8Rows& xr, int64_t k,
                 c10::BFloat16* y, int64_t y_stride) {
  const int64_t kb = k / Q8_BLOCK, rank = task.rank;
  const int64_t r16 = (rank + 15) / 16 * 16, r4 = (rank + 3) / 4 * 4;
  const uint8_t* a = task.record;
  const float* a_scale = reinterpret_cast<const float*>(a + r16 / 16 * kb * 512);
  const uint8_t* b = reinterpret_cast<const uint8_t*>(a_scale + r16);
  const float* b_scale = reinterpret_cast<const float*>(b + (task.n + 15) / 16 * (r4 / 4) * 64);
  Cursor cursor{{reinterpret_cast<const char*>(a), nullptr},
                {q8_part_bytes(rank, k, task.n), 0}};
  cursor.advance(0);
  const int8_t* xq[T];
  const float* xs[T];
  const int32_t* xsum[T];
  for (int t = 0; t < T; ++t) {
    xq[t] = xr.q_row(rows[t]);
    xs[t] = xr.scale_row(rows[t]);
    xsum[t] = xr.isum_row(rows[t]);
  }
  // The shrink: s[t][j] for the part's ranks (16 per vector).
  alignas(64) float s[T][128];
  for (int64_t c = 0; c < r16 / 16; ++c) {
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < kb; ++blk) {
      const uint8_t* w = a + (c * kb + blk) * 512;
      cursor.advance(512);
      __m512i ia[T];
      for (int t = 0; t < T; ++t) ia[t] = _mm512_set1_epi32(-128 * xsum[t][blk]);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i wv = _mm512_loadu_si512(w + 64 * j);
        for (int t = 0; t < T; ++t)
          ia[t] = _mm512_dpbusd_epi32(
              ia[t], wv, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq[t] + blk * Q8_BLOCK + 4 * j)));
      }
      for (int t = 0; t < T; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_set1_ps(xs[t][blk]), acc[t]);
    }
    const __m512 sc = _mm512_loadu_ps(a_scale + 16 * c);
    for (int t = 0; t < T; ++t) _mm512_store_ps(s[t] + 16 * c, _mm512_mul_ps(acc[t], sc));
  }
  // s rounded to int8, one scale per row (ranks past r_p are zero and stay zero).
  alignas(64) int8_t sq[T][128];
  float ss[T];
  int32_t ssum[T];
  for (int t = 0; t < T; ++t) {
    float amax = 0.0f;
    for (int64_t j = 0; j < rank; ++j) amax = std::max(amax, std::fabs(s[t][j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    ss[t] = amax / 127.0f;
    ssum[t] = 0;
    for (int64_t j = 0; j < r4; ++j) {
      const int32_t v = j < rank ? static_cast<int32_t>(std::nearbyint(s[t][j] * inv)) : 0;
      sq[t][j] = static_cast<int8_t>(v);
      ssum[t] += v;
    }
  }
  // The expand, 16 columns at a time.
  c10::BFloat16* yr[T];
  for (int t = 0; t < T; ++t) yr[t] = y + rows[t] * y_stride + task.lo;
  for (int64_t c = task.c0; c < task.c1; c += 16) {
    const uint8_t* w = b + (c / 16) * (r4 / 4) * 64;
    __m512i ia[T];
    for (int t = 0; t < T; ++t) ia[t] = _mm512_set1_epi32(-128 * ssum[t]);
    for (int64_t g = 0; g < r4 / 4; ++g) {
      const __m512i wv = _mm512_loadu_si512(w + 64 * g);
      for (int t = 0; t < T; ++t)
        ia[t] = _mm512_dpbusd_epi32(ia[t], wv, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(sq[t] + 4 * g)));
    }
    const int64_t cols = std::min<int64_t>(16, task.c1 - c);
    const __mmask16 m = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 bs = _mm512_loadu_ps(b_scale + c);
    for (int t = 0; t < T; ++t) {
      const __m512 delta = _mm512_mul_ps(_mm512_cvtepi32_ps(ia[t]), _mm512_mul_ps(_mm512_set1_ps(ss[t]), bs));
      add_to_bf16(yr[t] + c, m, delta);
    }
  }
}

// The 8-bit format's tasks: the call's adapter rows rounded once (or `rounded`: all of x's rows,
// rounded by the caller the same way), then every task's rows, `TILE` at a time. offsets: the
// groups' positions in `row`.
void lora_delta_q8(const std::vector<Task>& tasks, at::IntArrayRef offsets, const int64_t* row,
                   const at::Tensor& x, int64_t k, const at::Tensor& y, const genserve::Q8Rows* rounded) {
  const int64_t m = offsets.back(), kb = k / Q8_BLOCK;
  std::optional<genserve::Q8Rows> own;
  if (rounded == nullptr) {
    own.emplace(x.size(0), k);
    const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const int64_t x_stride = x.stride(0);
    at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = row[i];
        genserve::round_row_q8(xs + r * x_stride, k, own->xq.get() + r * k, own->scale.get() + r * kb,
                               own->xsum.get() + r * kb, own->isum.get() + r * kb);
      }
    });
  }
  const genserve::Q8Rows& xr = rounded != nullptr ? *rounded : *own;
  auto* ys = y.data_ptr<c10::BFloat16>();
  const int64_t y_stride = y.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t first = offsets[task.group], last = offsets[task.group + 1];
      for (int64_t r = first; r < last; r += TILE) {
        switch (std::min<int64_t>(TILE, last - r)) {
          case 4: q8_run_rows<4>(task, row + r, xr, k, ys, y_stride); break;
          case 3: q8_run_rows<3>(task, row + r, xr, k, ys, y_stride); break;
          case 2: q8_run_rows<2>(task, row + r, xr, k, ys, y_stride); break;
          default: q8_run_rows<1>(task, row + r, xr, k, ys, y_stride); break;
        }
      }
    }
  });
}

}  // namespace

namespace genserve {

// y [T, N] bf16 (rows contiguous; updated in place) += each adapter row's delta of fused matrix
// `slot` (4 · layer + kind), from x [T, K] bf16 (rows contiguous). rows: int64 [M], the adapter
// rows, grouped; group g = rows[offsets[g]:offsets[g + 1]] runs on the adapter whose buffer is
// blobs[g] (1-D: bf16 for the bf16 format, uint8 for the 8-bit one; one format for all groups)
// and table index[g] (int64 [S, LORA_SLOT_FIELDS], the layouts above); a slot >= S or with R = 0
// leaves the group's rows as they are. Raises (RuntimeError) on other dtypes or shapes, buffers
// of both formats, a table entry outside its buffer or not matching x and y, a part rank above
// 128, K not a multiple of 32 (8-bit format), or a row outside [0, T).
void lora_delta_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                 at::IntArrayRef offsets, at::TensorList blobs, at::TensorList index, int64_t slot,
                 const Q8Rows* rounded) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.scalar_type() == at::kBFloat16 &&
                  x.scalar_type() == at::kBFloat16 && y.stride(1) == 1 && x.stride(1) == 1 &&
                  x.size(0) == y.size(0),
              "lora_delta_: y [T, N] and x [T, K] must be bf16 with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "lora_delta_: rows must be a contiguous int64 [M] tensor");
  const int64_t groups = static_cast<int64_t>(blobs.size());
  TORCH_CHECK(static_cast<int64_t>(index.size()) == groups &&
                  static_cast<int64_t>(offsets.size()) == groups + 1 && offsets[0] == 0 &&
                  offsets[groups] == rows.numel(),
              "lora_delta_: one buffer and one table per group, groups + 1 offsets from 0 to M");
  const int64_t t_rows = x.size(0), k = x.size(1), n_out = y.size(1);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < t_rows, "lora_delta_: row ", row[i], " outside [0, ", t_rows, ")");
  std::vector<Part> parts;
  std::vector<Task> tasks;
  std::vector<int64_t> task_parts;         // per (group, part) pair: its index in `parts`
  std::vector<std::pair<int64_t, const uint16_t*>> pair_group;   // per pair: group, blob
  const bool q8 = groups > 0 && blobs[0].scalar_type() == at::kByte;
  const at::ScalarType blob_type = q8 ? at::kByte : at::kBFloat16;
  TORCH_CHECK(!q8 || k % Q8_BLOCK == 0, "lora_delta_: the 8-bit format needs K a multiple of ",
              Q8_BLOCK, ", got ", k);
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(offsets[g] <= offsets[g + 1], "lora_delta_: offsets must not decrease");
    const at::Tensor& table = index[g];
    const at::Tensor& blob = blobs[g];
    TORCH_CHECK(table.dim() == 2 && table.size(1) == LORA_SLOT_FIELDS && table.scalar_type() == at::kLong &&
                    table.is_contiguous() && blob.dim() == 1 && blob.scalar_type() == blob_type &&
                    blob.is_contiguous(),
                "lora_delta_: each table must be int64 [S, ", LORA_SLOT_FIELDS, "] and each buffer 1-D, "
                "all bf16 or all uint8");
    TORCH_CHECK(slot >= 0, "lora_delta_: slot must be >= 0, got ", slot);
    if (offsets[g] == offsets[g + 1] || slot >= table.size(0)) continue;
    const int64_t* e = table.data_ptr<int64_t>() + slot * LORA_SLOT_FIELDS;
    const int64_t a_off = e[0], rank = e[1], width = e[2], count = e[3];
    if (rank == 0) continue;
    const int64_t size = blob.numel();
    TORCH_CHECK(width == k && a_off >= 0 && (q8 || a_off + rank * k <= size) && count >= 1 &&
                    count <= LORA_MAX_PARTS,
                "lora_delta_: slot ", slot, " of group ", g, " holds A [", rank, ", ", width,
                "] at ", a_off, " in ", count, " parts; x has K = ", k, ", the buffer ", size, " values");
    for (int64_t p = 0; p < count; ++p) {
      const int64_t* f = e + 4 + 5 * p;
      const Part part{f[0], f[1], f[2], f[3], f[4]};
      const int64_t r_p = part.r_hi - part.r_lo;
      TORCH_CHECK(part.lo >= 0 && part.lo < part.hi && part.hi <= n_out && part.r_lo >= 0 &&
                      r_p >= 1 && r_p <= 128 && part.r_hi <= rank && part.b_off >= 0 &&
                      part.b_off + (q8 ? q8_part_bytes(r_p, k, part.hi - part.lo)
                                       : (r_p + 1) / 2 * 2 * (part.hi - part.lo)) <= size,
                  "lora_delta_: slot ", slot, " of group ", g, ", part ", p, " does not fit y [",
                  t_rows, ", ", n_out, "], its rank ", rank, " (at most 128 per part) or its buffer");
      parts.push_back(part);
      pair_group.emplace_back(g, reinterpret_cast<const uint16_t*>(blob.data_ptr()));
    }
  }
  if (parts.empty()) return;
  // Column blocks per part: 1 with enough (group, part) pairs for the threads, else enough to
  // give every thread two tasks.
  const int64_t pairs = static_cast<int64_t>(parts.size());
  const int64_t want = 2 * at::get_num_threads();
  const int64_t split = pairs >= want ? 1 : (want + pairs - 1) / pairs;
  for (int64_t i = 0; i < pairs; ++i) {
    const Part& p = parts[i];
    const auto [g, blob] = pair_group[i];
    const int64_t n = p.hi - p.lo;
    const int64_t step = std::max<int64_t>(COLS, ((n + split - 1) / split + COLS - 1) / COLS * COLS);
    const int64_t a_off = index[g].data_ptr<int64_t>()[slot * LORA_SLOT_FIELDS];
    for (int64_t c0 = 0; c0 < n; c0 += step) {
      if (q8)
        tasks.push_back({g, nullptr, nullptr, reinterpret_cast<const uint8_t*>(blob) + p.b_off, p.lo, n,
                         p.r_lo, p.r_hi - p.r_lo, c0, std::min(n, c0 + step)});
      else
        tasks.push_back({g, blob + a_off, blob + p.b_off, nullptr, p.lo, n, p.r_lo, p.r_hi - p.r_lo,
                         c0, std::min(n, c0 + step)});
    }
  }
  if (q8) {
    TORCH_CHECK(rounded == nullptr || rounded->k == k, "lora_delta_: rounded rows of another K");
    lora_delta_q8(tasks, offsets, row, x, k, y, rounded);
    return;
  }
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* ys = y.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t first = offsets[task.group], last = offsets[task.group + 1];
      int64_t r = first;
      for (; r + TILE <= last; r += TILE) run_rows<TILE>(task, row + r, xs, x_stride, k, ys, y_stride);
      switch (last - r) {
        case 3: run_rows<3>(task, row + r, xs, x_stride, k, ys, y_stride); break;
        case 2: run_rows<2>(task, row + r, xs, x_stride, k, ys, y_stride); break;
        case 1: run_rows<1>(task, row + r, xs, x_stride, k, ys, y_stride); break;
        default: break;
      }
    }
  });
}

}  // namespace genserve

namespace {
at::Tensor lora_delta_op(at::Tensor y, const at::Tensor& x, const at::Tensor& rows, at::IntArrayRef offsets,
                         at::TensorList blobs, at::TensorList index, int64_t slot) {
  genserve::lora_delta_(y, x, rows, offsets, blobs, index, slot);
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("lora_delta_(Tensor(a!) y, Tensor x, Tensor rows, int[] offsets, Tensor[] blobs, "
        "Tensor[] index, int slot) -> Tensor(a!)");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("lora_delta_", &lora_delta_op); }

#endif  // GENSERVE_LORA_DELTA
