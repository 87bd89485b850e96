// colibri::rms_norm: transformers' RMSNorm in one call (its half-dozen torch ops cost more than the arithmetic at
// the few rows of a decode step).
//
//   rms_norm(x [..., H], w [H], eps) -> [..., H] in x's dtype
//
// Each row: r = 1 / sqrt(mean(x²) + eps) in float32, the mean from a float64 sum of the squares (exact products; 8
// running sums, element h into sum h % 8, added in one fixed order) rounded once (so it is the same on every ISA and
// thread split; torch's float32 sum may differ from it in the last bit), then
//   float32 x:            w · (x · r)
//   bf16 x, float32 w:    bf16(w · (x · r))            (GPT-OSS's norms, kept in float32)
//   bf16 x, bf16 w:       bf16(w · bf16(x · r))         (transformers: the cast, then the scale)
// A row is computed by one thread; rows split across threads only where there are many.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "rows.h"
#include "ops.h"
#include "pool.h"

#include <cmath>

namespace {

using colibri_rows::BF16;
using colibri_rows::F32;

template <typename XD, typename WD>
void rows(const typename XD::T* x, const typename WD::T* w, typename XD::T* out, int64_t r0, int64_t r1, int64_t H,
          float eps) {
    for (int64_t r = r0; r < r1; ++r) {
        colibri_rows::norm_row<XD, WD>(x + r * H, w, out + r * H, H, eps);
    }
}

}  // namespace

namespace colibri_ops {

namespace {
uint16_t* raw(const at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }   // a bf16 tensor's bits
}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    const char* op = "colibri::rms_norm";
    TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && x.size(-1) == w.size(0), op, ": need x [..., H] and w [H], got ",
                x.sizes(), " and ", w.sizes());
    const auto xt = x.scalar_type(), wt = w.scalar_type();
    TORCH_CHECK((xt == at::kFloat || xt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16), op,
                ": x and w must be float32 or bfloat16, got ", xt, " and ", wt);
    TORCH_CHECK(!(xt == at::kFloat && wt == at::kBFloat16), op, ": a bfloat16 weight on float32 activations is "
                "not a form the models use");
    const int64_t H = x.size(-1);
    at::Tensor xc = x.contiguous(), wc = w.contiguous();
    at::Tensor out = at::empty_like(xc);
    const int64_t T = H ? xc.numel() / H : 0;
    if (T == 0) return out;
    const float e = float(eps);
    const int64_t rows_per_chunk = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, H));
    colibri_ops::parallel_for(0, T, rows_per_chunk, [&](int64_t r0, int64_t r1) {
        if (xt == at::kFloat)
            rows<F32, F32>(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), r0, r1, H, e);
        else if (wt == at::kFloat)
            rows<BF16, F32>(raw(xc), wc.data_ptr<float>(), raw(out), r0, r1, H, e);
        else
            rows<BF16, BF16>(raw(xc), raw(wc), raw(out), r0, r1, H, e);
    });
    return out;
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) { m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("rms_norm", &colibri_ops::rms_norm); }
