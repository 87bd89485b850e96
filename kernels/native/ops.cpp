// Colibri's native CPU kernels as torch ops (torch.ops.colibri.*), one entry per ISA level chosen at load by
// CPUID (COLIBRI_CPU_ISA=generic|avx2|avx512|avx512bf16|amx overrides, refusing a level this CPU lacks), run on
// their own thread pool (pool.h: at::parallel_for's chunks, workers that spin between a step's ops), as many
// threads as torch.set_num_threads gives torch.
//
//   linear(x [M, K], w [Dout, K], scale [Dout]?) -> [M, Dout] bf16 for bf16 x (one rounding), else float32
//                                                                            (w float32 | bf16 | int8)
//     bf16 x against bf16 w takes the level's bf16 products where it has them (AMX tiles; AVX512-BF16's
//     VDPBF16PS, dpbf16.h); with `tiles`, bf16 x against weight-only int8 w too where the level has AMX tiles
//     (widened to bf16 per block; the tiles' order of sums, so a form of its own)
//   isa() -> str; use_isa(str) -> str (the level now in force)
//
// The expert side of a layer (expert_blocks, moe_blocks_, moe_sum_) is moe_op.cpp's, over the kernels of the level
// picked here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "bf16.h"
#include "ops.h"
#include "pool.h"

#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

extern "C" {
void colibri_linear_generic(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                            const void*, int64_t);
#define CK_DECLARE_ATT(name) void name(const float*, int, int, int, const void*, const void*, int, int64_t, int64_t, \
                                       const int64_t*, int, const float*, float, float*, float*);
CK_DECLARE_ATT(colibri_decode_attention_generic)
#define CK_DECLARE_I8(name) void name(const int8_t*, const float*, int, int, int, const int8_t*, const float*, int, int, \
                                      float*, int, const void*, int64_t);
CK_DECLARE_I8(colibri_linear_i8_generic)
void colibri_quantize_row_generic(const float*, int64_t, int8_t*, float*);
#if defined(__x86_64__)
void colibri_quantize_row_avx2(const float*, int64_t, int8_t*, float*);
void colibri_quantize_row_avx512(const float*, int64_t, int8_t*, float*);
void colibri_quantize_row_avx512bf16(const float*, int64_t, int8_t*, float*);
CK_DECLARE_I8(colibri_linear_i8_avx2)
CK_DECLARE_ATT(colibri_decode_attention_avx2)
CK_DECLARE_ATT(colibri_decode_attention_avx512)
CK_DECLARE_ATT(colibri_decode_attention_avx512bf16)
CK_DECLARE_I8(colibri_linear_i8_avx512)
CK_DECLARE_I8(colibri_linear_i8_avx512bf16)
void colibri_linear_avx2(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                         const void*, int64_t);
void colibri_linear_avx512(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                           const void*, int64_t);
void colibri_linear_avx512bf16(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                               const void*, int64_t);
void colibri_linear_bf16_avx512bf16(const uint16_t*, int, int, const uint16_t*, int, int, float*, int, const void*,
                                    int64_t);
void colibri_quantize_row_amx(const float*, int64_t, int8_t*, float*);
CK_DECLARE_ATT(colibri_decode_attention_amx)
CK_DECLARE_I8(colibri_linear_i8_tiles_amx)
void colibri_linear_amx(const float*, int, int, const void*, int, const float*, int, int, float*, int, const void*,
                        int64_t);
void colibri_linear_bf16_amx(const uint16_t*, int, int, const uint16_t*, int, int, float*, int, const void*, int64_t);
void colibri_linear_i8w_bf16_amx(const uint16_t*, int, int, const int8_t*, const float*, int, int, float*, int,
                                 const void*, int64_t);
#endif
}

namespace {

using colibri_ops::BLOCK;
using colibri_ops::grain;
using colibri_ops::Quantized;
using colibri_ops::quantize_rows;

struct Level {
    const char* name;
    linear_fn linear;
    linear_i8_fn linear_i8;                    // W8A8: int8 activations against int8 weights
    attention_fn attention;                    // decode attention over the paged KV cache
    quantize_fn quantize_row;                  // W8A8: one activation row to int8 and its scale
    bool (*supported)();
    linear_bf16_fn linear_bf16 = nullptr;      // bf16 x bf16 products (AMX tiles, AVX512-BF16 dot products)
    linear_i8w_bf16_fn linear_i8w_bf16 = nullptr;   // bf16 x against int8 weights widened to bf16, on tiles
};

bool always() { return true; }
#if defined(__x86_64__)
bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
bool has_avx512() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
bool has_avx512bf16() {                       // its unit compiles with -mavx512vnni too (the W8A8 tile's vpdpbusd)
    return has_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}
// AMX: the CPU's tiles (CPUID leaf 7: AMX-BF16 EDX bit 22, AMX-TILE 24, AMX-INT8 25) and Linux's leave to use them
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once for the whole process; refused by kernels before
// 5.16 and where a sandbox forbids it, and then this level is not there).
bool has_amx() {
    static const bool ok = [] {
        unsigned a, b, c, d;
        if (!has_avx512bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const unsigned need = (1u << 22) | (1u << 24) | (1u << 25);
        if ((d & need) != need) return false;
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }();
    return ok;
}
#endif

const Level LEVELS[] = {                      // best last
    {"generic", colibri_linear_generic, colibri_linear_i8_generic, colibri_decode_attention_generic,
     colibri_quantize_row_generic, always},
#if defined(__x86_64__)
    {"avx2", colibri_linear_avx2, colibri_linear_i8_avx2, colibri_decode_attention_avx2,
     colibri_quantize_row_avx2, has_avx2},
    {"avx512", colibri_linear_avx512, colibri_linear_i8_avx512, colibri_decode_attention_avx512,
     colibri_quantize_row_avx512, has_avx512},
    {"avx512bf16", colibri_linear_avx512bf16, colibri_linear_i8_avx512bf16, colibri_decode_attention_avx512bf16,
     colibri_quantize_row_avx512bf16, has_avx512bf16, colibri_linear_bf16_avx512bf16},
    {"amx", colibri_linear_amx, colibri_linear_i8_tiles_amx, colibri_decode_attention_amx, colibri_quantize_row_amx,
     has_amx, colibri_linear_bf16_amx, colibri_linear_i8w_bf16_amx},
#endif
};

const Level* pick(const std::string& want) {
    if (!want.empty()) {
        for (const auto& l : LEVELS)
            if (want == l.name) {
                TORCH_CHECK(l.supported(), "COLIBRI_CPU_ISA=", want, ": this CPU cannot run that level; use one of "
                            "the levels it has (generic, avx2, avx512, avx512bf16, amx as CPUID allows)");
                return &l;
            }
        TORCH_CHECK(false, "COLIBRI_CPU_ISA=", want, " is unknown; use generic, avx2, avx512, avx512bf16 or amx");
    }
    const Level* best = &LEVELS[0];
    for (const auto& l : LEVELS)
        if (l.supported()) best = &l;
    return best;
}

const Level* current() {
    static const Level* level = [] {
        const char* env = std::getenv("COLIBRI_CPU_ISA");
        return pick(env ? env : "");
    }();
    return level;
}

const Level* in_force = nullptr;

const Level& level() { return in_force ? *in_force : *current(); }

int wdtype(const at::Tensor& w, const c10::optional<at::Tensor>& scale) {
    if (w.scalar_type() == at::kFloat) return 0;
    if (w.scalar_type() == at::kBFloat16) return 1;
    TORCH_CHECK(w.scalar_type() == at::kChar, "colibri::linear: weights must be float32, bfloat16 or int8, got ",
                w.scalar_type());
    TORCH_CHECK(scale.has_value(), "colibri::linear: int8 weights need their per-row scales");
    return 2;
}

}  // namespace

int64_t colibri_ops::grain(int64_t rows, int64_t k) {
    return std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, rows * k * BLOCK));
}

void colibri_ops::quantize_row(const float* row, int64_t K, int8_t* q, float* scale) {
    level().quantize_row(row, K, q, scale);
}

colibri_ops::Quantized colibri_ops::quantize_rows(const float* x, int64_t n, int64_t K) {
    Quantized out = quantized(n, K);
    const int64_t rows_per_chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K));
    colibri_ops::parallel_for(0, n, rows_per_chunk, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * K, K, out.q.data() + r * out.Kp, out.scale.data() + r);
    });
    return out;
}

colibri_ops::Quantized colibri_ops::quantized(int64_t n, int64_t K) {
    Quantized out;
    out.Kp = (K + KPAD - 1) / KPAD * KPAD;                 // KPAD: ops.h
    out.q.assign(n * out.Kp, 0);
    out.scale.resize(n);
    return out;
}

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, bool w8a8,
                  bool tiles) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "colibri::linear: need x [M, K] and w "
                "[Dout, K], got ", x.sizes(), " and ", w.sizes());
    int kind = wdtype(w, scale);
    const bool xb16 = x.scalar_type() == at::kBFloat16;
    linear_bf16_fn fnb = kind == 1 && xb16 ? level().linear_bf16 : nullptr;
    // weight-only int8 against bf16 x on tiles only when asked (a form of its own: its sums' order is the tiles')
    linear_i8w_bf16_fn fni = kind == 2 && xb16 && tiles && !w8a8 ? level().linear_i8w_bf16 : nullptr;
    const bool bf16_in = fnb || fni;
    at::Tensor xf = bf16_in ? x.contiguous() : x.to(at::kFloat).contiguous();   // the tiles take bf16 x as it is
    at::Tensor wc = w.contiguous();
    at::Tensor sc = kind == 2 ? scale->to(at::kFloat).contiguous() : at::Tensor();
    TORCH_CHECK(kind != 2 || (sc.dim() == 1 && sc.size(0) == w.size(0)), "colibri::linear: scale must be [Dout]");
    const int64_t M = x.size(0), K = x.size(1), D = w.size(0);
    const bool bf16_out = x.scalar_type() == at::kBFloat16;      // rounded here, once (as torch's .to would)
    at::Tensor y = at::empty({M, D}, x.options().dtype(at::kFloat));
    at::Tensor out = bf16_out ? at::empty({M, D}, x.options()) : y;
    if (M == 0 || D == 0) return out;
    const float* xp = bf16_in ? nullptr : xf.data_ptr<float>();
    const uint16_t* xbp = bf16_in ? reinterpret_cast<const uint16_t*>(xf.data_ptr()) : nullptr;
    const void* wp = wc.data_ptr();
    const float* sp = kind == 2 ? sc.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    uint16_t* op = bf16_out ? static_cast<uint16_t*>(out.data_ptr()) : nullptr;   // its bits (bf16.h)
    linear_fn fn = level().linear;
    linear_i8_fn fn8 = level().linear_i8;
    TORCH_CHECK(!w8a8 || kind == 2, "colibri::linear: W8A8 takes int8 weights");
    Quantized xq = w8a8 ? quantize_rows(xp, M, K) : Quantized{};
    colibri_ops::parallel_for(0, (D + BLOCK - 1) / BLOCK, grain(M, K), [&](int64_t b0, int64_t b1) {
        const int64_t o0 = b0 * BLOCK, o1 = std::min(D, b1 * BLOCK);
        if (fnb)
            fnb(xbp, int(M), int(K), static_cast<const uint16_t*>(wp), int(o0), int(o1), yp, int(D), nullptr, 0);
        else if (fni)
            fni(xbp, int(M), int(K), static_cast<const int8_t*>(wp), sp, int(o0), int(o1), yp, int(D), nullptr, 0);
        else if (w8a8)
            fn8(xq.q.data(), xq.scale.data(), int(M), int(xq.Kp), int(K), static_cast<const int8_t*>(wp), sp, int(o0),
                int(o1), yp, int(D), nullptr, 0);
        else
            fn(xp, int(M), int(K), wp, kind == 2 && xb16 ? 3 : kind, sp, int(o0), int(o1), yp, int(D), nullptr,
               0);                                   // 3: int8 against bf16 x (gemm.h's int16 form where it has one)
        if (op)
            for (int64_t m = 0; m < M; ++m) {
                const float* __restrict__ ym = yp + m * D;
                uint16_t* __restrict__ om = op + m * D;
                for (int64_t o = o0; o < o1; ++o) om[o] = colibri_bf16::bits(ym[o]);
            }
    });
    return out;
}

std::string isa() { return level().name; }

std::string use_isa(const std::string& name) {
    in_force = name.empty() ? nullptr : pick(name);
    return level().name;
}

}  // namespace

attention_fn colibri_ops::attention_kernel() { return level().attention; }
linear_fn colibri_ops::linear_kernel() { return level().linear; }
linear_i8_fn colibri_ops::linear_i8_kernel() { return level().linear_i8; }
linear_bf16_fn colibri_ops::linear_bf16_kernel() { return level().linear_bf16; }

at::Tensor colibri_ops::linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                               bool w8a8, bool tiles) {
    return ::linear(x, w, scale, w8a8, tiles);
}

TORCH_LIBRARY(colibri, m) {
    m.def("linear(Tensor x, Tensor w, Tensor? scale=None, bool w8a8=False, bool tiles=False) -> Tensor");
    m.def("isa() -> str", &isa);
    m.def("use_isa(str name) -> str", &use_isa);
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
    m.impl("linear", &linear);
}
