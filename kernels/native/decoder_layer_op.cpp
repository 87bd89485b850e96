// colibri::decoder_layer: a decode step's whole MoE decoder layer in one call, for experts in the router's own
// process (the in-process engine): the calls the router's Python makes one by one, in the same order with the same
// roundings, so the result has their bits:
//
//   h1 = h + attention_block(h, ...)          (attention_block_op.cpp)
//   r, weights, ids = moe_route(h1, ln2, gate, ...)   (route_op.cpp)
//   acc = 0 (float64) ; moe_blocks_(acc, r, ids, weights, local, w13, w2, ...)   (moe_op.cpp)
//   h2 = h1 + acc.to(h's dtype)
//
//   decoder_layer(<attention_block's arguments>, ln2 [H], gate [E, H], gate_bias?, <moe_route's routing>,
//                 local [E], w13, w2, b13?, b2?, alpha, limit?, up_offset, w8a8) -> (h2 [T, H], ids [T, k])
//
// What it saves is the Python between those calls (three ops' argument lists, the experts' call chain, two adds),
// ~0.1 ms a layer at one row on the 2-core VMs, where that Python runs on caches the weights' stream flushed.
//
// colibri::decoder_front: the same layer's front, for experts elsewhere (a fleet's router, or shared experts beside
// the routed ones): h1 and moe_route's three results, the experts left to the caller.
//
//   decoder_front(<attention_block's arguments>, ln2 [H], gate [E, H], gate_bias?, <moe_route's routing>)
//       -> (h1 [T, H], r [T, H], weights [T, k] float32, ids [T, k] int64)
//
// colibri::decoder_front_sum: the front of a fleet router's next layer with the last layer's sum first, the workers'
// replies combined (combine_op.cpp) and added to h, the bits of combine_replies, `h + out` and decoder_front:
//
//   decoder_front_sum(payloads [P] uint8, rows [P], <decoder_front's arguments>)
//       -> (h1, r, weights, ids, each reply's compute_ms [P])
//
// Empty results (h1 with no elements) where combine_replies would decline the replies, before anything is written
// (the KV cache included): the caller then combines them on the Python path and calls decoder_front. What it saves
// is two calls a layer (the combine and the add), each tens of µs on caches the workers' weights have just flushed.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace colibri_ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decoder_front(
    const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& w_qkv, const c10::optional<at::Tensor>& b_qkv,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, bool full_qk_norm,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write,
    const at::Tensor& slots, const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, const at::Tensor& w_o,
    const c10::optional<at::Tensor>& b_o, int64_t heads, int64_t kv_heads, double eps, const at::Tensor& ln2,
    const at::Tensor& gate, const c10::optional<at::Tensor>& gate_bias, int64_t k, int64_t scoring,
    bool renormalize, int64_t num_groups, int64_t topk_groups, int64_t group_score, double scaling) {
    at::Tensor h1 = at::add(h, attention_block(h, ln1, w_qkv, b_qkv, q_norm, k_norm, full_qk_norm, cos, sin,
                                               k_cache, v_cache, write, slots, lens, sinks, w_o, b_o, heads,
                                               kv_heads, eps));                                  // [T, H]
    auto [r, weights, ids] = moe_route(h1, ln2, gate, eps, gate_bias, k, scoring, renormalize, num_groups,
                                       topk_groups, group_score, scaling);                 // [T, H], [T, k] x 2
    return {h1, r, weights, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, std::vector<double>> decoder_front_sum(
    at::TensorList payloads, at::TensorList rows,
    const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& w_qkv, const c10::optional<at::Tensor>& b_qkv,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, bool full_qk_norm,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write,
    const at::Tensor& slots, const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, const at::Tensor& w_o,
    const c10::optional<at::Tensor>& b_o, int64_t heads, int64_t kv_heads, double eps, const at::Tensor& ln2,
    const at::Tensor& gate, const c10::optional<at::Tensor>& gate_bias, int64_t k, int64_t scoring,
    bool renormalize, int64_t num_groups, int64_t topk_groups, int64_t group_score, double scaling) {
    TORCH_CHECK(h.dim() == 2, "colibri::decoder_front_sum: h is [T, H]");
    at::Tensor sum;                                                                              // [T, H]
    std::vector<double> ms;
    if (payloads.empty() || payloads.size() != rows.size() || h.size(0) == 0 || h.size(1) == 0 ||
        !combine_into(payloads, rows, h.size(0), h.size(1), h.scalar_type(), sum, ms, nullptr)) {
        const at::Tensor none = at::empty({0}, h.options());
        return {none, none, none, none, std::vector<double>()};
    }
    auto [h1, r, weights, ids] = decoder_front(at::add(h, sum), ln1, w_qkv, b_qkv, q_norm, k_norm, full_qk_norm, cos,
                                               sin, k_cache, v_cache, write, slots, lens, sinks, w_o, b_o, heads,
                                               kv_heads, eps, ln2, gate, gate_bias, k, scoring, renormalize,
                                               num_groups, topk_groups, group_score, scaling);
    return {h1, r, weights, ids, std::move(ms)};
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& w_qkv, const c10::optional<at::Tensor>& b_qkv,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, bool full_qk_norm,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write,
    const at::Tensor& slots, const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, const at::Tensor& w_o,
    const c10::optional<at::Tensor>& b_o, int64_t heads, int64_t kv_heads, double eps, const at::Tensor& ln2,
    const at::Tensor& gate, const c10::optional<at::Tensor>& gate_bias, int64_t k, int64_t scoring,
    bool renormalize, int64_t num_groups, int64_t topk_groups, int64_t group_score, double scaling,
    const at::Tensor& local, int64_t w13, int64_t w2, const c10::optional<at::Tensor>& b13,
    const c10::optional<at::Tensor>& b2, double alpha, c10::optional<double> limit, double up_offset, bool w8a8) {
    auto [h1, r, weights, ids] = decoder_front(h, ln1, w_qkv, b_qkv, q_norm, k_norm, full_qk_norm, cos, sin, k_cache,
                                               v_cache, write, slots, lens, sinks, w_o, b_o, heads, kv_heads, eps,
                                               ln2, gate, gate_bias, k, scoring, renormalize, num_groups,
                                               topk_groups, group_score, scaling);   // [T, H] x 2, [T, k] x 2
    at::Tensor acc = at::zeros(r.sizes(), r.options().dtype(at::kDouble));                   // [T, H]
    moe_blocks_(acc, r, ids, weights, local, w13, w2, b13, b2, alpha, limit, up_offset, w8a8);
    return {at::add(h1, acc.to(h.scalar_type())), ids};
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("decoder_layer(Tensor h, Tensor ln1, Tensor w_qkv, Tensor? b_qkv, Tensor? q_norm, Tensor? k_norm, "
          "bool full_qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write, "
          "Tensor slots, Tensor lens, Tensor? sinks, Tensor w_o, Tensor? b_o, int heads, int kv_heads, float eps, "
          "Tensor ln2, Tensor gate, Tensor? gate_bias, int k, int scoring, bool renormalize, int num_groups, "
          "int topk_groups, int group_score, float scaling, Tensor local, int w13, int w2, Tensor? b13, "
          "Tensor? b2, float alpha, float? limit, float up_offset, bool w8a8) -> (Tensor, Tensor)");
    m.def("decoder_front(Tensor h, Tensor ln1, Tensor w_qkv, Tensor? b_qkv, Tensor? q_norm, Tensor? k_norm, "
          "bool full_qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write, "
          "Tensor slots, Tensor lens, Tensor? sinks, Tensor w_o, Tensor? b_o, int heads, int kv_heads, float eps, "
          "Tensor ln2, Tensor gate, Tensor? gate_bias, int k, int scoring, bool renormalize, int num_groups, "
          "int topk_groups, int group_score, float scaling) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("decoder_front_sum(Tensor[] payloads, Tensor[] rows, Tensor h, Tensor ln1, Tensor w_qkv, Tensor? b_qkv, "
          "Tensor? q_norm, Tensor? k_norm, bool full_qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor write, Tensor slots, Tensor lens, Tensor? sinks, Tensor w_o, Tensor? b_o, "
          "int heads, int kv_heads, float eps, Tensor ln2, Tensor gate, Tensor? gate_bias, int k, int scoring, "
          "bool renormalize, int num_groups, int topk_groups, int group_score, float scaling) "
          "-> (Tensor, Tensor, Tensor, Tensor, float[])");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
    m.impl("decoder_layer", &colibri_ops::decoder_layer);
    m.impl("decoder_front", &colibri_ops::decoder_front);
    m.impl("decoder_front_sum", &colibri_ops::decoder_front_sum);
}
