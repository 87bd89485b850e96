// The per-row element loops that rms_norm (norm_op.cpp), rope (rope_op.cpp) and the attention block's fused head
// pass (attention_block_op.cpp) share, so that a head normalised and rotated in one pass has the bits of the two
// ops one after the other. For the torch-side units (compiled with torch's flags, every product rounded: no fused
// multiply-add).
#pragma once

#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace colibri_rows {

// A dtype's loads, roundings and stores: float32 as it is, bf16 as raw bits (bf16.h: c10's rounding, branch-free, so
// that the element loops below vectorise)
struct F32 {
    using T = float;
    static constexpr bool bf16 = false;
    static float ld(float v) { return v; }
    static float rnd(float v) { return v; }
    static float st(float v) { return v; }
};
struct BF16 {
    using T = uint16_t;
    static constexpr bool bf16 = true;
    static float ld(uint16_t v) { return colibri_bf16::to_float(v); }
    static float rnd(float v) { return colibri_bf16::round(v); }
    static uint16_t st(float v) { return colibri_bf16::bits(v); }
};

// One row's sum of squares in float64: 8 running sums (one chain of float64 adds took 4 cycles a value), element h
// into sum h % 8, added in one fixed order
template <typename XD>
inline double sum_squares(const typename XD::T* __restrict__ x, int64_t H) {
    double part[8] = {};
    int64_t h = 0;
    for (; h + 8 <= H; h += 8)
        for (int j = 0; j < 8; ++j) {
            const double v = XD::ld(x[h + j]);
            part[j] += v * v;
        }
    for (int j = 0; h < H; ++h, ++j) {
        const double v = XD::ld(x[h]);
        part[j] += v * v;
    }
    return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// One row's scaled output, from its 1 / rms (restrict parameters, so that the loop vectorises)
template <typename XD, typename WD>
inline void scale_row(const typename XD::T* __restrict__ x, const typename WD::T* __restrict__ w,
                      typename XD::T* __restrict__ o, int64_t H, float inv) {
    for (int64_t h = 0; h < H; ++h) {
        float n = XD::ld(x[h]) * inv;
        if constexpr (XD::bf16 && WD::bf16) n = colibri_bf16::round(n);   // transformers: the cast, then the scale
        o[h] = XD::st(WD::ld(w[h]) * n);
    }
}

// rms_norm of one row of H: r = 1 / sqrt(mean(x²) + eps) in float32, the mean from sum_squares rounded once
template <typename XD, typename WD>
inline void norm_row(const typename XD::T* x, const typename WD::T* w, typename XD::T* o, int64_t H, float eps) {
    const double ss = sum_squares<XD>(x, H);
    const float inv = 1.0f / std::sqrt(float(ss / double(H)) + eps);
    scale_row<XD, WD>(x, w, o, H, inv);
}

// One head's rotated pairs: i < half pairs with i + half (restrict parameters and one output half a loop, so that
// each loop vectorises); every product and the sum rounded to the dtype, as torch's ops
template <typename D_>
inline void rotate_head(const typename D_::T* __restrict__ x, const typename D_::T* __restrict__ c,
                        const typename D_::T* __restrict__ s, typename D_::T* __restrict__ o, int64_t half) {
    for (int64_t i = 0; i < half; ++i)
        o[i] = D_::st(D_::rnd(D_::ld(x[i]) * D_::ld(c[i])) + D_::rnd(-D_::ld(x[i + half]) * D_::ld(s[i])));
    for (int64_t i = 0; i < half; ++i)
        o[half + i] = D_::st(D_::rnd(D_::ld(x[half + i]) * D_::ld(c[half + i])) +
                             D_::rnd(D_::ld(x[i]) * D_::ld(s[half + i])));
}

}  // namespace colibri_rows
