// y = x @ W.T for bf16 x against bf16 W with AVX512-BF16's dot products (VDPBF16PS), for the avx512bf16 level
// (isa_avx512bf16.cpp, after gemm.h): Zen 4, Cooper Lake, and any AVX512-BF16 CPU without AMX tiles.
//
// Why: at 4 rows of x and more the float path (gemm.h) is bound by its float32 multiply-adds, not by memory: a
// 512-bit FMA is 16 of them, and Zen 4 runs it as two 256-bit halves, so AVX-512 multiplied no faster than AVX2 there
// (a [32000, 1024] bf16 lm_head at 32 rows: 51 G multiply-adds a second a core, 19% of the read rate). One
// VDPBF16PS is 32 products summed in pairs into 16 float32 lanes, on the weights as they lie (no widening), so the
// same registers do twice the work a step.
//
// The tile: as gemm.h's (a block of 32 W rows streamed from memory once, up to 6 rows of x a pass over it from the
// caches, 4 W rows a tile, the next block prefetched at the pace the tile consumes), a step 32 elements of K, the last
// one masked (masked-off elements load as zero and fault on no page).
//
// Numerics (the instruction's): each product of two bf16 is exact in float32; lane i of an accumulator takes, step by
// step, the products of elements 2i + 1 and 2i, each added with one rounding to nearest-even; denormal inputs and
// results are flushed to zero. Then gemm.h's pairwise sum over the 16 lanes. An output depends on its W row and x row
// alone, whatever the tile, the row count or the thread (batch-invariant), with bits of its own (not the float path's;
// the same error bound: one float32 rounding per product added).

#include <immintrin.h>

namespace colibri_native {

// One tile: MT rows of x (bf16, row stride K) against OT consecutive rows of W, the whole of K.
template <int MT, int OT>
static inline void tile_dp(const uint16_t* x, int K, const uint16_t* w, float* y, int ldy, Ahead& ahead_) {
    Ahead ahead = ahead_;                          // in registers for the loop
    __m512 acc[MT][OT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) acc[i][j] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        ahead.step(OT * 64);
        __m512bh wv[OT];
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (int64_t)j * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (int64_t)i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {                                   // the last partial step, zero-padded by the mask
        ahead.step(OT * 64);
        const __mmask32 m = (__mmask32(1) << (K - k)) - 1;
        __m512bh wv[OT];
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (int64_t)j * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (int64_t)i * K + k);
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    ahead_ = ahead;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) y[(int64_t)i * ldy + j] = lanes_sum((fvec)acc[i][j]);
}

// MT rows of x against W rows [0, n): 4 at a time (MT x 4 accumulators + 4 weight vectors + x's of the 32
// registers), the rest in one narrower tile.
template <int MT>
static inline void rows_dp(const uint16_t* x, int K, const uint16_t* w, int n, float* y, int ldy, Ahead& ahead) {
    constexpr int OT = 4;
    int o = 0;
    for (; o + OT <= n; o += OT) tile_dp<MT, OT>(x, K, w + (int64_t)o * K, y + o, ldy, ahead);
    switch (n - o) {
        case 3: tile_dp<MT, 3>(x, K, w + (int64_t)o * K, y + o, ldy, ahead); break;
        case 2: tile_dp<MT, 2>(x, K, w + (int64_t)o * K, y + o, ldy, ahead); break;
        case 1: tile_dp<MT, 1>(x, K, w + (int64_t)o * K, y + o, ldy, ahead); break;
        default: break;
    }
}

// linear_block's order (gemm.h): a block of 32 W rows from memory, every pass of up to PASS_ROWS rows of x over it
// from the caches, the rows split evenly between the passes.
static void linear_block_dp(const uint16_t* x, int M, int K, const uint16_t* w, int o0, int o1, float* y, int ldy,
                            Ahead after) {
    constexpr int OB = 32;
    const int passes = (M + PASS_ROWS - 1) / PASS_ROWS;
    const auto rows_of = [&](int p) { return M / passes + (p < M % passes); };
    for (int ob = o0; ob < o1; ob += OB) {
        const int n = (ob + OB < o1 ? ob + OB : o1) - ob;
        Ahead ahead = ahead_of(w, int64_t(K) * 2, ob, OB, o1, passes, after);
        for (int p = 0, m = 0; p < passes; m += rows_of(p), ++p) {
            const uint16_t* xm = x + (int64_t)m * K;
            const uint16_t* wb = w + (int64_t)ob * K;
            float* ym = y + (int64_t)m * ldy + ob;
            switch (rows_of(p)) {
                case 1: rows_dp<1>(xm, K, wb, n, ym, ldy, ahead); break;
                case 2: rows_dp<2>(xm, K, wb, n, ym, ldy, ahead); break;
                case 3: rows_dp<3>(xm, K, wb, n, ym, ldy, ahead); break;
                case 4: rows_dp<4>(xm, K, wb, n, ym, ldy, ahead); break;
                case 5: rows_dp<5>(xm, K, wb, n, ym, ldy, ahead); break;
                default: rows_dp<6>(xm, K, wb, n, ym, ldy, ahead); break;
            }
        }
    }
}

}  // namespace colibri_native

// bf16 x [M, K] (values that are bf16) against bf16 w [Dout, K], rows o0..o1 of y [M, ldy] (float32): the signature
// of amx.h's colibri_linear_bf16_amx (ops.h linear_bf16_fn).
extern "C" void CK_CAT(colibri_linear_bf16_, CK_NAME)(const uint16_t* x, int M, int K, const uint16_t* w, int o0,
                                                       int o1, float* y, int ldy, const void* next,
                                                       int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    linear_block_dp(x, M, K, w, o0, o1, y, ldy, Ahead{n, n ? n + next_bytes : n});
}
