// What the torch-side translation units share: the entry points of the ISA level in force (ops.cpp picks it).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

extern "C" {
// colibri_decode_attention_<ISA> (attention.h)
typedef void (*attention_fn)(const float*, int, int, int, const void*, const void*, int, int64_t, int64_t,
                             const int64_t*, int, const float*, float, float*, float*);
}

namespace colibri_ops {
attention_fn attention_kernel();   // the level in force's decode attention

// The ops' implementations, for ops built of them (attention_block_op.cpp): the same functions the registered
// ops run, called without the dispatcher.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, bool w8a8);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, double scale);
}  // namespace colibri_ops
