// genserve's CPU ops as C++ functions, for kernels that chain them (decode_layers.cpp). Each is
// also registered as torch.ops.genserve.<name>; the .cpp files document shapes and dtypes.
#pragma once

#include <ATen/ATen.h>

#include "q8_rows.h"

namespace genserve {

// The 8-bit KV cache format (engine/attention/kv_quant.py, OCP MX's MXINT8 block): a row is head_dim int8 q,
// then one byte per KV8_GROUP numbers, the biased exponent E = e + 127; a number is q * 2^(E - 133).
constexpr int64_t KV8_GROUP = 32;
constexpr int KV8_EXP_BIAS = 127, KV8_EXP_MIN = -120, KV8_Q_BITS = 6;
inline int64_t kv8_row_bytes(int64_t head_dim) { return head_dim + head_dim / KV8_GROUP; }
inline int64_t kv8_head_dim(int64_t row_bytes) { return row_bytes * KV8_GROUP / (KV8_GROUP + 1); }

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale);
// q [B, H, D] over bf16 / fp32 pools, D 64, 128 or 256, the row's last `window` positions
// (0: all of them) (decode_attention.cpp).
at::Tensor paged_decode_window(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& tables, const at::Tensor& lens, double scale,
                               int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight,
                         double eps);
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& rope, const at::Tensor& positions,
                         at::Tensor cache, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv_heads);
at::Tensor norm_rope_store_kv(const at::Tensor& qkv, const at::Tensor& q_weight,
                              const at::Tensor& k_weight, double eps, const at::Tensor& rope,
                              const at::Tensor& positions, at::Tensor cache, const at::Tensor& slots,
                              int64_t n_heads, int64_t n_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const at::Tensor& outliers, const at::Tensor& outlier_q);
// Always defined; raises where the build does not target AVX512-VNNI (q4q8_linear.cpp).
// rounded: x's rows as `q8_round_rows` gives them, or null (rounded inside).
at::Tensor q4q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const Q8Rows* rounded = nullptr);
// The same rows times a GGUF's Q8_0 blocks in `q8q8_linear`'s layout (q4q8_linear.cpp); raises
// as `q4q8_linear`.
at::Tensor q8q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n);
// x [M, K] bf16's rows rounded as the 8-bit products round them (q4q8_linear.cpp, q8_rows.h).
Q8Rows q8_round_rows(const at::Tensor& x);
// x [M, K] bf16 or fp32 @ W^T, W in Q4_K / Q6_K row segments (qk_linear.cpp); every build, every
// CPU (the path is chosen at run time; -1: the best this CPU runs).
at::Tensor qk_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                     int64_t path);
// Row groups of x times their own Q4_K / Q6_K weights in one call (a mixture of experts' step).
at::Tensor qk_linear_grouped(const at::Tensor& x, at::TensorList weights, at::IntArrayRef kinds,
                             at::IntArrayRef segments, at::IntArrayRef offsets, int64_t path);

// The table of one adapter's buffer for `lora_delta_` (lora_delta.cpp): per fused matrix slot
// a_off, R, K, parts, then lo, hi, r_lo, r_hi, b_off per part (`engine.model.lora.kernel_tables`).
constexpr int64_t LORA_MAX_PARTS = 3;
constexpr int64_t LORA_SLOT_FIELDS = 4 + 5 * LORA_MAX_PARTS;

// (every CPU with AVX512-BF16 has AVX512-VNNI, which the 8-bit format uses)
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GENSERVE_LORA_DELTA 1
// y[rows] += each adapter row's LoRA delta of one fused matrix, in place (lora_delta.cpp).
// rounded: x's rows as `q8_round_rows` gives them (all T rows), which the 8-bit format then
// takes instead of rounding them again; or null.
void lora_delta_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows,
                 at::IntArrayRef offsets, at::TensorList blobs, at::TensorList index, int64_t slot,
                 const Q8Rows* rounded = nullptr);
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define GENSERVE_FMA_LINEAR 1
// x [M, K] bf16 @ W^T with W in 16-column panels [N/16, K, 16] bf16 (fma_linear.cpp).
at::Tensor fma_linear(const at::Tensor& x, const at::Tensor& panels);
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENSERVE_PACKED_LINEAR 1
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t k_chunk);
// Row groups of x times their own packed weights in one call (packed_linear.cpp).
at::Tensor packed_linear_grouped(const at::Tensor& x, at::TensorList packed, at::IntArrayRef offsets,
                                 at::IntArrayRef k_chunks);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q4, int64_t k_chunk);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GENSERVE_Q4_AMX 1
at::Tensor q4_amx_linear(const at::Tensor& x, const at::Tensor& q4);
at::Tensor q8_amx_linear(const at::Tensor& x, const at::Tensor& q8);
#endif
#endif

}  // namespace genserve
