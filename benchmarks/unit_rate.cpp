// The host's own rate for one vector instruction, per thread: `benchmarks.unit_rate` builds this
// file as `torch.ops.genserve_unit_rate.instruction_rate` to find the ceiling the 8-bit and bf16
// products are measured against, on the same cores in the same run (this machine's speed moves by
// up to 2x between hours, so a figure from a data sheet or another day is no ceiling).
//
// Each thread runs `iters` times 12 independent instructions (18 in the mixed loop), one per accumulator (12 chains: a
// 4-5-cycle latency on two units needs about 10 in flight), with the accumulators in named
// registers: in an array GCC kept them on the stack (a load and a store around every
// instruction, half the rate).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <chrono>
#include <cstdint>
#include <string>

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define UNIT_RATE_AVX512 1
#endif

namespace genserve_unit_rate {

#ifdef UNIT_RATE_AVX512
#define UR_EACH(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define UR_EXTRA(op) op(12) op(13) op(14) op(15) op(16) op(17)

// Seconds this thread takes for `iters` passes of its loop (12 instructions, or 18 for "mix").
double run_one(int kind, int64_t iters) {
  const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
#define UR_INIT(i) __m512i a##i = _mm512_set1_epi32(i);
  UR_EACH(UR_INIT)
  UR_EXTRA(UR_INIT)
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
    // 12 vpdpbusd (as many chains as the plain loop) beside 6 vfmadd231ps, each on its own chain
    for (int64_t it = 0; it < iters; ++it) {
      UR_EACH(UR_VNNI)
      UR_FMA(12) UR_FMA(13) UR_FMA(14) UR_FMA(15) UR_FMA(16) UR_FMA(17)
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Keep every chain's result alive (unsigned: the lanes' sums wrap, which is defined for it).
#define UR_SUM(i) +static_cast<uint32_t>(_mm512_reduce_add_epi32(a##i))
  volatile uint32_t sink = 0u UR_EACH(UR_SUM) UR_EXTRA(UR_SUM);
  (void)sink;
  return seconds;
}
#endif

// kind: "vpdpbusd" (64 int8 multiply-adds an instruction), "vdpbf16ps" (32 bf16 ones), "vfmadd"
// (vfmadd231ps zmm, 16 fp32 ones) or "mix" (12 vpdpbusd beside 6 vfmadd231ps: whether the two
// share the host's units). Returns float64 [threads]: each of torch's threads' instructions per
// second (for "mix", its vpdpbusd alone), all threads running at once. Raises (RuntimeError) on
// a bad kind or iters, or when OpenMP ran fewer threads than torch's count.
at::Tensor instruction_rate(const std::string& kind, int64_t iters) {
#ifdef UNIT_RATE_AVX512
  const int code = kind == "vpdpbusd" ? 0 : kind == "vdpbf16ps" ? 1 : kind == "vfmadd" ? 2
                   : kind == "mix"      ? 3 : -1;
  TORCH_CHECK(code >= 0, "instruction_rate: kind must be vpdpbusd, vdpbf16ps, vfmadd or mix, got ", kind);
  TORCH_CHECK(iters >= 1, "instruction_rate: iters must be >= 1, got ", iters);
  const int threads = at::get_num_threads();
  at::Tensor rates = at::zeros({threads}, at::kDouble);
  double* out = rates.data_ptr<double>();
  int ran = 0;
#pragma omp parallel num_threads(threads)
  {
    const double seconds = run_one(code, iters);
    out[omp_get_thread_num()] = 12.0 * static_cast<double>(iters) / seconds;
#pragma omp single
    ran = omp_get_num_threads();
  }
  TORCH_CHECK(ran == threads, "instruction_rate: OpenMP ran ", ran, " threads of ", threads);
  return rates;
#else
  TORCH_CHECK(false, "instruction_rate needs a build with AVX512-VNNI and AVX512-BF16");
#endif
}

}  // namespace genserve_unit_rate

TORCH_LIBRARY(genserve_unit_rate, m) {
  m.def("instruction_rate(str kind, int iters) -> Tensor", &genserve_unit_rate::instruction_rate);
}
