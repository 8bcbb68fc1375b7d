// genserve's CPU ops as C++ functions, for kernels that chain them (decode_layers.cpp). Each is
// also registered as torch.ops.genserve.<name>; the .cpp files document shapes and dtypes.
#pragma once

#include <ATen/ATen.h>

namespace genserve {

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& tables, const at::Tensor& lens, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& weight,
                         double eps);
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& rope, const at::Tensor& positions,
                         at::Tensor cache, const at::Tensor& slots, int64_t n_heads,
                         int64_t n_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GENSERVE_PACKED_LINEAR 1
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t k_chunk);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& q4, int64_t k_chunk);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GENSERVE_Q4_AMX 1
at::Tensor q4_amx_linear(const at::Tensor& x, const at::Tensor& q4);
at::Tensor q8_amx_linear(const at::Tensor& x, const at::Tensor& q8);
#endif
#endif

}  // namespace genserve
