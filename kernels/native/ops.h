// What the torch-side translation units share: the entry points of the ISA level in force (ops.cpp picks it)
// and the pieces of the linear that the expert side (moe_op.cpp) reuses.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
// colibri_linear_<ISA> and colibri_linear_i8_<ISA> (gemm.h)
typedef void (*linear_fn)(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                          const void*, int64_t);
typedef void (*linear_i8_fn)(const int8_t*, const float*, int, int, int, const int8_t*, const float*, int, int, float*,
                             int, const void*, int64_t);
// colibri_linear_bf16_<ISA> (amx.h at the amx level, dpbf16.h at avx512bf16; none below): bf16 x [M, K] against bf16
// w with the level's bf16 products, rows o0..o1
typedef void (*linear_bf16_fn)(const uint16_t*, int, int, const uint16_t*, int, int, float*, int, const void*, int64_t);
// colibri_linear_i8w_bf16_amx (amx.h, the amx level only): bf16 x [M, K] against weight-only int8 w (row scales)
// widened to bf16 on tiles, rows o0..o1
typedef void (*linear_i8w_bf16_fn)(const uint16_t*, int, int, const int8_t*, const float*, int, int, float*, int,
                                   const void*, int64_t);
// colibri_quantize_row_<ISA> (gemm.h): a W8A8 activation row to int8 [K] and its scale
typedef void (*quantize_fn)(const float*, int64_t, int8_t*, float*);
// colibri_decode_attention_<ISA> (attention.h)
typedef void (*attention_fn)(const float*, int, int, int, const void*, const void*, int, int64_t, int64_t,
                             const int64_t*, int, const float*, float, float*, float*);
}

namespace colibri_ops {
attention_fn attention_kernel();   // the level in force's decode attention
linear_fn linear_kernel();         // its small-M linear (float32, bf16, int8 weights)
linear_i8_fn linear_i8_kernel();   // its W8A8 linear
linear_bf16_fn linear_bf16_kernel();   // its bf16 x bf16 linear (bf16 products), or null where it has none

constexpr int64_t BLOCK = 32;      // output rows a task computes (gemm.h streams its weight bytes once)
int64_t grain(int64_t rows, int64_t k);   // blocks a task takes: at least ~256K multiply-adds

constexpr int64_t KPAD = 32;       // W8A8 activation rows are zero-padded to a multiple of this

// W8A8 activations: float32 rows [n, K] -> int8 [n, Kp] (zero-padded to a multiple of KPAD) and a float32 scale per
// row, as kernels/formats/int8.py quantize_rows: scale = max(max|x| / 127, FLT_MIN), q = round-half-even(x / scale)
// in [-127, 127].
struct Quantized {
    std::vector<int8_t> q;
    std::vector<float> scale;
    int64_t Kp = 0;
};
Quantized quantize_rows(const float* x, int64_t n, int64_t K);
Quantized quantized(int64_t n, int64_t K);                            // n zero rows of K, to be quantised into
void quantize_row(const float* row, int64_t K, int8_t* q, float* scale);   // one row (the pad left as it is)

// The ops' implementations, for ops built of them (attention_block_op.cpp): the same functions the registered
// ops run, called without the dispatcher.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, bool w8a8,
                  bool tiles = false);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                            const at::Tensor& lens, const c10::optional<at::Tensor>& sinks, double scale);
at::Tensor attention_block(const at::Tensor& h, const at::Tensor& ln1, const at::Tensor& w_qkv,
                           const c10::optional<at::Tensor>& b_qkv, const c10::optional<at::Tensor>& q_norm,
                           const c10::optional<at::Tensor>& k_norm, bool full_qk_norm, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& write,
                           const at::Tensor& slots, const at::Tensor& lens, const c10::optional<at::Tensor>& sinks,
                           const at::Tensor& w_o, const c10::optional<at::Tensor>& b_o, int64_t heads,
                           int64_t kv_heads, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& ln,
                                                       const at::Tensor& gate, double eps,
                                                       const c10::optional<at::Tensor>& bias, int64_t k, int64_t scoring,
                                                       bool renormalize, int64_t num_groups, int64_t topk_groups,
                                                       int64_t group_score, double scaling);
void moe_blocks_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                 const at::Tensor& local, int64_t w13_id, int64_t w2_id, const c10::optional<at::Tensor>& b13,
                 const c10::optional<at::Tensor>& b2, double alpha, c10::optional<double> limit, double up_offset,
                 bool w8a8);
// combine_replies' sum (combine_op.cpp) into `out` [T, H] in dtype, each reply's compute_ms and (where asked) its
// instance; false where the Python path must take the replies
bool combine_into(at::TensorList payloads, at::TensorList rows, int64_t T, int64_t H, at::ScalarType dtype,
                  at::Tensor& out, std::vector<double>& ms, std::vector<std::string>* instances);
std::tuple<at::Tensor, int64_t, double> expert_answer(
    const at::Tensor& payload, int64_t x_dtype, int64_t H, int64_t E, bool explicit_pairs, const at::Tensor& local,
    int64_t w13, int64_t w2, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha,
    c10::optional<double> limit, double up_offset, bool w8a8, c10::string_view instance);
}  // namespace colibri_ops
