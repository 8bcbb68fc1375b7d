// Every block of a pure-decode step in one call: the same ops, in the same order, on the same
// tensors as `Transformer.forward`'s Python loop with `KernelLayerOps` — the packed matrix
// products as `linear.linear` runs them (`q4q8_linear` on the products whose matrix the model
// took as its Q4_1 blocks for llama.cpp's arithmetic, `q8q8_linear` on those it took as Q8_0
// blocks, `qk_linear` on those it took as Q4_K / Q6_K blocks, `fma_linear` on every product
// where the weights are in its panels (CPUs without bf16 arithmetic), genserve's `q4_linear`
// over the 4-bit blocks up to `max_rows` rows where the model was loaded with them,
// `int8_linear` on every product where it runs on int8 arithmetic, else `packed_linear` up to
// `max_rows` rows where the weight kind has a k chunk, else oneDNN with a one-row input
// doubled), `rope_store_kv` (or `norm_rope_store_kv` with per-head q/k norms), `paged_decode`
// (or `paged_decode_window` with the layer's score scale and sliding window), `rms_norm`,
// `add_rms_norm_`, `silu_mul` (or `gelu_tanh_mul`) — so a row's bits are the ones the Python
// loop gives (tested, for every family the loop serves), without ~25 Python calls per layer.
//
//   for each layer i:
//     a = Wo attn_i(rope_i(qk_norm_i?(Wqkv x + bqkv?))) + bo?
//     x = ffn_norm_i(h += post_attn_norm_i?(a))
//     x = next_norm_i(h += post_ffn_norm_i?(W2 act(W13 x)))      (or the mixture of experts)
//
// h [B, dim] is the residual stream (updated in place); x = attention_norm_0(h) on entry; the
// result is the final norm of h (next_norm of the last layer). The options of the block (biases,
// q/k norms, sandwich norms, GELU) are lists that are empty where the model has none. Each layer
// reads its own RoPE table (`ropes[rope_index[i]]`) and its KV group's slots, tables and lens
// (`group[i]`: models mixing sliding and global layers keep one block table per group). A layer
// whose MLP is a mixture of experts (`moe[i]` not 0) runs `MoEFeedForward.forward`'s ops on the
// CPU's grouped products (`qk_linear_grouped` or `packed_linear_grouped`: every expert of the
// layer in one format), its router's fp32 calls as `fp32_linear` makes them. With
// LoRA adapter rows (`lora_blobs` not empty) each of the four products takes the rows' deltas
// right after it (before a bias), `lora_delta_` with slot 4 i + kind, as `LoraBatch.add` adds
// them in the Python loop; with the adapters' 8-bit format over a `q4q8_linear` product, x's
// rows are rounded once for both (the same rounding either would do, so the same bits).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "genserve_ops.h"

namespace {

// x [M, in] @ packed weight → [M, out], exactly as `linear.linear` with a packed weight whose
// k chunk is `k_chunk` (0: none), whose 4-bit blocks are `q4` (undefined: none; with k
// chunk 0, the AMX kernel's products) and whose int8 copy is `i8` (null: none; else its q,
// scale, outliers and outlier_q, `engine.model.int8.Int8Weight`, which then run every product)
// and whose Q4_1 blocks in `q4q8_linear`'s layout are `q4q8` (undefined or empty: none; else
// they run every product), whose Q8_0 blocks in `q8q8_linear`'s layout are `q8q8` (likewise),
// whose Q4_K / Q6_K row segments in `qk_linear`'s layout are `qk` with
// kinds `qk_kinds` (empty: none; else they run every product). A 3-D `packed` is `fma_linear`'s
// bf16 panels, which run every other product. `rounded` (or null): x's rows as `q8_round_rows`
// gives them, which `q4q8_linear` then takes.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& q4,
                  int64_t k_chunk, int64_t max_rows, const at::Tensor* i8,
                  const at::Tensor& q4q8, const at::Tensor& q8q8, at::TensorList qk,
                  at::IntArrayRef qk_kinds, const genserve::Q8Rows* rounded) {
  if (q4q8.defined() && q4q8.numel() > 0)       // `linear.choose_method`'s order
    return genserve::q4q8_linear(x.contiguous(), q4q8, q4q8.size(0), rounded);
  if (q8q8.defined() && q8q8.numel() > 0) return genserve::q8q8_linear(x.contiguous(), q8q8, q8q8.size(0));
  if (!qk.empty()) return genserve::qk_linear(x.contiguous(), qk, qk_kinds, -1);
  if (i8 != nullptr) return genserve::int8_linear(x.contiguous(), i8[0], i8[1], i8[2], i8[3]);
#ifdef GENSERVE_FMA_LINEAR
  if (packed.dim() == 3) return genserve::fma_linear(x, packed);   // `panel_pack`'s panels
#endif
#ifdef GENSERVE_PACKED_LINEAR
  if (q4.defined() && x.size(0) <= max_rows) {
    if (k_chunk > 0) return genserve::q4_linear(x, q4, k_chunk);
#ifdef GENSERVE_Q4_AMX
    return genserve::q4_amx_linear(x, q4);
#else
    TORCH_CHECK(false, "decode_layers: 4-bit blocks without a k chunk need the AMX kernel");
#endif
  }
  if (k_chunk > 0 && x.size(0) <= max_rows) return genserve::packed_linear(x, packed, k_chunk);
#endif
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  const bool one_row = x.size(0) == 1;
  const at::Tensor in = one_row ? at::cat({x, x}) : x;
  at::Tensor y = op.call(in, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                         c10::string_view(""));
  return one_row ? y.slice(0, 0, 1) : y;
}

// The decode attention of one layer, as `paged_sdpa.decode_attention` runs it on the kernel path:
// window < 0: `paged_decode` (head_dim 64, no spec), else `paged_decode_window` with `scale` and
// that window (0: the whole context).
at::Tensor attend(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, int64_t window) {
  if (window < 0) return genserve::paged_decode(q, cache[0], cache[1], tables, lens, scale);
  return genserve::paged_decode_window(q.contiguous(), cache[0], cache[1], tables, lens, scale,
                                       window);
}

// A mixture-of-experts router's fp32 logits [M, E] for fp32 x [M, dim], as `linear.fp32_linear`
// computes them from the router's fp32 copy `w` [E, dim]: calls of exactly one of `call_rows`
// rows (the smallest count >= M, else calls of the largest), x padded with zero rows, each one
// `at::linear` (`DecodeLoop.moe_arguments` takes only routers that `_fp32_call` does not slice).
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef call_rows) {
  const int64_t m = x.size(0);
  int64_t rows = call_rows.back();
  for (const int64_t r : call_rows) {
    if (r >= m) {
      rows = r;
      break;
    }
  }
  const int64_t pad = ((-m) % rows + rows) % rows;
  const at::Tensor wide = pad ? at::constant_pad_nd(x, {0, 0, 0, pad}) : x;
  if (wide.size(0) == rows) return at::linear(wide, w).slice(0, 0, m);
  std::vector<at::Tensor> parts;
  for (const at::Tensor& tile : wide.split(rows)) parts.push_back(at::linear(tile, w));
  return at::cat(parts).slice(0, 0, m);
}

// One layer's experts as `decode_layers` takes them: per expert, its w13 and w2 as Q4_K / Q6_K
// segments (`qk`: `segments13[e]` of `w13` from `first13[e]`, kinds beside them) or as one packed
// bf16 matrix each (`packed_linear`: segment count 1, the kind its k chunk).
struct Experts {
  bool qk;
  at::TensorList w13, w2;
  at::IntArrayRef kinds13, kinds2, segments13, segments2;
  std::vector<int64_t> first13, first2;
};

// rows [P, in] grouped by expert (`sizes[e]` rows each, experts in id order) times each group's
// expert matrix (`which` 13: w13, else w2) in one call, as `MoEFeedForward._qk_product` /
// `_packed_product` make it.
at::Tensor experts_product(const at::Tensor& rows, const Experts& ex, int which,
                           const std::vector<int64_t>& sizes) {
  const at::TensorList w = which == 13 ? ex.w13 : ex.w2;
  const at::IntArrayRef kinds = which == 13 ? ex.kinds13 : ex.kinds2;
  const at::IntArrayRef segments = which == 13 ? ex.segments13 : ex.segments2;
  const std::vector<int64_t>& first = which == 13 ? ex.first13 : ex.first2;
  std::vector<at::Tensor> weights;
  std::vector<int64_t> busy_kinds, busy_segments, offsets = {0};
  for (size_t e = 0; e < sizes.size(); ++e) {
    if (sizes[e] == 0) continue;
    for (int64_t i = first[e]; i < first[e] + segments[e]; ++i) {
      weights.push_back(w[i]);
      busy_kinds.push_back(kinds[i]);
    }
    busy_segments.push_back(segments[e]);
    offsets.push_back(offsets.back() + sizes[e]);
  }
  if (ex.qk)
    return genserve::qk_linear_grouped(rows.contiguous(), weights, busy_kinds, busy_segments,
                                       offsets, -1);
#ifdef GENSERVE_PACKED_LINEAR
  return genserve::packed_linear_grouped(rows.contiguous(), weights, offsets, busy_kinds);
#else
  TORCH_CHECK(false, "decode_layers: packed experts need the AVX512-BF16 build of packed_linear_grouped");
#endif
}

// The mixture-of-experts MLP of one layer, `MoEFeedForward.forward` on the CPU's grouped
// products op for op: x [T, dim] → [T, dim] in x's dtype. Router logits in fp32, softmax, top k
// (renormalized with `norm_topk`), the (token, expert) pairs sorted by expert, both products one
// grouped call, each token's k outputs added in fp32 in expert-id order; `expert_rows` [E] (the
// metrics' expert load) gains this step's counts.
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, at::IntArrayRef call_rows,
                   at::Tensor expert_rows, int64_t top_k, bool norm_topk, bool gelu,
                   const Experts& ex) {
  const int64_t t = x.size(0), n_experts = router.size(0);
  const at::Tensor probs = at::softmax(router_logits(x.to(at::kFloat), router, call_rows), -1);
  auto [weights, ids] = at::topk(probs, top_k, -1);
  if (norm_topk) weights = weights / weights.sum(-1, true);
  const at::Tensor flat = ids.flatten();
  const at::Tensor counts = at::bincount(flat, {}, n_experts);
  const int64_t* c = counts.data_ptr<int64_t>();
  const std::vector<int64_t> sizes(c, c + n_experts);
  expert_rows.add_(counts);
  const at::Tensor order = at::argsort(flat, /*stable=*/true, 0, false);
  const at::Tensor rows = x.index_select(0, at::floor_divide(order, top_k));
  const at::Tensor gate_up = experts_product(rows, ex, 13, sizes);
  const at::Tensor y = experts_product(gelu ? genserve::gelu_tanh_mul(gate_up)
                                            : genserve::silu_mul(gate_up), ex, 2, sizes);
  const at::Tensor where = at::empty_like(order).scatter_(0, order, at::arange(t * top_k, order.options()));
  auto [at_, pick] = where.view({t, top_k}).sort(-1);
  const at::Tensor pair_weights = weights.gather(1, pick);
  at::Tensor out = at::zeros({t, x.size(1)}, x.options().dtype(at::kFloat));
  for (int64_t j = 0; j < top_k; ++j)
    out.add_(y.index_select(0, at_.select(1, j)).to(at::kFloat) * pair_weights.select(1, j).unsqueeze(1));
  return out.to(x.scalar_type());
}

at::Tensor decode_layers(at::Tensor h, at::Tensor x, at::TensorList wqkv, at::TensorList wo,
                         at::TensorList w13, at::TensorList w2, at::TensorList ffn_norm,
                         at::TensorList next_norm, double eps, at::TensorList ropes,
                         at::IntArrayRef rope_index, const at::Tensor& positions,
                         at::TensorList caches, at::TensorList slots, at::TensorList tables,
                         at::TensorList lens, at::IntArrayRef group, int64_t n_heads,
                         int64_t n_kv_heads, at::ArrayRef<double> scales, at::IntArrayRef windows,
                         at::TensorList bqkv, at::TensorList bo, at::TensorList q_norm,
                         at::TensorList k_norm, at::TensorList post_attn_norm,
                         at::TensorList post_ffn_norm, bool gelu, at::IntArrayRef moe,
                         at::TensorList routers, at::IntArrayRef router_rows,
                         at::TensorList expert_rows, int64_t top_k, bool norm_topk,
                         at::TensorList expert_w13, at::IntArrayRef expert_kinds13,
                         at::IntArrayRef expert_segments13, at::TensorList expert_w2,
                         at::IntArrayRef expert_kinds2, at::IntArrayRef expert_segments2,
                         at::IntArrayRef k_chunks,
                         int64_t max_rows, at::TensorList q4, at::TensorList i8,
                         at::TensorList q4q8, at::TensorList q8q8, at::TensorList qk,
                         at::IntArrayRef qk_kinds, at::IntArrayRef qk_counts,
                         const at::Tensor& lora_rows, at::IntArrayRef lora_offsets,
                         at::TensorList lora_blobs, at::TensorList lora_tables) {
  const size_t layers = wqkv.size();
  TORCH_CHECK(wo.size() == layers && w13.size() == layers && w2.size() == layers &&
                  ffn_norm.size() == layers && next_norm.size() == layers &&
                  caches.size() == layers, "one weight of each kind and one cache per layer");
  TORCH_CHECK(rope_index.size() == layers && group.size() == layers && scales.size() == layers &&
                  windows.size() == layers,
              "one RoPE table index, KV group, score scale and window per layer");
  TORCH_CHECK(slots.size() == tables.size() && lens.size() == tables.size(),
              "slots, tables and lens: one of each per KV group");
  for (size_t i = 0; i < layers; ++i)
    TORCH_CHECK(rope_index[i] >= 0 && static_cast<size_t>(rope_index[i]) < ropes.size() &&
                    group[i] >= 0 && static_cast<size_t>(group[i]) < tables.size(),
                "layer ", i, ": rope_index or group out of range");
  for (size_t g = 0; g < tables.size(); ++g)
    TORCH_CHECK(tables[g].dim() == 2 && tables[g].size(0) == h.size(0) &&
                    lens[g].numel() == h.size(0),
                "tables [B, nb] and lens [B] for the B decode rows, in every KV group");
  const auto per_layer = [&](at::TensorList list, const char* name) {
    TORCH_CHECK(list.empty() || list.size() == layers, name, ": none, or one per layer");
  };
  per_layer(bqkv, "bqkv");
  per_layer(bo, "bo");
  per_layer(q_norm, "q_norm");
  per_layer(post_attn_norm, "post_attn_norm");
  per_layer(post_ffn_norm, "post_ffn_norm");
  TORCH_CHECK(k_norm.size() == q_norm.size(), "k_norm: one per q_norm");
  TORCH_CHECK(post_ffn_norm.size() == post_attn_norm.size(), "sandwich norms: both or neither");
  TORCH_CHECK(moe.empty() || moe.size() == layers, "moe: none, or one kind per layer");
  // The experts of sparse layer s (in layer order): `n_experts` entries from s · n_experts on.
  const int64_t sparse = std::count_if(moe.begin(), moe.end(), [](int64_t k) { return k != 0; });
  TORCH_CHECK(routers.size() == static_cast<size_t>(sparse) &&
                  expert_rows.size() == routers.size(),
              "one router and one expert_rows per mixture-of-experts layer");
  const int64_t n_experts = sparse ? routers[0].size(0) : 0;
  TORCH_CHECK(expert_segments13.size() == static_cast<size_t>(sparse * n_experts) &&
                  expert_segments2.size() == expert_segments13.size() &&
                  expert_kinds13.size() == expert_w13.size() && expert_kinds2.size() == expert_w2.size(),
              "expert_segments13 / 2: one count per expert of every mixture-of-experts layer, "
              "one kind per segment");
  TORCH_CHECK(!sparse || !router_rows.empty(), "router_rows: the router's call sizes");
  std::vector<Experts> experts;
  for (int64_t sl = 0, at13 = 0, at2 = 0; sl < sparse; ++sl) {
    Experts ex{false, expert_w13, expert_w2, expert_kinds13, expert_kinds2,
               expert_segments13.slice(sl * n_experts, n_experts),
               expert_segments2.slice(sl * n_experts, n_experts), {}, {}};
    for (int64_t e = 0; e < n_experts; ++e) {
      ex.first13.push_back(at13);
      ex.first2.push_back(at2);
      at13 += ex.segments13[e];
      at2 += ex.segments2[e];
    }
    TORCH_CHECK(at13 <= static_cast<int64_t>(expert_w13.size()) &&
                    at2 <= static_cast<int64_t>(expert_w2.size()) &&
                    (sl + 1 < sparse || (at13 == static_cast<int64_t>(expert_w13.size()) &&
                                         at2 == static_cast<int64_t>(expert_w2.size()))),
                "expert_w13 / expert_w2: the segments the counts count");
    experts.push_back(ex);
  }
  for (size_t i = 0, sl = 0; i < layers && !moe.empty(); ++i) {
    if (moe[i] == 0) continue;
    TORCH_CHECK(moe[i] == 1 || moe[i] == 2, "moe: 0 (dense), 1 (Q4_K / Q6_K experts) or 2 (packed experts)");
    experts[sl++].qk = moe[i] == 1;
  }
  TORCH_CHECK(k_chunks.size() == 4, "one k chunk for each of wqkv, wo, w13, w2");
  TORCH_CHECK(q4.empty() || q4.size() == 4 * layers,
              "q4: none, or the 4-bit blocks of wqkv, wo, w13, w2 of every layer in turn");
  TORCH_CHECK(i8.empty() || i8.size() == 16 * layers,
              "i8: none, or q, scale, outliers, outlier_q of wqkv, wo, w13, w2 of every layer");
  TORCH_CHECK(q4q8.empty() || q4q8.size() == 4 * layers,
              "q4q8: none, or the Q4_1 blocks (empty: none) of wqkv, wo, w13, w2 of every layer in turn");
  TORCH_CHECK(q8q8.empty() || q8q8.size() == 4 * layers,
              "q8q8: none, or the Q8_0 blocks (empty: none) of wqkv, wo, w13, w2 of every layer in turn");
  TORCH_CHECK(qk_counts.empty() || qk_counts.size() == 4 * layers,
              "qk_counts: none, or the Q4_K / Q6_K segment count of wqkv, wo, w13, w2 of every layer");
  TORCH_CHECK(qk.size() == qk_kinds.size(), "qk: one kind per segment");
  // Where matrix `m` (4 i + kind) starts in `qk`.
  std::vector<size_t> qk_first(qk_counts.size() + 1, 0);
  for (size_t m = 0; m < qk_counts.size(); ++m) qk_first[m + 1] = qk_first[m] + qk_counts[m];
  TORCH_CHECK(qk_first.back() == qk.size(), "qk: the segments qk_counts counts");
  // Matrix 4 i + kind's tensor in a per-matrix list, or an undefined tensor where the list is empty.
  const auto of_matrix = [&](at::TensorList list, size_t i, size_t kind) {
    return list.empty() ? at::Tensor() : list[4 * i + kind];
  };
  // The Q4_K / Q6_K segments (and their kinds) of kind `kind` of layer `i`; empty: none.
  const auto k_segments = [&](size_t i, size_t kind) {
    const size_t m = 4 * i + kind;
    if (qk_counts.empty()) return at::TensorList();
    return qk.slice(qk_first[m], qk_first[m + 1] - qk_first[m]);
  };
  const auto k_kinds = [&](size_t i, size_t kind) {
    const size_t m = 4 * i + kind;
    if (qk_counts.empty()) return at::IntArrayRef();
    return qk_kinds.slice(qk_first[m], qk_first[m + 1] - qk_first[m]);
  };
  // The int8 copy (4 tensors) of kind `kind` of layer `i`, or null.
  const auto int8 = [&](size_t i, size_t kind) -> const at::Tensor* {
    return i8.empty() ? nullptr : &i8[16 * i + 4 * kind];
  };
  // Adapter rows whose pairs are in the 8-bit format (`lora_delta_`'s uint8 buffers): over a
  // `q4q8_linear` product, x's rows are rounded once for both.
  const bool lora_q8 = !lora_blobs.empty() && lora_blobs[0].scalar_type() == at::kByte;
  // y = linear(x) of kind `kind` of layer `i`, plus the adapter rows' deltas, if any.
  const auto product = [&](const at::Tensor& x, const at::Tensor& w, size_t i, size_t kind) {
    const at::Tensor q4_1 = of_matrix(q4q8, i, kind);
    const at::Tensor q8_0 = of_matrix(q8q8, i, kind);
    const bool q8_0_runs = q8_0.defined() && q8_0.numel() > 0;
    std::optional<genserve::Q8Rows> rounded;
    if (lora_q8 && !q8_0_runs && q4_1.defined() && q4_1.numel() > 0)
      rounded.emplace(genserve::q8_round_rows(x.contiguous()));
    const genserve::Q8Rows* shared = rounded ? &*rounded : nullptr;
    at::Tensor y = linear(x, w, of_matrix(q4, i, kind), k_chunks[kind], max_rows, int8(i, kind),
                          q4_1, q8_0, k_segments(i, kind), k_kinds(i, kind), shared);
    if (lora_blobs.empty()) return y;
#ifdef GENSERVE_LORA_DELTA
    genserve::lora_delta_(y, x, lora_rows, lora_offsets, lora_blobs, lora_tables,
                          static_cast<int64_t>(4 * i + kind), shared);
#else
    TORCH_CHECK(false, "decode_layers: LoRA deltas need the AVX512-BF16 build of lora_delta_");
#endif
    return y;
  };
  const int64_t rows = h.size(0);
  size_t sparse_seen = 0;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor& rope = ropes[rope_index[i]];
    const int64_t g = group[i];
    at::Tensor qkv = product(x, wqkv[i], i, 0);
    if (!bqkv.empty()) qkv = qkv + bqkv[i];
    const at::Tensor q =
        q_norm.empty()
            ? genserve::rope_store_kv(qkv, rope, positions, caches[i], slots[g], n_heads,
                                      n_kv_heads)
            : genserve::norm_rope_store_kv(qkv, q_norm[i], k_norm[i], eps, rope, positions,
                                           caches[i], slots[g], n_heads, n_kv_heads);
    const at::Tensor o = attend(q, caches[i], tables[g], lens[g], scales[i], windows[i]);
    const at::Tensor o_rows = o.reshape({rows, -1});
    at::Tensor attn_out = product(o_rows, wo[i], i, 1);
    if (!bo.empty()) attn_out = attn_out + bo[i];
    if (!post_attn_norm.empty()) attn_out = genserve::rms_norm(attn_out, post_attn_norm[i], eps);
    x = genserve::add_rms_norm_(h, attn_out, ffn_norm[i], eps);
    at::Tensor ffn_out;
    if (!moe.empty() && moe[i] != 0) {       // a mixture of experts (no adapter deltas: as in Python)
      ffn_out = moe_mlp(x, routers[sparse_seen], router_rows, expert_rows[sparse_seen], top_k,
                        norm_topk, gelu, experts[sparse_seen]);
      ++sparse_seen;
    } else {
      const at::Tensor gate_up = product(x, w13[i], i, 2);
      const at::Tensor act = gelu ? genserve::gelu_tanh_mul(gate_up) : genserve::silu_mul(gate_up);
      ffn_out = product(act, w2[i], i, 3);
    }
    if (!post_ffn_norm.empty()) ffn_out = genserve::rms_norm(ffn_out, post_ffn_norm[i], eps);
    x = genserve::add_rms_norm_(h, ffn_out, next_norm[i], eps);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor x, Tensor[] wqkv, Tensor[] wo, Tensor[] w13, "
        "Tensor[] w2, Tensor[] ffn_norm, Tensor[] next_norm, float eps, Tensor[] ropes, "
        "int[] rope_index, Tensor positions, Tensor(c!)[] caches, Tensor[] slots, Tensor[] tables, "
        "Tensor[] lens, int[] group, int n_heads, int n_kv_heads, float[] scales, int[] windows, "
        "Tensor[] bqkv, Tensor[] bo, Tensor[] q_norm, Tensor[] k_norm, Tensor[] post_attn_norm, "
        "Tensor[] post_ffn_norm, bool gelu, int[] moe, Tensor[] routers, int[] router_rows, "
        "Tensor(b!)[] expert_rows, int top_k, bool norm_topk, Tensor[] expert_w13, "
        "int[] expert_kinds13, int[] expert_segments13, Tensor[] expert_w2, int[] expert_kinds2, "
        "int[] expert_segments2, int[] k_chunks, int max_rows, Tensor[] q4, "
        "Tensor[] i8, Tensor[] q4q8, Tensor[] q8q8, Tensor[] qk, int[] qk_kinds, "
        "int[] qk_counts, Tensor lora_rows, int[] lora_offsets, Tensor[] lora_blobs, "
        "Tensor[] lora_tables) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
// The packed weights are oneDNN (MkldnnCPU) tensors, whose dispatch key wins over CPU's.
TORCH_LIBRARY_IMPL(genserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
