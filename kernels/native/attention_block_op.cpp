// colibri::attention_block: a decode step's whole attention block in one call, the ops the router's Python path
// runs one by one (router_service/model.py `_qkv` and router_service/attention.py), in the same order with the
// same roundings, so the result has their bits:
//
//   x = rms_norm(h, ln1) ; qkv = linear(x, W_qkv) (+ b_qkv) ; q, k, v = split ; q/k norms (per head or over all
//   heads) ; rope(q), rope(k) ; k, v written to the cache at this step's slots ; decode attention of q over each
//   row's context slots ; linear(out, W_o) (+ b_o)
//
//   attention_block(h [T, H], ln1 [H], w_qkv [(Hq + 2 Hkv) D, H], b_qkv?, q_norm?, k_norm?, full_qk_norm, cos [T, R],
//                   sin [T, R], k_cache [S, Hkv, D], v_cache [S, Hkv, D], write [T], slots [T, C], lens [T], sinks?,
//                   w_o [H, Hq D], b_o?, heads, kv_heads, eps) -> [T, H]
//
// Every row decodes (one new token per sequence). The Python path stays for prefills, latent attention, clipped
// qkv, int8 weights and batch invariance.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>

#include "ops.h"

namespace {

at::Tensor with_bias(const at::Tensor& y, const c10::optional<at::Tensor>& b) {   // as torch's `y + bias`
    return b.has_value() ? at::add(y, *b) : y;
}

at::Tensor attention_block(const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& w_qkv,
                           const c10::optional<at::Tensor>& b_qkv, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, bool full_qk_norm, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write,
                           const at::Tensor& slots, const at::Tensor& lens, const c10::optional<at::Tensor>& sinks,
                           const at::Tensor& w_o, const c10::optional<at::Tensor>& b_o, int64_t heads,
                           int64_t kv_heads, double eps) {
    const char* op = "colibri::attention_block";
    TORCH_CHECK(h.dim() == 2 && k_cache.dim() == 3 && heads > 0 && kv_heads > 0, op,
                ": need h [T, H], a cache [S, Hkv, D] and positive head counts, got h ", h.sizes(), ", cache ",
                k_cache.sizes(), ", ", heads, " heads and ", kv_heads, " KV heads");
    const int64_t T = h.size(0), D = k_cache.size(2);
    TORCH_CHECK(w_qkv.dim() == 2 && w_qkv.size(0) == (heads + 2 * kv_heads) * D, op, ": w_qkv must have (heads + 2 "
                "kv_heads) x D = ", (heads + 2 * kv_heads) * D, " rows, got ", w_qkv.sizes());
    TORCH_CHECK(write.dim() == 1 && write.size(0) == T, op, ": write must hold one slot per row (", T, ")");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), op, ": q_norm and k_norm come together");
    at::Tensor x = colibri_ops::rms_norm(h, ln1, eps);                                        // [T, H]
    at::Tensor qkv = with_bias(colibri_ops::linear(x, w_qkv, c10::nullopt, false), b_qkv);   // [T, (Hq + 2Hkv) D]
    const int64_t qs = heads * D, ks = kv_heads * D;
    at::Tensor q = qkv.narrow(1, 0, qs), k = qkv.narrow(1, qs, ks), v = qkv.narrow(1, qs + ks, ks);
    if (q_norm.has_value() && full_qk_norm) {
        q = colibri_ops::rms_norm(q, *q_norm, eps);
        k = colibri_ops::rms_norm(k, *k_norm, eps);
    }
    q = q.reshape({T, heads, D});                                                            // [T, Hq, D]
    k = k.reshape({T, kv_heads, D});                                                         // [T, Hkv, D]
    v = v.reshape({T, kv_heads, D});
    if (q_norm.has_value() && !full_qk_norm) {
        q = colibri_ops::rms_norm(q, *q_norm, eps);
        k = colibri_ops::rms_norm(k, *k_norm, eps);
    }
    q = colibri_ops::rope(q, cos, sin);
    k = colibri_ops::rope(k, cos, sin);
    k_cache.index_copy_(0, write, k);
    v_cache.index_copy_(0, write, v);
    at::Tensor out = colibri_ops::decode_attention(q, k_cache, v_cache, slots, lens, sinks,
                                                   std::pow(double(D), -0.5));               // [T, Hq, D]
    return with_bias(colibri_ops::linear(out.reshape({T, heads * D}), w_o, c10::nullopt, false), b_o);   // [T, H]
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("attention_block(Tensor h, Tensor ln1, Tensor w_qkv, Tensor? b_qkv, Tensor? q_norm, Tensor? k_norm, "
          "bool full_qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write, "
          "Tensor slots, Tensor lens, Tensor? sinks, Tensor w_o, Tensor? b_o, int heads, int kv_heads, float eps) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("attention_block", &attention_block); }
