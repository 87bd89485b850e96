// colibri::decode_attention: each decode query against its context's keys and values where the paged KV cache
// holds them (no gather copies, no padded keys read), on torch's thread pool, one task per sequence and KV head;
// the kernel and its numerics: attention.h, compiled per ISA level (ops.cpp picks the level).
//
//   decode_attention(q [B, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], slots [B, C] int64, lens [B] int64,
//                    sinks [Hq]?, scale) -> [B, Hq, Dv] in q's dtype
//
// Row b attends to the keys at slots[b, :lens[b]]; the rest of its row is padding and is never read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "ops.h"
#include "pool.h"

namespace {

}  // namespace

namespace colibri_ops {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, double scale) {
    const char* op = "colibri::decode_attention";
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op, ": need q [B, Hq, D], k [S, Hkv, D] and v "
                "[S, Hkv, Dv], got ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
    const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1), Dv = v.size(2);
    TORCH_CHECK(k.size(2) == D && v.size(0) == S && v.size(1) == Hkv, op, ": k must be [S, Hkv, D=", D,
                "] and v [S, Hkv, Dv], got ", k.sizes(), " and ", v.sizes());
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, ": the query heads (", Hq, ") must be a multiple of the KV heads (",
                Hkv, ")");
    TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
                op, ": the cache must be float32 or bfloat16, got ", k.scalar_type(), " and ", v.scalar_type());
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), op, ": the cache must be contiguous");
    TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == at::kLong, op,
                ": slots must be int64 [B=", B, ", C], got ", slots.scalar_type(), " ", slots.sizes());
    TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong, op,
                ": lens must be int64 [B=", B, "], got ", lens.scalar_type(), " ", lens.sizes());
    at::Tensor sl = slots.contiguous(), ln = lens.contiguous();
    const int64_t C = sl.size(1);
    const int64_t* sp = sl.data_ptr<int64_t>();
    const int64_t* lp = ln.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(lp[b] >= 1 && lp[b] <= C, op, ": lens[", b, "] = ", lp[b], " must be in [1, ", C, "]");
        for (int64_t j = 0; j < lp[b]; ++j)
            TORCH_CHECK(sp[b * C + j] >= 0 && sp[b * C + j] < S, op, ": slot ", sp[b * C + j], " (row ", b,
                        ") is outside the cache's ", S, " slots");
    }
    at::Tensor sk;
    if (sinks.has_value()) {
        TORCH_CHECK(sinks->numel() == Hq, op, ": sinks must hold one logit per query head (", Hq, "), got ",
                    sinks->sizes());
        sk = sinks->to(at::kFloat).contiguous();
    }
    at::Tensor qf = q.to(at::kFloat).contiguous();                                  // [B, Hq, D]
    at::Tensor out = at::empty({B, Hq, Dv}, q.options().dtype(at::kFloat));         // [B, Hq, Dv]
    if (B == 0 || Hq == 0) return out.to(q.scalar_type());
    const int R = int(Hq / Hkv);
    const int kvtype = k.scalar_type() == at::kFloat ? 0 : 1;
    const int64_t es = k.element_size();
    const char* kb = static_cast<const char*>(k.data_ptr());
    const char* vb = static_cast<const char*>(v.data_ptr());
    const float* qp = qf.data_ptr<float>();
    const float* skp = sk.defined() ? sk.data_ptr<float>() : nullptr;
    float* op_ = out.data_ptr<float>();
    attention_fn fn = colibri_ops::attention_kernel();
    int64_t keys = 0;                          // the work, so a short one stays on this thread (a wake costs more)
    for (int64_t b = 0; b < B; ++b) keys += lp[b];
    const int64_t per_task = std::max<int64_t>(1, keys / B * R * (D + Dv));
    const int64_t tasks_per_chunk = std::max<int64_t>(1, (int64_t(1) << 17) / per_task);
    colibri_ops::parallel_for(0, B * Hkv, tasks_per_chunk, [&](int64_t t0, int64_t t1) {
        std::vector<float> scratch;              // [R, n] scores, then weights; [8, D] a key group widened, then
        for (int64_t t = t0; t < t1; ++t) {      // [4, Dv] the value pass's accumulators
            const int64_t b = t / Hkv, g = t % Hkv, n = lp[b];
            scratch.resize(R * n + std::max<int64_t>(8 * D, 4 * Dv));
            fn(qp + (b * Hq + g * R) * D, R, int(D), int(Dv), kb + g * D * es, vb + g * Dv * es, kvtype, Hkv * D,
               Hkv * Dv, sp + b * C, int(n), skp ? skp + g * R : nullptr, float(scale), op_ + (b * Hq + g * R) * Dv,
               scratch.data());
        }
    });
    return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lens, Tensor? sinks, float scale) "
          "-> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("decode_attention", &colibri_ops::decode_attention); }
