// Prototype: y[M,N] = x[M,K] @ W^T with W in Q4_1 blocks (w = d*q + m, q in 0..15, 32 k per
// block) and x rounded to int8 per row and block of 32 (Q8_1), one vpdpbusd chain per block.
// Layout: [N/16 groups][K/32 blocks]{ d[16] f32, m[16] f32, nib[4][64 B] } where byte 4c+i of
// nib[j] (c = column 0..15, i = 0..3) holds q[c][k=4j+i] low nibble, q[c][k=16+4j+i] high nibble.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>
#include <cstdint>

constexpr int QK = 32;
constexpr int GROUP_BYTES = 64 + 64 + 256;   // d, m, nibbles

at::Tensor pack(at::Tensor q, at::Tensor d, at::Tensor m) {
  // q uint8 [N, K] (0..15), d, m float [N, K/32]
  int64_t N = q.size(0), K = q.size(1), KB = K / QK;
  auto out = at::zeros({N / 16, KB, GROUP_BYTES}, at::kByte);
  auto qa = q.accessor<uint8_t, 2>();
  auto da = d.accessor<float, 2>(); auto ma = m.accessor<float, 2>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < N / 16; ++g)
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* blk = o + (g * KB + b) * GROUP_BYTES;
      float* dd = reinterpret_cast<float*>(blk); float* mm = reinterpret_cast<float*>(blk + 64);
      uint8_t* nib = blk + 128;
      for (int c = 0; c < 16; ++c) { dd[c] = da[g * 16 + c][b]; mm[c] = ma[g * 16 + c][b]; }
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 4; ++i) {
            int64_t n = g * 16 + c, k0 = b * QK;
            nib[j * 64 + 4 * c + i] = qa[n][k0 + 4 * j + i] | (qa[n][k0 + 16 + 4 * j + i] << 4);
          }
    }
  return out;
}

// x int8 [M, K], xs float [M, K/32] (scale per row and block), xsum float [M, K/32] (xs * sum q)
at::Tensor gemm(at::Tensor xq, at::Tensor xs, at::Tensor xsum, at::Tensor packed, int64_t N) {
  int64_t M = xq.size(0), K = xq.size(1), KB = K / QK;
  auto y = at::empty({M, N}, at::kFloat);
  const int8_t* X = xq.data_ptr<int8_t>(); const float* XS = xs.data_ptr<float>();
  const float* XSUM = xsum.data_ptr<float>(); const uint8_t* P = packed.data_ptr<uint8_t>();
  float* Y = y.data_ptr<float>();
  constexpr int R = 4, G = 2;
  at::parallel_for(0, N / (16 * G), 1, [&](int64_t p0, int64_t p1) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t r0 = 0; r0 < M; r0 += R) {
        int rows = std::min<int64_t>(R, M - r0);
        __m512 acc[R][G];
        for (int r = 0; r < R; ++r) for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
        for (int64_t b = 0; b < KB; ++b) {
          __m512i iacc[R][G];
          for (int r = 0; r < R; ++r) for (int g = 0; g < G; ++g) iacc[r][g] = _mm512_setzero_si512();
          const uint8_t* blk[G];
          for (int g = 0; g < G; ++g) blk[g] = P + ((p * G + g) * KB + b) * GROUP_BYTES;
          for (int j = 0; j < 4; ++j) {
            __m512i wl[G], wh[G];
            for (int g = 0; g < G; ++g) {
              __m512i v = _mm512_loadu_si512(blk[g] + 128 + 64 * j);
              wl[g] = _mm512_and_si512(v, low);
              wh[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; ++r) {
              if (r >= rows) break;
              const int8_t* xr = X + (r0 + r) * K + b * QK;
              __m512i xl = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 4 * j));
              __m512i xh = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xr + 16 + 4 * j));
              for (int g = 0; g < G; ++g) {
                iacc[r][g] = _mm512_dpbusd_epi32(iacc[r][g], wl[g], xl);
                iacc[r][g] = _mm512_dpbusd_epi32(iacc[r][g], wh[g], xh);
              }
            }
          }
          __m512 dv[G], mv[G];
          for (int g = 0; g < G; ++g) { dv[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk[g]));
                                        mv[g] = _mm512_loadu_ps(reinterpret_cast<const float*>(blk[g] + 64)); }
          for (int r = 0; r < R; ++r) {
            if (r >= rows) break;
            __m512 s = _mm512_set1_ps(XS[(r0 + r) * KB + b]);
            __m512 sm = _mm512_set1_ps(XSUM[(r0 + r) * KB + b]);
            for (int g = 0; g < G; ++g) {
              acc[r][g] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r][g]), s), dv[g], acc[r][g]);
              acc[r][g] = _mm512_fmadd_ps(mv[g], sm, acc[r][g]);
            }
          }
        }
        for (int r = 0; r < rows; ++r) for (int g = 0; g < G; ++g)
          _mm512_storeu_ps(Y + (r0 + r) * N + (p * G + g) * 16, acc[r][g]);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("pack", &pack); mod.def("gemm", &gemm);
}
