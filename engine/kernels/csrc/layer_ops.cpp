// Fused per-token operations of a Llama block on CPU. Each replaces a chain of 3-12 small torch
// ops (and their dispatch, temporaries and fp32 round trips) with one pass over the rows:
//
//   rms_norm(x, w, eps)             -> x / sqrt(mean(x^2) + eps) * w            (fp32 math)
//   add_rms_norm_(h, d, w, eps)     -> h := h + d (rounded to h's dtype, in place); rms_norm(h)
//   rope_store_kv(qkv, rope, pos, cache, slots, H, KVH)
//                                   -> q rotated; k rotated and v written into their cache slots
//                                      (in the 8-bit format when the cache is int8)
//   norm_rope_store_kv(qkv, q_w, k_w, eps, rope, pos, cache, slots, H, KVH)
//                                   -> rope_store_kv after each q and k head is RMS-normed over
//                                      its head_dim (Qwen3, Gemma 3), rounded to qkv's dtype first
//   silu_mul(gate_up)               -> silu(gate) * up                           (fp32 math)
//   gelu_tanh_mul(gate_up)          -> gelu_tanh(gate) * up                      (fp32 math)
//
// Every row is computed alone, in a fixed order, so a row's bits never depend on the other rows
// of the batch (batch invariance). Tensors are bf16 or fp32; norm weights and the RoPE table fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "genserve_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using genserve::to_float;
template <typename T> inline T store(float x) { return static_cast<T>(x); }

// Rows per parallel task: at least ~16k elements each, so 32-row decode steps stay on one thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / row_elems); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [T, D] tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              name, " must be bf16 or fp32");
}

void check_norm_weight(const at::Tensor& weight, int64_t dim) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == dim && weight.is_contiguous(),
              "weight must be fp32 [D]");
}

template <typename T>
void norm_rows(const T* in, T* out, const float* w, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = in + r * dim;
    float ss = 0.f;
    for (int64_t i = 0; i < dim; ++i) {
      const float v = to_float(x[i]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* y = out + r * dim;
    for (int64_t i = 0; i < dim; ++i) y[i] = store<T>(to_float(x[i]) * inv * w[i]);
  }
}

// (a + ib)(c + is) over the interleaved pairs of one head vector, hd / 2 pairs; fp32 math.
template <typename T>
inline void rotate(const T* x, const float* cs, T* y, int64_t hd) {
  for (int64_t j = 0; j < hd / 2; ++j) {
    const float a = to_float(x[2 * j]), b = to_float(x[2 * j + 1]);
    const float c = cs[2 * j], s = cs[2 * j + 1];
    y[2 * j] = store<T>(a * c - b * s);
    y[2 * j + 1] = store<T>(a * s + b * c);
  }
}

// One head vector x [hd] (the numbers a bf16/fp32 cache would hold) as a row of the 8-bit
// format (engine/attention/kv_quant.py, whose quantize_kv stores the same bytes): per group of 32, e from
// frexp of the fp32 amax (0 for an all-zero group, at least -120), q = x * 2^(6 - e) (exact)
// rounded half to even and clamped to ±127, then the groups' e + 127 after the hd int8.
// Compiled without -ffast-math, which may assume no rounding-mode dependence of nearbyint.
__attribute__((optimize("no-fast-math"))) void quantize_row(const float* x, int8_t* dst, int64_t hd) {
  using namespace genserve;
  for (int64_t g = 0; g < hd / KV8_GROUP; ++g) {
    const float* xg = x + g * KV8_GROUP;
    float amax = 0.f;
    for (int i = 0; i < KV8_GROUP; ++i) amax = std::max(amax, std::fabs(xg[i]));
    int k = 0;
    std::frexp(amax, &k);                                  // amax = m * 2^k, 0.5 <= m < 1
    const int e = amax == 0.f ? 0 : std::max(k - 1, KV8_EXP_MIN);
    for (int i = 0; i < KV8_GROUP; ++i) {
      const float v = std::nearbyint(std::ldexp(xg[i], KV8_Q_BITS - e));
      dst[g * KV8_GROUP + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
    }
    dst[hd + g] = static_cast<int8_t>(static_cast<uint8_t>(e + KV8_EXP_BIAS));
  }
}

}  // namespace

at::Tensor genserve::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_norm_weight(weight, x.size(1));
  at::Tensor out = at::empty_like(x);
  const int64_t dim = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    at::parallel_for(0, x.size(0), grain(dim), [&](int64_t b, int64_t e) {
      norm_rows(x.data_ptr<scalar_t>() + b * dim, out.data_ptr<scalar_t>() + b * dim,
                weight.data_ptr<float>(), e - b, dim, static_cast<float>(eps));
    });
  });
  return out;
}

at::Tensor genserve::add_rms_norm_(at::Tensor h, const at::Tensor& delta,
                                   const at::Tensor& weight, double eps) {
  check_rows(h, "h");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type() &&
                  delta.is_contiguous(), "delta must match h");
  check_norm_weight(weight, h.size(1));
  at::Tensor out = at::empty_like(h);
  const int64_t dim = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "add_rms_norm_", [&] {
    at::parallel_for(0, h.size(0), grain(dim), [&](int64_t b, int64_t e) {
      scalar_t* hp = h.data_ptr<scalar_t>() + b * dim;
      const scalar_t* dp = delta.data_ptr<scalar_t>() + b * dim;
      for (int64_t i = 0; i < (e - b) * dim; ++i)
        hp[i] = store<scalar_t>(to_float(hp[i]) + to_float(dp[i]));
      norm_rows(hp, out.data_ptr<scalar_t>() + b * dim, weight.data_ptr<float>(), e - b, dim,
                static_cast<float>(eps));
    });
  });
  return out;
}

namespace {

// rope_store_kv, with q_norm / k_norm (fp32 [hd]) each q / k head first RMS-normed (a head's
// normed numbers rounded to qkv's dtype, as the separate `rms_norm` gives them); null: no norm.
at::Tensor rope_store_kv_impl(const at::Tensor& qkv, const at::Tensor& rope, const at::Tensor& positions,
                              at::Tensor cache, const at::Tensor& slots, int64_t n_heads,
                              int64_t n_kv_heads, const float* q_norm, const float* k_norm, float eps) {
  check_rows(qkv, "qkv");
  const bool eight_bit = cache.scalar_type() == at::kChar;
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                  (cache.scalar_type() == qkv.scalar_type() || eight_bit),
              "cache must be a contiguous [2, blocks, block, kv_heads, hd] tensor of qkv's dtype "
              "or int8 rows of the 8-bit format");
  const int64_t t_len = qkv.size(0),
                hd = eight_bit ? genserve::kv8_head_dim(cache.size(4)) : cache.size(4);
  TORCH_CHECK(!eight_bit || (hd % genserve::KV8_GROUP == 0 && genserve::kv8_row_bytes(hd) == cache.size(4)),
              "an 8-bit cache row is head_dim int8 + 2 bytes per 32");
  TORCH_CHECK(cache.size(3) == n_kv_heads && qkv.size(1) == (n_heads + 2 * n_kv_heads) * hd,
              "qkv must hold (n_heads + 2 n_kv_heads) * hd columns");
  TORCH_CHECK(rope.dim() == 3 && rope.size(1) * 2 == hd && rope.size(2) == 2 &&
                  rope.scalar_type() == at::kFloat && rope.is_contiguous(),
              "rope must be fp32 [max_context, hd / 2, 2] (cos, sin)");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  positions.numel() == t_len && slots.numel() == t_len &&
                  positions.is_contiguous() && slots.is_contiguous(),
              "positions and slots must be int64 [T]");
  const int64_t pool_rows = cache.size(1) * cache.size(2), max_pos = rope.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_len; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the RoPE table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_rows, "slot ", slot[t], " outside the cache");
  }
  at::Tensor q = at::empty({t_len, n_heads, hd}, qkv.options());
  const int64_t width = qkv.size(1), kv_row = n_kv_heads * hd;
  // An 8-bit row per (token, KV head): k rotated as into a cache of qkv's dtype (rounded to it,
  // the numbers that cache would hold), then k and v quantized.
  const int64_t row8 = eight_bit ? cache.size(4) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_store_kv", [&] {
    const scalar_t* src = qkv.data_ptr<scalar_t>();
    scalar_t* qd = q.data_ptr<scalar_t>();
    scalar_t* kd = eight_bit ? nullptr : cache.data_ptr<scalar_t>();
    scalar_t* vd = eight_bit ? nullptr : kd + pool_rows * kv_row;
    int8_t* kd8 = eight_bit ? cache.data_ptr<int8_t>() : nullptr;
    int8_t* vd8 = eight_bit ? kd8 + pool_rows * n_kv_heads * row8 : nullptr;
    const float* cs = rope.data_ptr<float>();
    at::parallel_for(0, t_len, grain(width), [&](int64_t b, int64_t e) {
      std::vector<scalar_t> k(eight_bit ? hd : 0);
      std::vector<float> x(eight_bit ? hd : 0);
      std::vector<scalar_t> normed(q_norm ? hd : 0);
      // head vector `in` as RoPE reads it: normed by `w` into `normed` first when w is set
      const auto head = [&](const scalar_t* in, const float* w) -> const scalar_t* {
        if (!w) return in;
        norm_rows(in, normed.data(), w, 1, hd, eps);
        return normed.data();
      };
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* row = src + t * width;
        const float* c = cs + pos[t] * hd;
        for (int64_t h = 0; h < n_heads; ++h)
          rotate(head(row + h * hd, q_norm), c, qd + (t * n_heads + h) * hd, hd);
        const scalar_t* v = row + (n_heads + n_kv_heads) * hd;
        if (!eight_bit) {
          scalar_t* k_dst = kd + slot[t] * kv_row;
          for (int64_t h = 0; h < n_kv_heads; ++h)
            rotate(head(row + (n_heads + h) * hd, k_norm), c, k_dst + h * hd, hd);
          std::memcpy(vd + slot[t] * kv_row, v, kv_row * sizeof(scalar_t));
          continue;
        }
        for (int64_t h = 0; h < n_kv_heads; ++h) {
          rotate(head(row + (n_heads + h) * hd, k_norm), c, k.data(), hd);
          for (int64_t i = 0; i < hd; ++i) x[i] = to_float(k[i]);
          quantize_row(x.data(), kd8 + (slot[t] * n_kv_heads + h) * row8, hd);
          for (int64_t i = 0; i < hd; ++i) x[i] = to_float(v[h * hd + i]);
          quantize_row(x.data(), vd8 + (slot[t] * n_kv_heads + h) * row8, hd);
        }
      }
    });
  });
  return q;
}

}  // namespace

at::Tensor genserve::rope_store_kv(const at::Tensor& qkv, const at::Tensor& rope, const at::Tensor& positions,
                                   at::Tensor cache, const at::Tensor& slots, int64_t n_heads,
                                   int64_t n_kv_heads) {
  return rope_store_kv_impl(qkv, rope, positions, cache, slots, n_heads, n_kv_heads, nullptr, nullptr, 0.f);
}

at::Tensor genserve::norm_rope_store_kv(const at::Tensor& qkv, const at::Tensor& q_weight,
                                        const at::Tensor& k_weight, double eps, const at::Tensor& rope,
                                        const at::Tensor& positions, at::Tensor cache,
                                        const at::Tensor& slots, int64_t n_heads, int64_t n_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t hd = qkv.size(1) / (n_heads + 2 * n_kv_heads);
  check_norm_weight(q_weight, hd);
  check_norm_weight(k_weight, hd);
  return rope_store_kv_impl(qkv, rope, positions, cache, slots, n_heads, n_kv_heads,
                            q_weight.data_ptr<float>(), k_weight.data_ptr<float>(),
                            static_cast<float>(eps));
}

namespace {

// act(gate) * up for each row of gate_up [T, 2F] = gate | up, in fp32, rounded once to the
// input's dtype: the shared loop of the gated MLP products below. `act` maps float -> float.
template <typename Act>
at::Tensor gated_product(const at::Tensor& gate_up, Act act) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t f = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), f}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "gated_product", [&] {
    at::parallel_for(0, gate_up.size(0), grain(2 * f), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = gate_up.data_ptr<scalar_t>() + r * 2 * f;
        const scalar_t* u = g + f;
        scalar_t* y = out.data_ptr<scalar_t>() + r * f;
        for (int64_t i = 0; i < f; ++i) y[i] = store<scalar_t>(act(to_float(g[i])) * to_float(u[i]));
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor genserve::gelu_tanh_mul(const at::Tensor& gate_up) {
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;     // sqrt(2 / pi), GELU's cubic term
  return gated_product(gate_up, [](float x) {
    return 0.5f * x * (1.f + std::tanh(k0 * (x + k1 * x * x * x)));
  });
}

at::Tensor genserve::silu_mul(const at::Tensor& gate_up) {
  return gated_product(gate_up, [](float x) { return x / (1.f + std::exp(-x)); });
}

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_store_kv(Tensor qkv, Tensor rope, Tensor positions, Tensor(a!) cache, Tensor slots, "
        "int n_heads, int n_kv_heads) -> Tensor");
  m.def("norm_rope_store_kv(Tensor qkv, Tensor q_weight, Tensor k_weight, float eps, Tensor rope, "
        "Tensor positions, Tensor(a!) cache, Tensor slots, int n_heads, int n_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("rms_norm", &genserve::rms_norm);
  m.impl("add_rms_norm_", &genserve::add_rms_norm_);
  m.impl("rope_store_kv", &genserve::rope_store_kv);
  m.impl("norm_rope_store_kv", &genserve::norm_rope_store_kv);
  m.impl("silu_mul", &genserve::silu_mul);
  m.impl("gelu_tanh_mul", &genserve::gelu_tanh_mul);
}
