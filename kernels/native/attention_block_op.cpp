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

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "rows.h"

namespace {

// The heads' pass, fused (per-head norms or none): each row's query heads normalised by q_norm and rotated into q
// [T, Hq, D]; its key heads likewise, written straight to k_cache at write[t]; its value heads copied to v_cache
// there. The row loops of rms_norm and rope (rows.h), so the bits of those ops and index_copy_ one after the other,
// without their tensors and dispatches (4 ops and 2 copies cost ~35 us a layer at one row, the arithmetic ~1).
template <typename XD, typename WD>
void head_rows(const typename XD::T* qkv, int64_t ldq, const typename WD::T* qn, const typename WD::T* kn,
               const typename XD::T* cs, const typename XD::T* sn, int64_t R, typename XD::T* q,
               typename XD::T* kc, int64_t kc0, int64_t kc1, typename XD::T* vc, int64_t vc0, int64_t vc1,
               const int64_t* write, int64_t t0, int64_t t1, int64_t Hq, int64_t Hkv, int64_t D, float eps) {
    using T = typename XD::T;
    std::vector<T> normed(static_cast<size_t>(D));
    auto head = [&](const T* src, const typename WD::T* w, const T* c, const T* s, T* dst) {
        if (w != nullptr) {
            colibri_rows::norm_row<XD, WD>(src, w, normed.data(), D, eps);
            src = normed.data();
        }
        colibri_rows::rotate_head<XD>(src, c, s, dst, R / 2);
        for (int64_t i = R; i < D; ++i) dst[i] = src[i];
    };
    for (int64_t t = t0; t < t1; ++t) {
        const T* row = qkv + t * ldq;
        const T* c = cs + t * R;
        const T* s = sn + t * R;
        for (int64_t h = 0; h < Hq; ++h) head(row + h * D, qn, c, s, q + (t * Hq + h) * D);
        const int64_t slot = write[t];
        for (int64_t h = 0; h < Hkv; ++h) {
            head(row + (Hq + h) * D, kn, c, s, kc + slot * kc0 + h * kc1);
            std::memcpy(vc + slot * vc0 + h * vc1, row + (Hq + Hkv + h) * D, size_t(D) * sizeof(T));
        }
    }
}

// q [T, Hq, D] from qkv [T, (Hq + 2 Hkv) D] (contiguous), k and v written to the caches: head_rows by dtype
at::Tensor heads_pass(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                      const c10::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& write, int64_t heads,
                      int64_t kv_heads, double eps) {
    const int64_t T = qkv.size(0), D = k_cache.size(2), R = cos.size(1);
    at::Tensor c = cos.contiguous(), s = sin.contiguous();
    at::Tensor slots = write.contiguous();
    const int64_t S = std::min(k_cache.size(0), v_cache.size(0)), *ws = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)                 // as index_copy_ checks
        TORCH_CHECK(ws[t] >= 0 && ws[t] < S, "colibri::attention_block: write slot ", ws[t],
                    " is outside the cache's ", S, " slots");
    at::Tensor q = at::empty({T, heads, D}, qkv.options());
    const bool bf = qkv.scalar_type() == at::kBFloat16;
    const bool wf = q_norm.has_value() && q_norm->scalar_type() == at::kFloat;
    at::Tensor qn = q_norm.has_value() ? q_norm->contiguous() : at::Tensor();
    at::Tensor kn = k_norm.has_value() ? k_norm->contiguous() : at::Tensor();
    const int64_t rows_per_chunk = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, (heads + kv_heads) * D));
    colibri_ops::parallel_for(0, T, rows_per_chunk, [&](int64_t t0, int64_t t1) {
        const int64_t* w = slots.data_ptr<int64_t>();
        const float e = float(eps);
        if (!bf) {
            using X = colibri_rows::F32;
            head_rows<X, X>(qkv.data_ptr<float>(), qkv.stride(0), qn.defined() ? qn.data_ptr<float>() : nullptr,
                            kn.defined() ? kn.data_ptr<float>() : nullptr, c.data_ptr<float>(), s.data_ptr<float>(),
                            R, q.data_ptr<float>(), k_cache.data_ptr<float>(), k_cache.stride(0), k_cache.stride(1),
                            v_cache.data_ptr<float>(), v_cache.stride(0), v_cache.stride(1), w, t0, t1, heads,
                            kv_heads, D, e);
            return;
        }
        using X = colibri_rows::BF16;
        auto u16 = [](const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); };
        auto* cc = u16(c);
        auto* ss = u16(s);
        if (wf)
            head_rows<X, colibri_rows::F32>(u16(qkv), qkv.stride(0), qn.data_ptr<float>(), kn.data_ptr<float>(), cc,
                                            ss, R, u16(q), u16(k_cache), k_cache.stride(0), k_cache.stride(1),
                                            u16(v_cache), v_cache.stride(0), v_cache.stride(1), w, t0, t1, heads,
                                            kv_heads, D, e);
        else
            head_rows<X, X>(u16(qkv), qkv.stride(0), qn.defined() ? u16(qn) : nullptr,
                            kn.defined() ? u16(kn) : nullptr, cc, ss, R, u16(q), u16(k_cache), k_cache.stride(0),
                            k_cache.stride(1), u16(v_cache), v_cache.stride(0), v_cache.stride(1), w, t0, t1, heads,
                            kv_heads, D, e);
    });
    return q;
}

// Whether the fused heads' pass takes this block: per-head norms (or none) of x's dtype or float32 (both or neither),
// cos / sin in x's dtype, rotary dims even and within the head, caches of x's dtype with contiguous heads.
bool heads_fusable(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                   const c10::optional<at::Tensor>& k_norm, bool full_qk_norm, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& write, int64_t kv_heads) {
    const auto xt = qkv.scalar_type();
    if ((xt != at::kFloat && xt != at::kBFloat16) || !qkv.is_contiguous() || cos.scalar_type() != xt ||
        sin.scalar_type() != xt || cos.dim() != 2 || sin.sizes() != cos.sizes() || cos.size(0) != qkv.size(0) ||
        write.scalar_type() != at::kLong || k_cache.scalar_type() != xt || v_cache.scalar_type() != xt ||
        v_cache.dim() != 3 || k_cache.size(1) != kv_heads || v_cache.size(1) != kv_heads ||
        v_cache.size(2) != k_cache.size(2) || k_cache.stride(2) != 1 || v_cache.stride(2) != 1 ||
        !k_cache.is_non_overlapping_and_dense() || !v_cache.is_non_overlapping_and_dense())
        return false;                               // (index_copy_ checks and refuses what these rule out)
    const int64_t D = k_cache.size(2), R = cos.size(1);
    if (R > D || R % 2 != 0) return false;
    if (!q_norm.has_value()) return true;
    if (full_qk_norm || q_norm->dim() != 1 || q_norm->size(0) != D || k_norm->dim() != 1 || k_norm->size(0) != D ||
        q_norm->scalar_type() != k_norm->scalar_type())
        return false;
    const auto wt = q_norm->scalar_type();
    return wt == xt || wt == at::kFloat;
}

// The same op by op (full-width q/k norms, and what heads_fusable leaves out): q [T, Hq, D], the caches written by
// index_copy_ (which checks them).
at::Tensor heads_ops(const at::Tensor& qkv, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, bool full_qk_norm, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& write,
                     int64_t heads, int64_t kv_heads, double eps) {
    const int64_t T = qkv.size(0), D = k_cache.size(2), qs = heads * D, ks = kv_heads * D;
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
    return q;
}

at::Tensor with_bias(const at::Tensor& y, const c10::optional<at::Tensor>& b) {   // as torch's `y + bias`
    return b.has_value() ? at::add(y, *b) : y;
}

}  // namespace

namespace colibri_ops {

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
    at::Tensor q = heads_fusable(qkv, q_norm, k_norm, full_qk_norm, cos, sin, k_cache, v_cache, write, kv_heads)
                       ? heads_pass(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, write, heads, kv_heads, eps)
                       : heads_ops(qkv, q_norm, k_norm, full_qk_norm, cos, sin, k_cache, v_cache, write, heads,
                                   kv_heads, eps);                                           // [T, Hq, D]
    at::Tensor out = colibri_ops::decode_attention(q, k_cache, v_cache, slots, lens, sinks,
                                                   std::pow(double(D), -0.5));               // [T, Hq, D]
    return with_bias(colibri_ops::linear(out.reshape({T, heads * D}), w_o, c10::nullopt, false), b_o);   // [T, H]
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("attention_block(Tensor h, Tensor ln1, Tensor w_qkv, Tensor? b_qkv, Tensor? q_norm, Tensor? k_norm, "
          "bool full_qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write, "
          "Tensor slots, Tensor lens, Tensor? sinks, Tensor w_o, Tensor? b_o, int heads, int kv_heads, float eps) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("attention_block", &colibri_ops::attention_block); }
