// y = x @ W^T on CPUs without bf16 arithmetic (AVX2 + FMA, no AVX512): the bf16 weights are
// read as they are (2 bytes each) and widened to fp32 in registers, the sums run on fp32 FMA.
//
// There, oneDNN packs no bf16 weight and torch's bf16 `F.linear` converts both operands on every
// call (4-9x slower than fp32). The engine's fallback keeps fp32 copies of the weights and calls
// the BLAS, which is fast for prefill but reads 4 bytes per weight, so a decode step (bound by
// reading the weights) pays twice the bytes; and the BLAS picks its kernel by shape, so its calls
// must be padded to probed row counts to keep a row's bits independent of the batch. This kernel
// needs neither: it reads the bf16 bytes and its rows are independent of the batch by
// construction.
//
// The arithmetic, per output y[m][n]: acc = 0; for k = 0 .. K-1 in order: acc = fma(x[m][k],
// w[n][k], acc), in fp32 (x and w widened exactly: a bf16 is the top half of an fp32); then one
// rounding to bf16 (round to nearest even, c10::BFloat16). One chain over all of k for every
// output, whatever the row count, the row's position or the tile that computes it: a row's
// result never depends on the batch (tests/engine/test_fma_linear.py checks it bit for bit).
// The error is that of an fp32 dot product summed in order (at most K units of fp32 rounding
// relative to the sum of |x w|, Higham, "Accuracy and Stability of Numerical Algorithms", 3.1),
// far below the final bf16 rounding at the model's K (576, 1,536).
//
// Layout (`engine.model.linear.panel_pack`): W [N, K] bf16 regrouped into panels of 16 output
// columns, each [K][16]: for every k, the 16 columns' weights side by side (32 bytes, two ymm
// once widened). A tile of R rows x P panels keeps R x 2P fp32 accumulators in ymm registers;
// per k it widens 2P weight vectors and broadcasts R inputs: R x 2P FMAs.
//
//   * 6 rows x 1 panel: 12 accumulators, the compute-bound shape (prefill): 12 FMAs per 2
//     widened loads and 6 broadcasts.
//   * 1-2 rows x 4 or 2 panels: 8 accumulators, enough independent FMA chains to hide the FMA
//     latency when a decode step has few rows; bound by reading the weights.
//
// Work: rows in blocks of ROW_BLOCK (their fp32 inputs stay in L2), panels in groups split
// across threads with at::parallel_for; the input is widened to fp32 once per call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t PANEL = 16;        // output columns per panel (two ymm of fp32)
constexpr int64_t ROW_BLOCK = 48;    // rows whose fp32 inputs one pass over the panels reads
constexpr int64_t GROUP = 4;         // panels per unit of parallel work

// 8 bf16 at p, widened to 8 fp32 (exact: shift into the top half).
inline __m256 widen8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// y[r][p*16 + j] for R rows of x (fp32, row stride ldx) and P panels starting at w (panel stride
// panel), rounded to bf16 into y (row stride ldy).
// The loops over rows and panels are unrolled before GCC's scalar replacement (`GCC unroll`), or
// GCC 12 keeps the accumulators in a stack array and stores them on every k.
template <int R, int P>
void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t panel, int64_t k,
          c10::BFloat16* y, int64_t ldy) {
  __m256 acc[R * 2 * P];
  _Pragma("GCC unroll 16") for (int i = 0; i < R * 2 * P; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    __m256 wv[2 * P];
    _Pragma("GCC unroll 8") for (int p = 0; p < P; ++p) {
      const uint16_t* row = w + p * panel + kk * PANEL;
      wv[2 * p] = widen8(row);
      wv[2 * p + 1] = widen8(row + 8);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + kk);
      _Pragma("GCC unroll 8") for (int j = 0; j < 2 * P; ++j)
        acc[r * 2 * P + j] = _mm256_fmadd_ps(xv, wv[j], acc[r * 2 * P + j]);
    }
  }
  alignas(32) float out[R * 2 * P * 8];
  _Pragma("GCC unroll 16") for (int i = 0; i < R * 2 * P; ++i) _mm256_store_ps(out + 8 * i, acc[i]);
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P * 8; ++i) y[r * ldy + i] = c10::BFloat16(out[r * 2 * P * 8 + i]);
}

// R rows (1..6) over P panels, R chosen at run time.
template <int P>
void rows_tile(int rows, const float* x, int64_t ldx, const uint16_t* w, int64_t panel, int64_t k,
               c10::BFloat16* y, int64_t ldy) {
  switch (rows) {
    case 1: return tile<1, P>(x, ldx, w, panel, k, y, ldy);
    case 2: return tile<2, P>(x, ldx, w, panel, k, y, ldy);
    case 3: return tile<3, P>(x, ldx, w, panel, k, y, ldy);
    case 4: return tile<4, P>(x, ldx, w, panel, k, y, ldy);
    case 5: return tile<5, P>(x, ldx, w, panel, k, y, ldy);
    default: return tile<6, P>(x, ldx, w, panel, k, y, ldy);
  }
}

// Rows [0, rows) of one row block over panels [p0, p1): 1 row 4 panels at a time, 2 rows 2 panels,
// else 6-row tiles (and the rest) one panel at a time. Every shape computes each output by the
// same chain (above), so the choice is speed only.
void block(int64_t rows, const float* x, int64_t k, const uint16_t* w, int64_t p0, int64_t p1,
           c10::BFloat16* y, int64_t n) {
  const int64_t panel = k * PANEL;
  int64_t p = p0;
  if (rows == 1) {
    for (; p + 4 <= p1; p += 4) tile<1, 4>(x, k, w + p * panel, panel, k, y + p * PANEL, n);
  } else if (rows == 2) {
    for (; p + 2 <= p1; p += 2) tile<2, 2>(x, k, w + p * panel, panel, k, y + p * PANEL, n);
  }
  for (; p < p1; ++p)
    for (int64_t r = 0; r < rows; r += 6)
      rows_tile<1>(static_cast<int>(std::min<int64_t>(6, rows - r)), x + r * k, k, w + p * panel,
                   panel, k, y + r * n + p * PANEL, n);
}

}  // namespace

namespace genserve {

// x [M, K] bf16 @ W^T, W in panels [N/16, K, 16] bf16 (`engine.model.linear.panel_pack`) →
// [M, N] bf16; see the top of this file. Raises (c10::Error → RuntimeError) on other dtypes or
// shapes.
at::Tensor fma_linear(const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "fma_linear: x must be bf16 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.scalar_type() == at::kBFloat16
                  && panels.is_contiguous(),
              "fma_linear: the weight must be contiguous bf16 panels [N/16, K, 16]");
  const int64_t m = x.size(0), k = x.size(1), n = panels.size(0) * PANEL;
  TORCH_CHECK(panels.size(1) == k, "fma_linear: x has K = ", k, ", the weight ", panels.size(1));
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  // The input widened to fp32 once (exact), so the tiles broadcast from memory.
  const at::Tensor wide = x.contiguous().to(at::kFloat);
  const float* xs = wide.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  c10::BFloat16* ys = y.data_ptr<c10::BFloat16>();
  const int64_t n_panels = n / PANEL, groups = (n_panels + GROUP - 1) / GROUP;
  for (int64_t r = 0; r < m; r += ROW_BLOCK) {
    const int64_t rows = std::min(ROW_BLOCK, m - r);
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      block(rows, xs + r * k, k, w, begin * GROUP, std::min(end * GROUP, n_panels), ys + r * n, n);
    });
  }
  return y;
}

}  // namespace genserve

TORCH_LIBRARY_FRAGMENT(genserve, m) { m.def("fma_linear(Tensor x, Tensor panels) -> Tensor"); }
TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("fma_linear", &genserve::fma_linear); }

#endif  // __AVX2__ && __FMA__
