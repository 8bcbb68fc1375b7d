// y = x @ W^T for a few rows, read straight from oneDNN's packed copy of W, with oneDNN's bits.
//
// A decode step multiplies a handful of rows by every weight matrix, so it is bound by reading
// the weights. oneDNN's bf16 kernel (brg_matmul:avx512_core_bf16) streams them at ≈ 45 GB/s at
// M = 2 on the dev machine (2-core EPYC, read bandwidth ≈ 83 GB/s), and takes a different,
// differently rounded kernel at M = 1, which `linear.linear` avoids by doubling the row. This
// kernel streams the same packed bytes at ≈ 70 GB/s for one row (SmolLM2-135M's block matrices:
// 3.0 ms against 5.7–6.7 ms) and stays faster than oneDNN up to a few hundred rows (32 rows:
// ≈ 900 GFLOP/s on cached weights against oneDNN's 580–830; see linear.PACKED_LINEAR_MAX_ROWS),
// and it rounds exactly as oneDNN does, so it can replace oneDNN for any row count without
// changing a bit:
//
//   * the packed layout is oneDNN's AB16b64a2b for [N, K]: blocks of 64 output columns, each
//     [K/2][64][2] — for every pair of k, the 64 columns' two weights side by side, the vdpbf16ps
//     ("VNNI") order. One zmm is 16 columns × one k pair.
//   * oneDNN sums k in chunks of `k_chunk` (512 for K = 576, 1024 for K = 1536 here): each
//     chunk is one chain of vdpbf16ps from zero, k pairs in order, and the chunks' sums are
//     added in order; the result is rounded to bf16 once (vcvtneps2bf16, round to nearest even).
//     This kernel does the same operations in the same order, so every output is the same bits.
//
// `k_chunk` and the layout are not documented oneDNN behaviour: `engine.model.linear` finds the
// chunk by comparing this kernel with oneDNN on random rows. Where oneDNN picks another layout,
// or its own rows depend on the batch, genserve packs the weight itself in this layout and runs
// every product here (see `engine.model.linear.pack_model`).
//
// Each row is computed alone (its chains never mix with another row's), so a row's bits do not
// depend on the batch. Work: blocks of 64 columns split across threads (at::parallel_for); in a
// block, rows go 6 at a time (24 accumulators + 4 weight registers of the 32 zmm); with 12 or
// more rows each pass also prefetches part of the thread's next block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

#include <immintrin.h>

#include "prefetch.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 64;       // output columns per packed block
constexpr int64_t BLOCK_K = 32;       // k per packed block
constexpr int COLS = BLOCK_N / 16;    // zmm registers per block row (16 fp32 columns each)
constexpr int ROWS = 6;               // rows per pass over a block
// From this many rows on (two full passes per block), the passes prefetch the thread's next
// block, which is otherwise read from memory by the first pass alone. SmolLM2's 30 layers +
// output projection, A/B in one run: 32 rows 13.0 -> 10.5 ms, 16 rows 8.3 -> 6.3, 12 rows
// 6.9 -> 6.0; with fewer rows the products are memory-bound and a prefetching second pass of 1-2
// rows only competed with the first (8 rows: 5.8 -> 6.5 ms), so they leave it to the hardware.
constexpr int64_t PREFETCH_MIN_ROWS = 2 * ROWS;

// Where a pass over a block prefetches rows of the thread's next block: rows first, first + step,
// ... of it (the row groups of a block take turns, so the next block is fetched once, spread
// over the passes), or nothing.
struct Prefetch {
  const char* next = nullptr;   // the next block's bytes, or nullptr
  int64_t first = 0, step = 1;
};

// `R` rows of x (bf16 pairs, `kp` per row) times one packed block [kp][64][2] -> y[R][64].
template <int R>
void block_rows(const uint32_t* x, const uint16_t* block, int64_t kp, int64_t chunk_pairs,
                c10::BFloat16* y, int64_t y_stride, const Prefetch& pf) {
  __m512 total[R][COLS];
  for (int64_t c0 = 0; c0 < kp; c0 += chunk_pairs) {
    __m512 acc[R][COLS];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t c1 = std::min(kp, c0 + chunk_pairs);
    int64_t next_pf = c0 + ((pf.first - c0) % pf.step + pf.step) % pf.step;   // first >= c0
    for (int64_t j = c0; j < c1; ++j) {
      const uint16_t* w_row = block + j * BLOCK_N * 2;
      if (pf.next != nullptr && j == next_pf) {
        for (int c = 0; c < COLS; ++c)
          genserve::prefetch_l1(pf.next + (j * BLOCK_N * 2 + c * 32) * 2);
        next_pf += pf.step;
      }
      __m512bh w[COLS];
      for (int c = 0; c < COLS; ++c) w[c] = (__m512bh)_mm512_loadu_si512(w_row + c * 32);
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp + j]));
        for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, w[c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < COLS; ++c)
        total[r][c] = c0 == 0 ? acc[r][c] : _mm512_add_ps(total[r][c], acc[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLS; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(total[r][c]));
}

template <int R>
void block_rows_upto(int rows, const uint32_t* x, const uint16_t* block, int64_t kp,
                     int64_t chunk_pairs, c10::BFloat16* y, int64_t y_stride, const Prefetch& pf) {
  if constexpr (R > 1) {
    if (rows < R) return block_rows_upto<R - 1>(rows, x, block, kp, chunk_pairs, y, y_stride, pf);
  }
  block_rows<R>(x, block, kp, chunk_pairs, y, y_stride, pf);
}

// Raw bytes of the packed weight: an opaque oneDNN tensor (torch's own mkldnn::data_ptr and
// mkldnn::_nbytes), or a dense bf16 tensor holding the same layout (`linear.vnni_pack`).
const uint16_t* packed_bytes(const at::Tensor& packed, int64_t expect_bytes) {
  if (!packed.is_mkldnn()) {
    TORCH_CHECK(packed.is_contiguous() && packed.numel() * 2 == expect_bytes,
                "packed_linear: a dense packed weight must be contiguous [N, K]");
    return reinterpret_cast<const uint16_t*>(packed.data_ptr());
  }
  static const auto data_ptr = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("mkldnn::data_ptr", "")
                                   .typed<int64_t(const at::Tensor&)>();
  static const auto nbytes = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("mkldnn::_nbytes", "")
                                 .typed<int64_t(const at::Tensor&)>();
  TORCH_CHECK(nbytes.call(packed) == expect_bytes, "packed_linear: packed weight holds ",
              nbytes.call(packed), " bytes, expected ", expect_bytes, " (padded layout?)");
  return reinterpret_cast<const uint16_t*>(data_ptr.call(packed));
}

}  // namespace

namespace genserve {

// x: bf16 [M, K] contiguous; packed: a bf16 W [N, K] in layout AB16b64a2b (N % 64 == 0,
// K % 32 == 0), either `torch.ops.mkldnn._reorder_linear_weight(W, ...)` where oneDNN chose that
// layout, or a dense tensor genserve packed itself (`engine.model.linear.vnni_pack`); k_chunk:
// the k chunk (even, > 0). Returns bf16 [M, N], equal bit for bit to oneDNN's product when layout
// and k_chunk are oneDNN's. Raises (RuntimeError) on another dtype, shape or a padded weight.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t k_chunk) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "packed_linear: x must be a contiguous bf16 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16,
              "packed_linear: packed must be a bf16 [N, K] weight");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "packed_linear: x has K = ", k, ", weight ", packed.size(1));
  TORCH_CHECK(n % BLOCK_N == 0 && k % BLOCK_K == 0, "packed_linear: N must be a multiple of ",
              BLOCK_N, " and K of ", BLOCK_K, ", got N = ", n, ", K = ", k);
  TORCH_CHECK(k_chunk > 0 && k_chunk % 2 == 0, "packed_linear: k_chunk must be even and > 0");
  const uint16_t* w = packed_bytes(packed, n * k * 2);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t kp = k / 2, chunk_pairs = k_chunk / 2;
  const int64_t groups = (m + ROWS - 1) / ROWS;
  at::parallel_for(0, n / BLOCK_N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint16_t* block = w + b * kp * BLOCK_N * 2;
      for (int64_t r = 0; r < m; r += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, m - r));
        Prefetch pf;
        if (m >= PREFETCH_MIN_ROWS && b + 1 < end)
          pf = {reinterpret_cast<const char*>(block + kp * BLOCK_N * 2), r / ROWS, groups};
        block_rows_upto<ROWS>(rows, xs + r * kp, block, kp, chunk_pairs, ys + r * n + b * BLOCK_N,
                              n, pf);
      }
    }
  });
  return y;
}

// The products of several weights over consecutive row groups of x in one call (a mixture of
// experts' step: the rows that chose expert g times expert g's matrix, for every chosen expert).
// x: bf16 [M, K] contiguous, group g's rows at [offsets[g], offsets[g + 1]); packed[g], k_chunks[g]:
// group g's weight and chunk as for `packed_linear`, every weight [N, K]. Returns bf16 [M, N]; each
// row is exactly `packed_linear(its row, packed[g], k_chunks[g])` (the same block passes), while the
// threads share every (group, block of 64 columns) pair of the call, so a step of one row per
// expert keeps both cores busy where one call per expert would hand each only its blocks.
at::Tensor packed_linear_grouped(const at::Tensor& x, at::TensorList packed, at::IntArrayRef offsets,
                                 at::IntArrayRef k_chunks) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "packed_linear_grouped: x must be a contiguous bf16 [M, K] tensor");
  const int64_t groups = static_cast<int64_t>(packed.size());
  TORCH_CHECK(groups > 0 && static_cast<int64_t>(offsets.size()) == groups + 1 &&
                  static_cast<int64_t>(k_chunks.size()) == groups,
              "packed_linear_grouped: one weight and one k_chunk per group, groups + 1 offsets");
  const int64_t m = x.size(0), k = x.size(1), n = packed[0].size(0);
  TORCH_CHECK(offsets[0] == 0 && offsets[groups] == m, "packed_linear_grouped: offsets must run from 0 to M");
  std::vector<const uint16_t*> weights(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& w = packed[g];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) == n && w.size(1) == k,
                "packed_linear_grouped: every weight must be bf16 [", n, ", ", k, "]");
    TORCH_CHECK(offsets[g] <= offsets[g + 1], "packed_linear_grouped: offsets must not decrease");
    TORCH_CHECK(k_chunks[g] > 0 && k_chunks[g] % 2 == 0, "packed_linear_grouped: k_chunk must be even and > 0");
    weights[g] = packed_bytes(w, n * k * 2);
  }
  TORCH_CHECK(n % BLOCK_N == 0 && k % BLOCK_K == 0, "packed_linear_grouped: N must be a multiple of ",
              BLOCK_N, " and K of ", BLOCK_K, ", got N = ", n, ", K = ", k);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t kp = k / 2, blocks = n / BLOCK_N;
  std::vector<int64_t> busy;                    // the groups with rows, in order
  for (int64_t g = 0; g < groups; ++g)
    if (offsets[g + 1] > offsets[g]) busy.push_back(g);
  const int64_t items = static_cast<int64_t>(busy.size()) * blocks;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = busy[item / blocks], b = item % blocks;
      const uint16_t* block = weights[g] + b * kp * BLOCK_N * 2;
      const int64_t chunk_pairs = k_chunks[g] / 2;
      for (int64_t r = offsets[g]; r < offsets[g + 1]; r += ROWS) {
        const int rows = static_cast<int>(std::min<int64_t>(ROWS, offsets[g + 1] - r));
        block_rows_upto<ROWS>(rows, xs + r * kp, block, kp, chunk_pairs, ys + r * n + b * BLOCK_N,
                              n, Prefetch{});
      }
    }
  });
  return y;
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int k_chunk) -> Tensor");
  m.def("packed_linear_grouped(Tensor x, Tensor[] packed, int[] offsets, int[] k_chunks) -> Tensor");
}
TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("packed_linear", &genserve::packed_linear);
  m.impl("packed_linear_grouped", &genserve::packed_linear_grouped);
}
// The packed weight is a oneDNN (MkldnnCPU) tensor, whose dispatch key wins over CPU's.
TORCH_LIBRARY_IMPL(genserve, MkldnnCPU, m) {
  m.impl("packed_linear", &genserve::packed_linear);
  m.impl("packed_linear_grouped", &genserve::packed_linear_grouped);
}

#endif  // __AVX512BF16__ && __AVX512BW__
