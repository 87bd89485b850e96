// colibri::rope: rotary embedding of one step's heads in one call (torch needs a slice, a negation, two concats,
// two products and a sum per tensor), with torch's roundings: every product and the sum are rounded to x's dtype
// (no fused multiply-add), so the result has the bits of layers.apply_rope's torch ops.
//
//   rope(x [T, heads, D], cos [T, R], sin [T, R]) -> [T, heads, D] contiguous, x's dtype (float32 or bf16)
//
// The first R <= D dims of each head rotate (i < R/2 pairs with i + R/2, rotate_half's layout), the rest pass.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "rows.h"
#include "ops.h"
#include "pool.h"

namespace {

using colibri_rows::BF16;
using colibri_rows::F32;
using colibri_rows::rotate_head;

template <typename D_>
void rotate(const typename D_::T* x, int64_t sx0, int64_t sx1, const typename D_::T* cs, const typename D_::T* sn,
            typename D_::T* out, int64_t t0, int64_t t1, int64_t heads, int64_t D, int64_t R) {
    using T = typename D_::T;
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            const T* xr = x + t * sx0 + h * sx1;
            T* o = out + (t * heads + h) * D;
            rotate_head<D_>(xr, cs + t * R, sn + t * R, o, R / 2);
            for (int64_t i = R; i < D; ++i) o[i] = xr[i];
        }
}

}  // namespace

namespace colibri_ops {

namespace {
uint16_t* raw(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }   // a bf16 tensor's bits
}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const char* op = "colibri::rope";
    TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0), op,
                ": need x [T, heads, D], cos and sin [T, R], got ", x.sizes(), ", ", cos.sizes(), ", ", sin.sizes());
    const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), R = cos.size(1);
    TORCH_CHECK(R <= D && R % 2 == 0, op, ": the rotary dims R=", R, " must be even and at most the head dim ", D);
    TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                op, ": x, cos and sin must share one dtype, float32 or bfloat16, got ", x.scalar_type(), ", ",
                cos.scalar_type(), ", ", sin.scalar_type());
    at::Tensor xs = x.stride(2) == 1 ? x : x.contiguous();          // rows and heads may be strided (a split)
    at::Tensor c = cos.contiguous(), s = sin.contiguous();
    at::Tensor out = at::empty({T, heads, D}, x.options());
    if (out.numel() == 0) return out;
    const int64_t rows_per_chunk = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, heads * D));
    colibri_ops::parallel_for(0, T, rows_per_chunk, [&](int64_t t0, int64_t t1) {
        if (x.scalar_type() == at::kFloat)
            rotate<F32>(xs.data_ptr<float>(), xs.stride(0), xs.stride(1), c.data_ptr<float>(), s.data_ptr<float>(),
                        out.data_ptr<float>(), t0, t1, heads, D, R);
        else
            rotate<BF16>(raw(xs), xs.stride(0), xs.stride(1), raw(c), raw(s), raw(out), t0, t1, heads, D, R);
    });
    return out;
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("rope", &colibri_ops::rope); }
