// The host's own rate for one vector instruction, per thread: `benchmarks.unit_rate` builds this
// file as `torch.ops.genserve_unit_rate.instruction_rate` to find the ceiling the 8-bit and bf16
// products are measured against, on the same cores in the same run (this machine's speed moves by
// up to 2x between hours, so a figure from a data sheet or another day is no ceiling).
//
// Each thread runs `iters` times 12 independent instructions, one per accumulator (12 chains: the
// 4-5-cycle latency of a multiply-accumulate needs about 8 in flight to keep one unit busy), with
// the accumulators in 12 named registers: in an array GCC kept them on the stack (a load and a
// store around every instruction, half the rate).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <chrono>
#include <string>

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define UNIT_RATE_AVX512 1
#endif

namespace genserve_unit_rate {

#ifdef UNIT_RATE_AVX512
#define UR_EACH(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)

// Seconds this thread takes for iters x 12 instructions of `kind`.
double run_one(int kind, int64_t iters) {
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
#define UR_INIT(i) __m512i a##i = _mm512_set1_epi32(i);
  UR_EACH(UR_INIT)
  const auto start = std::chrono::steady_clock::now();
  if (kind == 0) {
    for (int64_t it = 0; it < iters; ++it) {
#define UR_VNNI(i) a##i = _mm512_dpbusd_epi32(a##i, w, x);
      UR_EACH(UR_VNNI)
    }
  } else if (kind == 1) {
    for (int64_t it = 0; it < iters; ++it) {
#define UR_BF16(i) \
  a##i = _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(a##i), (__m512bh)w, (__m512bh)x));
      UR_EACH(UR_BF16)
    }
  } else if (kind == 2) {
    for (int64_t it = 0; it < iters; ++it) {
#define UR_FMA(i)                                                                          \
  a##i = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(a##i), _mm512_castsi512_ps(w), \
                                             _mm512_castsi512_ps(x)));
      UR_EACH(UR_FMA)
    }
  } else {
    // 8 vpdpbusd beside 4 vfmadd231ps, each on its own chain
    for (int64_t it = 0; it < iters; ++it) {
      UR_VNNI(0) UR_VNNI(1) UR_VNNI(2) UR_VNNI(3) UR_VNNI(4) UR_VNNI(5) UR_VNNI(6) UR_VNNI(7)
      UR_FMA(8) UR_FMA(9) UR_FMA(10) UR_FMA(11)
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Keep every chain's result alive.
#define UR_SUM(i) +_mm512_reduce_add_epi32(a##i)
  volatile int sink = 0 UR_EACH(UR_SUM);
  (void)sink;
  return seconds;
}
#endif

// kind: "vpdpbusd" (64 int8 multiply-adds an instruction), "vdpbf16ps" (32 bf16 ones), "vfmadd"
// (vfmadd231ps zmm, 16 fp32 ones) or "mix" (8 vpdpbusd beside 4 vfmadd231ps: whether the two
// share the host's units). Returns float64 [threads]: each of torch's threads' instructions per
// second (for "mix", its vpdpbusd alone), all threads running at once.
at::Tensor instruction_rate(const std::string& kind, int64_t iters) {
#ifdef UNIT_RATE_AVX512
  const int code = kind == "vpdpbusd" ? 0 : kind == "vdpbf16ps" ? 1 : kind == "vfmadd" ? 2
                   : kind == "mix"      ? 3 : -1;
  TORCH_CHECK(code >= 0, "instruction_rate: kind must be vpdpbusd, vdpbf16ps, vfmadd or mix, got ", kind);
  TORCH_CHECK(iters >= 1, "instruction_rate: iters must be >= 1, got ", iters);
  const int threads = at::get_num_threads();
  at::Tensor rates = at::zeros({threads}, at::kDouble);
  double* out = rates.data_ptr<double>();
#pragma omp parallel num_threads(threads)
  {
    const double seconds = run_one(code, iters);
    out[omp_get_thread_num()] = (code == 3 ? 8.0 : 12.0) * static_cast<double>(iters) / seconds;
  }
  return rates;
#else
  TORCH_CHECK(false, "instruction_rate needs a build with AVX512-VNNI and AVX512-BF16");
#endif
}

}  // namespace genserve_unit_rate

TORCH_LIBRARY(genserve_unit_rate, m) {
  m.def("instruction_rate(str kind, int iters) -> Tensor", &genserve_unit_rate::instruction_rate);
}
