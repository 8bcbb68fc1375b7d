// Paged decode attention on CPU: one query token per row, keys and values read in place from the
// block pools through each row's block table (no gather copy, no padding).
//
//   out[b, h, :] = softmax_j(q[b, h] · k[b, j] * scale) · v[b, j],  j < context_lens[b]
//
// Work item = (row b, KV head); its `group` query heads share the keys and values (GQA). Scores,
// softmax and the P·V accumulation are fp32. Every loop's order is fixed by the row's own context
// length, so a row gives the same bits whatever else is in the batch (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "avx512_math.h"
#include "bf16.h"
#include "genserve_ops.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using genserve::to_float;

template <typename T, int G>
void decode_kernel(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                   const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                   double scale) {
  constexpr int D = 64;                                   // head_dim (checked by the caller)
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
      const int64_t b = item / kv_heads, h = item % kv_heads, len = ld[b];
      const int64_t* table = td + b * table_width;
      scores.resize(G * len);
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d)
          qf[g][d] = to_float(qd[(b * heads + h * G + g) * D + d]) * fscale;
      float mx[G];
      for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::max();
      // Walks the row's context in position order through its block table; for each token j
      // loads that token's head vector from `pool` into kf (fp32) and calls visit(j).
      auto each_token = [&](const T* pool, auto&& visit) {
        for (int64_t start = 0; start < len; start += block) {
          const T* base = pool + table[start / block] * block_stride + h * D;
          const int64_t n = std::min(block, len - start);
          for (int64_t t = 0; t < n; ++t) {
            const T* row = base + t * token_stride;
            for (int d = 0; d < D; ++d) kf[d] = to_float(row[d]);
            visit(start + t);
          }
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

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bf16 loop with AVX512-BF16: a key's 64 values are two zmm, q · k is two vdpbf16ps per query
// head plus a lane sum; P·V runs in fp32 FMAs on the value row widened to four zmm. Same order
// of operations for every row, so batch invariance holds as in the generic loop.
constexpr int64_t PREFETCH_BLOCKS = 3;     // how far ahead the next rows are prefetched

template <int G>
void decode_kernel_avx512(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out,
                          double scale) {
  constexpr int D = 64;
  const int64_t heads = q.size(1);
  const int64_t block = k_pool.size(1), kv_heads = k_pool.size(2), table_width = tables.size(1);
  const int64_t block_stride = block * kv_heads * D, token_stride = kv_heads * D;
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k_pool.data_ptr<c10::BFloat16>());
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v_pool.data_ptr<c10::BFloat16>());
  const int64_t* td = tables.data_ptr<int64_t>();
  const int64_t* ld = lens.data_ptr<int64_t>();
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, q.size(0) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads, len = ld[b];
      const int64_t* table = td + b * table_width;
      const int64_t padded = (len + 15) / 16 * 16;
      scores.assign(G * padded, -std::numeric_limits<float>::infinity());
      __m512bh qv[G][2];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 2; ++i)
          qv[g][i] = (__m512bh)_mm512_loadu_si512(qd + (b * heads + h * G + g) * D + 32 * i);
      // The row's keys (then values) in position order through its block table. Blocks are
      // scattered in the pool, which defeats the hardware prefetcher at every block boundary:
      // the next block's rows are prefetched while this one is read.
      auto each_token = [&](const uint16_t* pool, auto&& visit) {
        for (int64_t start = 0; start < len; start += block) {
          const uint16_t* base = pool + table[start / block] * block_stride + h * D;
          const int64_t n = std::min(block, len - start);
          const int64_t ahead = start + PREFETCH_BLOCKS * block;
          if (ahead < len) {
            const char* next = reinterpret_cast<const char*>(
                pool + table[ahead / block] * block_stride + h * D);
            for (int64_t t = 0; t < std::min(block, len - ahead); ++t) {
              _mm_prefetch(next + t * token_stride * 2, _MM_HINT_T0);
              _mm_prefetch(next + t * token_stride * 2 + 64, _MM_HINT_T0);
            }
          }
          for (int64_t t = 0; t < n; ++t) visit(start + t, base + t * token_stride);
        }
      };
      float mx[G];
      for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::max();
      each_token(kd, [&](int64_t j, const uint16_t* row) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(row);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int g = 0; g < G; ++g) {
          const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0),
                                              qv[g][1], k1);
          const float s = _mm512_reduce_add_ps(dot) * fscale;
          scores[g * padded + j] = s;
          mx[g] = std::max(mx[g], s);
        }
      });
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {
        float* sg = scores.data() + g * padded;
        const __m512 m = _mm512_set1_ps(mx[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += 16) {
          const __m512 p = genserve::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
          _mm512_storeu_ps(sg + j, p);
          sum = _mm512_add_ps(sum, p);
        }
        inv_sum[g] = 1.f / _mm512_reduce_add_ps(sum);
      }
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
      each_token(vd, [&](int64_t j, const uint16_t* row) {
        __m512 v[4];
        for (int i = 0; i < 4; ++i)
          v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * i))), 16));
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * padded + j]);
          for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
        }
      });
      for (int g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(inv_sum[g]);
        uint16_t* dst = od + (b * heads + h * G + g) * D;
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * i),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][i], inv)));
      }
    }
  });
}
#endif  // __AVX512BF16__ && __AVX512BW__

template <typename T>
void dispatch_group(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                    const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, double scale) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    switch (q.size(1) / k_pool.size(2)) {
      case 1: return decode_kernel_avx512<1>(q, k_pool, v_pool, tables, lens, out, scale);
      case 2: return decode_kernel_avx512<2>(q, k_pool, v_pool, tables, lens, out, scale);
      case 3: return decode_kernel_avx512<3>(q, k_pool, v_pool, tables, lens, out, scale);
      case 4: return decode_kernel_avx512<4>(q, k_pool, v_pool, tables, lens, out, scale);
      case 8: return decode_kernel_avx512<8>(q, k_pool, v_pool, tables, lens, out, scale);
      default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
    }
  }
#endif
  switch (q.size(1) / k_pool.size(2)) {
    case 1: return decode_kernel<T, 1>(q, k_pool, v_pool, tables, lens, out, scale);
    case 2: return decode_kernel<T, 2>(q, k_pool, v_pool, tables, lens, out, scale);
    case 3: return decode_kernel<T, 3>(q, k_pool, v_pool, tables, lens, out, scale);
    case 4: return decode_kernel<T, 4>(q, k_pool, v_pool, tables, lens, out, scale);
    case 8: return decode_kernel<T, 8>(q, k_pool, v_pool, tables, lens, out, scale);
    default: TORCH_CHECK(false, "query heads per KV head must be 1, 2, 3, 4 or 8");
  }
}

}  // namespace

at::Tensor genserve::paged_decode(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const at::Tensor& tables,
                                  const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "q [B, H, D], pools [blocks, block, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  tables.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q and pools share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.size(2) == 64 && k_pool.size(3) == 64 && q.size(1) % k_pool.size(2) == 0,
              "head_dim 64 and whole GQA groups");
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_group<c10::BFloat16>(q, k_pool, v_pool, tables, lens, out, scale);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bf16 or fp32");
    dispatch_group<float>(q, k_pool, v_pool, tables, lens, out, scale);
  }
  return out;
}

TORCH_LIBRARY(genserve, m) {
  m.def("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("paged_decode", &genserve::paged_decode); }
