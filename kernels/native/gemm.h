// y = x @ W.T for small row counts, written once and compiled once per ISA level (isa_*.cpp define CK_WIDTH,
// the float lanes of a vector, and CK_NAME, the suffix of the entry point; the compiler flags of each
// translation unit pick the instructions). No torch headers: these files compile in seconds.
//
// Bandwidth first: the weight is streamed from memory once per call, a block of 32 rows at a time, converted to
// float32 in registers (bf16: a 16-bit shift; int8: a widening convert, its row scale applied once at the end; on the
// levels past generic int8 weights meet bf16 x quantised to int16 instead: see CK_X16 below);
// up to 6 rows of x share each pass over the block, and further passes go over it again from the caches.
//
// Fixed numerics: every output element y[m, o] is one vector accumulator over k in steps of CK_WIDTH lanes
// (the last step zero-padded), fused multiply-adds where the ISA has them, then the same pairwise sum over its
// lanes, whatever the tile, the row count or the thread that computes it. So a row's result never depends on
// the other rows of a call, nor on the thread split (batch invariance by construction).
//
// Shapes: x [M, K] float32 row-major; W [Dout, K] row-major (float32, bf16 as uint16, or int8 with a float32
// scale per row); y [M, ldy] float32, columns o0..o1 written.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace colibri_native {

typedef float fvec __attribute__((vector_size(CK_WIDTH * 4)));
typedef int32_t ivec __attribute__((vector_size(CK_WIDTH * 4)));
typedef uint32_t uvec __attribute__((vector_size(CK_WIDTH * 4)));
typedef uint16_t hvec __attribute__((vector_size(CK_WIDTH * 2)));
typedef int8_t bvec __attribute__((vector_size(CK_WIDTH)));

template <typename T>
static inline T load(const void* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));             // an unaligned vector load
    return v;
}

static inline fvec widen(const float* p) { return load<fvec>(p); }

// bf16 -> float32 is the bits 16 places up; int8 -> float32 a widening convert. The ISA's own widening loads
// where it has them (the portable form below compiles to element inserts there).
#if defined(__AVX512F__) && CK_WIDTH == 16
static inline fvec widen(const uint16_t* p) {
    return (fvec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
static inline fvec widen(const int8_t* p) {
    return (fvec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__) && CK_WIDTH == 8
static inline fvec widen(const uint16_t* p) {
    return (fvec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
static inline fvec widen(const int8_t* p) {
    return (fvec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#else
static inline fvec widen(const uint16_t* p) {
    uvec u = __builtin_convertvector(load<hvec>(p), uvec) << 16;
    fvec f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}
static inline fvec widen(const int8_t* p) {
    return __builtin_convertvector(__builtin_convertvector(load<bvec>(p), ivec), fvec);
}
#endif

template <typename T>
static inline fvec widen_tail(const T* p, int n) {  // the last n < CK_WIDTH elements, zero-padded
    T buf[CK_WIDTH] = {};
    std::memcpy(buf, p, n * sizeof(T));
    return widen(buf);
}

// The same pairwise tree for every element: lane i += lane i + W/2, then i + W/4, ... down to lane 0 += lane 1. In
// registers where the ISA has the shuffles: the same adds in the same order, so the same bits as the loop below,
// which GCC compiled to 16 stores and scalar adds (a tenth of an int8 tile's time at 4 rows: perf annotate of a
// layer's experts at 32 tokens).
static inline float lanes_sum(fvec v) {
#if defined(__AVX512F__) && CK_WIDTH == 16
    const __m512 z = (__m512)v;
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(z),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));   // i + 8
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));                    // i + 4
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                                            // i + 2
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                                           // 0 + 1
#elif defined(__AVX2__) && CK_WIDTH == 8
    const __m256 z = (__m256)v;
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(z), _mm256_extractf128_ps(z, 1));                    // i + 4
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));                                                            // i + 2
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));                                           // 0 + 1
#else
    float a[CK_WIDTH];
    std::memcpy(a, &v, sizeof a);
    for (int width = CK_WIDTH / 2; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) a[i] += a[i + width];
    return a[0];
#endif
}

// Software prefetch of the weight bytes the call reads next (the next block of rows), paced to what the tile
// consumes: each step of an inner loop earns the bytes it reads from the block, and a cache line is requested per
// 64 bytes earned by every pass of x's 4-row tiles over the block (64 x passes). DRAM is then read while the current
// rows are multiplied, at the rate they are multiplied. Without prefetch a row's stream stalls on every new line (a
// one-row bf16 pass read 7 GB/s where a streaming sum reads 12 on one thread of an AVX2 EPYC); a fixed line per step,
// twice what an int8 tile reads, had the next block requested in a burst and DRAM idle for the rest: a layer's int8
// experts at one row read 12.7 GB/s that way against 16.0 paced (2 threads, `python -m benchmarks.gemm_ab`).
struct Ahead {
    const char* p;
    const char* end;
    int passes = 1;                                // tiles of x rows that pass over the block (all of them read it)
    int credit = 0;                                // bytes earned and not yet requested
    inline void step(int bytes) {                  // into L2 (locality 2): a block ahead is more than L1 holds
        credit += bytes;
        if (__builtin_expect(credit >= 64 * passes, 0)) request();   // the common step falls through: no jump
    }
    inline void request() {
        for (const int line = 64 * passes; credit >= line; credit -= line) {
            if (p >= end) {
                credit = 0;
                return;
            }
            __builtin_prefetch(p, 0, 2);
            p += 64;
        }
    }
};

// The prefetch while block [ob, ob + OB) of a weight of `row_bytes` rows (rows o0..o1 of the call) is multiplied by
// `passes` passes of x's rows over it: the next block's bytes, or after the last block `after` (what the caller
// computes next, such as the next expert's rows), paced over all the passes.
static inline Ahead ahead_of(const void* w, int64_t row_bytes, int ob, int OB, int o1, int passes,
                             Ahead after) {
    passes = std::min(std::max(passes, 1), 1 << 16);                // capped: 64 x passes is an int
    if (ob + OB >= o1) return Ahead{after.p, after.end, passes};
    const char* base = static_cast<const char*>(w);
    const int end = ob + 2 * OB < o1 ? ob + 2 * OB : o1;
    return Ahead{base + (ob + OB) * row_bytes, base + end * row_bytes, passes};
}

// One tile: MT rows of x against OT consecutive rows of W (from `w`, row o of the call), the whole of K;
// y and scale point at column o.
template <int MT, int OT, typename WT>
static inline void tile(const float* x, int K, const WT* w, const float* scale, float* y, int ldy, Ahead& ahead_) {
    Ahead ahead = ahead_;                          // in registers for the loop
    constexpr int earn = int(OT * CK_WIDTH * sizeof(WT));   // the bytes of the block a step reads
    fvec acc[MT][OT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) acc[i][j] = fvec{};
    int k = 0;
    for (; k + CK_WIDTH <= K; k += CK_WIDTH) {
        ahead.step(earn);
        fvec wv[OT];
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) wv[j] = widen(w + (int64_t)j * K + k);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            fvec xv = widen(x + (int64_t)i * K + k);
#if defined(__AVX2__) && !defined(__AVX512F__)
            if constexpr (MT >= 5)                // one load into a register: GCC folded it into every FMA (at 3
                __asm__("" : "+x"(xv));           // rows, held, bf16 ran 0.88x: gemm_ab)
#endif
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] += xv * wv[j];
        }
    }
    if (k < K) {
        fvec wv[OT];
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) wv[j] = widen_tail(w + (int64_t)j * K + k, K - k);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            fvec xv = widen_tail(x + (int64_t)i * K + k, K - k);
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] += xv * wv[j];
        }
    }
    ahead_ = ahead;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j)
            y[(int64_t)i * ldy + j] = scale ? lanes_sum(acc[i][j]) * scale[j] : lanes_sum(acc[i][j]);
}

// MT rows of x against W rows [0, n) of `w`: OT rows at a time (as many accumulators as the registers
// hold beside the loads: MT x OT + OT + 1 of AVX2's 16), the rest in one narrower tile. Each accumulator takes one
// multiply-add per step, so more of them keep more in flight: 2 and 3 rows with 4 and 3 weight rows a tile
// (against 3 and 2) multiplied 13% and 38% faster from the caches, and a layer's experts at 8 tokens (1-3 rows
// each) took 5.6-6.0 ms against 6.5-7.0 from memory (bf16, 2 threads, an AVX2 EPYC). AVX-512's 32 registers
// take 4 weight rows at 3 to 6 rows of x: a 32-row block is 8 full tiles (3 a tile left 2 rows to one-row tiles,
// 4 multiply-adds per widened weight vector), and a pass takes up to 6 rows (up to 24 accumulators). On an AMX
// Xeon (benchmarks/gemm_ab.py --level amx, docs/performance.md): 1.24-1.43x faster for int8 and 1.11-1.28x for
// bf16 at 3-8 rows, then 1.1-1.2x more at 5 and 6 rows (one pass where there were two). AVX2 takes 5 and 6 rows
// with 2 weight rows (10 and 12 accumulators), x's vector held in a register for those tiles' FMAs (GCC had
// folded its load into each: 6 x 2 ran a third slower than 4 x 3 from the caches, and 5-8% faster held): on an
// AVX2 EPYC, 1.08-1.22x for int8 and 0.99-1.15x for bf16 at 5-8 rows, 1.01-1.18x at 32 (gemm_ab,
// docs/performance.md).
template <int MT, typename WT>
static inline void rows(const float* x, int K, const WT* w, const float* scale, int n, float* y, int ldy,
                        Ahead& ahead) {
    constexpr int OT = MT <= 2 || CK_WIDTH == 16 ? 4 : MT <= 4 ? 3 : 2;
    int o = 0;
    for (; o + OT <= n; o += OT)
        tile<MT, OT>(x, K, w + (int64_t)o * K, scale ? scale + o : nullptr, y + o, ldy, ahead);
    const float* so = scale ? scale + o : nullptr;
    switch (n - o) {                               // the rest in one narrower tile (each output still one tile)
        case 3: if constexpr (OT > 3) tile<MT, 3>(x, K, w + (int64_t)o * K, so, y + o, ldy, ahead); break;
        case 2: if constexpr (OT > 2) tile<MT, 2>(x, K, w + (int64_t)o * K, so, y + o, ldy, ahead); break;
        case 1: tile<MT, 1>(x, K, w + (int64_t)o * K, so, y + o, ldy, ahead); break;
        default: break;
    }
}

template <typename WT>
static inline void rows_any(const float* x, int mt, int K, const WT* w, const float* scale, int n, float* y, int ldy,
                            Ahead& ahead) {
    switch (mt) {
        case 1: rows<1>(x, K, w, scale, n, y, ldy, ahead); break;
        case 2: rows<2>(x, K, w, scale, n, y, ldy, ahead); break;
        case 3: rows<3>(x, K, w, scale, n, y, ldy, ahead); break;
        case 4: rows<4>(x, K, w, scale, n, y, ldy, ahead); break;
        case 5: rows<5>(x, K, w, scale, n, y, ldy, ahead); break;
        default: rows<6>(x, K, w, scale, n, y, ldy, ahead); break;
    }
}

constexpr int PASS_ROWS = 6;                         // the most rows of x a pass over a block takes

// The weight is streamed from memory once per block of OB rows; every pass of x's rows (up to PASS_ROWS) goes over
// the block while it is in L1/L2, widening it in registers each pass (a float32 panel converted once per block was
// slower at every row count on an AVX2 EPYC: 4 rows 6.0 against 8.3 GB/s, 32 rows 1.1 against 1.5, bf16, one
// thread). A pass takes up to 6 rows, the rows split evenly (8 rows are 4 + 4, 12 are 6 + 6), on every level.
template <typename WT>
static void linear_block(const float* x, int M, int K, const WT* w, const float* scale, int o0, int o1, float* y,
                         int ldy, Ahead after) {
    constexpr int OB = 32;
    const int passes = (M + PASS_ROWS - 1) / PASS_ROWS;
    const auto rows_of = [&](int p) { return M / passes + (p < M % passes); };   // split evenly
    for (int ob = o0; ob < o1; ob += OB) {
        int n = (ob + OB < o1 ? ob + OB : o1) - ob;
        Ahead ahead = ahead_of(w, int64_t(K) * int64_t(sizeof(WT)), ob, OB, o1, passes, after);
        for (int p = 0, m = 0; p < passes; m += rows_of(p), ++p)
            rows_any(x + (int64_t)m * K, rows_of(p), K, w + (int64_t)ob * K, scale ? scale + ob : nullptr, n,
                     y + (int64_t)m * ldy + ob, ldy, ahead);
    }
}

// Weight-only int8 against bf16 x on AVX2 and AVX-512 (every level but generic; CK_X16; the entry point's
// wdtype 3): x's rows are quantised to int16 in blocks of QB = 256 along K (a float32 scale a block, amax / 32767;
// q = round-half-even(x * (32767 / amax)) in float32 arithmetic, a block below 2^-64 scaled up by 2^64 first) and
// multiplied by the int8 weights with vpmaddwd on AVX2 (16 int16 x int16 products a step, pairs summed into int32
// lanes: 16 multiply-adds an instruction against 8 for an FMA, and the weights widen with one instruction per 16
// where float32 takes two per 8). A block's int32 sums are exact (at most 16 pair sums of at most 2 * 32767 * 127 a
// lane, 8 on AVX-512), then converted and scaled into float32 lanes, so every
// output is, whatever the tile or thread, the same fixed sequence: one int32 vector a block, the same float adds, the
// same pairwise lane sum, times the weight row's scale. The float32 form's 4-row tile is bound by its FMAs (9.6 G
// weights/s a core on an AVX2 EPYC, ~19 GB/s of int8 on two cores, below the read rate); the int16 form read a MoE
// layer's int8 experts 1.22-1.31x as fast at 4-32 rows and lm_head 1.24-1.39x, 0.97-1.09x at 1-2 rows (2 threads,
// `python -m benchmarks.gemm_ab --base e729f39 --level avx2 --kinds int8b`). Its x is within half a step, 1/65534 of
// the block's largest |x|, of the bf16 x (a value within 2^-7 of that largest is exact): far below the int8 weights'
// own error (up to 1/254 of a row's largest |w|). Float32 x (wdtype 2) keeps the float32 form. A block holding inf or
// NaN gives NaN (its scale is NaN). The AVX-512 levels take 32 pairs a step (vpdpwssd where there is VNNI), 4 weight
// rows a tile to 2 rows of x and 3 from 3 rows (the int32 and float32 accumulators of 4 x 4 spilled): on a 2-core AMD
// EPYC with AVX512-BF16 and VNNI (Zen 4, whose 16-lane FMAs run as two 8-lane halves) a MoE layer's int8 experts at
// 4 / 8 / 32 rows each ran 1.20x / 1.38x / 1.47x as fast as the float32 form and lm_head 1.32-1.47x, 0.91-0.96x at
// 1-2 rows (`python -m benchmarks.gemm_ab --base 75d2d3b --kinds int8b --rows 1,2,4,8,32 --level avx512bf16`). The
// amx level (CK_X16_TILES) multiplies this form's x on AMX's int8 tiles from two rows (amx_x16.h: x's two bytes
// against the weights, exact block totals) and sums each block's lanes to its exact total on vectors too, so both
// give the same bits (x16_sum below); on a 2-core Xeon with AMX a MoE layer's int8 experts ran 1.33x / 1.67x /
// 2.79x as fast as the lanes on vectors at 4 / 8 / 32 rows an expert, 0.98x at 2, 0.99x at 1 (one thread;
// `python -m benchmarks.gemm_ab --level amx --x16-tiles --kinds int8b`).
#if defined(__AVX2__)
#define CK_X16 1
constexpr int QB = 256;                              // elements of K one scale of x covers

// The int16 step's vectors: AVX2's 16 pairs (vpmaddwd, then an add), or on the AVX-512 levels 32 (vpdpwssd where
// there is VNNI: the multiply and the add in one instruction; else vpmaddwd and an add). A block's int32 sums are exact
// either way (at most 16 pair sums of at most 2 * 32767 * 127 a lane, far inside int32), so only the lanes they land
// in and the float sums after differ between the widths.
#if defined(__AVX512BW__) && CK_WIDTH == 16
constexpr int X16_STEP = 32;                         // int16 elements of K a step takes
typedef __m512i x16_ivec;
typedef __m512 x16_fvec;
static inline x16_ivec x16_w(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline x16_ivec x16_w_tail(const int8_t* p, int n) {         // n < 32 bytes, the rest zero (masked: no fault)
    return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8((__mmask32)((1u << n) - 1), p));
}
static inline x16_ivec x16_x(const int16_t* p) { return _mm512_loadu_si512(p); }
static inline x16_ivec x16_zero() { return _mm512_setzero_si512(); }
static inline x16_ivec x16_dot(x16_ivec acc, x16_ivec x, x16_ivec w) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, x, w);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
static inline x16_fvec x16_fzero() { return _mm512_setzero_ps(); }
static inline x16_fvec x16_scale(x16_ivec sums, float s, x16_fvec acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(s), acc);
}
#else
constexpr int X16_STEP = 16;
typedef __m256i x16_ivec;
typedef __m256 x16_fvec;
static inline x16_ivec x16_w(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
static inline x16_ivec x16_w_tail(const int8_t* p, int n) {         // n < 16 bytes, the rest zero
    alignas(16) int8_t tail[16] = {};
    std::memcpy(tail, p, n);
    return _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i*)tail));
}
static inline x16_ivec x16_x(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline x16_ivec x16_zero() { return _mm256_setzero_si256(); }
static inline x16_ivec x16_dot(x16_ivec acc, x16_ivec x, x16_ivec w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
}
static inline x16_fvec x16_fzero() { return _mm256_setzero_ps(); }
static inline x16_fvec x16_scale(x16_ivec sums, float s, x16_fvec acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(s), acc);
}
#endif
static_assert(QB % X16_STEP == 0, "a block is whole steps");
static_assert(sizeof(x16_fvec) == sizeof(fvec), "the float sums are the level's vectors (lanes_sum)");

// What a block's int32 lanes become. Most levels: float32 lanes (each lane converted, scaled and summed apart, the
// lanes summed at the end). The amx level (CK_X16_TILES): the block's exact int32 total, converted once, and
// acc = fma(float(total), scale, acc): the arithmetic of its tiles (amx_x16.h), so a few rows on vectors and many
// on tiles give the same bits.
#if defined(CK_X16_TILES)
typedef float x16_sum;
static inline x16_sum x16_sum_zero() { return 0.f; }
static inline x16_sum x16_sum_block(x16_ivec sums, float s, x16_sum acc) {
    return std::fma(float(_mm512_reduce_add_epi32(sums)), s, acc);
}
static inline float x16_sum_value(x16_sum acc) { return acc; }
#else
typedef x16_fvec x16_sum;
static inline x16_sum x16_sum_zero() { return x16_fzero(); }
static inline x16_sum x16_sum_block(x16_ivec sums, float s, x16_sum acc) { return x16_scale(sums, s, acc); }
static inline float x16_sum_value(x16_sum acc) { return lanes_sum((fvec)acc); }
#endif

// x [M, K] float32 -> q [M, Kp] int16 (Kp = K rounded up to X16_STEP, zero-padded) and scales s [M, nb] (nb = blocks of
// QB). Vector and scalar forms are the same IEEE multiply and round-half-even, so every element gets the same bits.
static void quantize_x16(const float* x, int M, int K, int16_t* q, int Kp, float* s, int nb) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    for (int m = 0; m < M; ++m) {
        const float* row = x + (int64_t)m * K;
        int16_t* qr = q + (int64_t)m * Kp;
        for (int b = 0; b < nb; ++b) {
            const int k0 = b * QB, k1 = std::min(K, k0 + QB);
            __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            int k = k0;
            for (; k + 8 <= k1; k += 8) {
                const __m256 a = _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude);
                mx = _mm256_max_ps(mx, a);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));   // inf or NaN
            }
            alignas(32) float lanes[8], flags[8];
            _mm256_store_ps(lanes, mx);
            _mm256_store_ps(flags, bad);
            float amax = 0.f;
            bool finite = true;
            for (int i = 0; i < 8; ++i) {
                amax = std::max(amax, lanes[i]);
                finite = finite && flags[i] == 0.f;
            }
            for (; k < k1; ++k) {
                const float a = std::fabs(row[k]);
                finite = finite && a < std::numeric_limits<float>::infinity();
                amax = std::max(amax, a);
            }
            if (!finite || amax == 0.f) {            // zeros; a NaN scale for a block with inf or NaN
                std::memset(qr + k0, 0, sizeof(int16_t) * (k1 - k0));
                s[(int64_t)m * nb + b] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
                continue;
            }
            // a block below 2^-64 is scaled up by 2^64 first (exact), or 32767 / amax would overflow to inf (from
            // amax < ~1e-34) and turn its q to garbage; elsewhere `up` is 1 and changes no bit
            const float up = amax < 0x1p-64f ? 0x1p64f : 1.f;
            const float r = 32767.f / (amax * up);
            s[(int64_t)m * nb + b] = amax / 32767.f;
            const __m256 vr = _mm256_set1_ps(r), vup = _mm256_set1_ps(up);
            for (k = k0; k + 8 <= k1; k += 8) {               // round to nearest-even
                const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(row + k), vup), vr));
                _mm_storeu_si128((__m128i*)(qr + k),
                                 _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
            }
            for (; k < k1; ++k) qr[k] = int16_t(std::nearbyint(row[k] * up * r));
        }
        std::memset(qr + K, 0, sizeof(int16_t) * (Kp - K));
    }
}

// One step of X16_STEP along K in tile_x16: acc[i][j] += pairs of x row i (int16) times W row j (int8 widened to
// int16).
#define CK_STEP_X16                                                                                                  \
    {                                                                                                                \
        x16_ivec wv[OT];                                                                                             \
        _Pragma("GCC unroll 8") for (int j = 0; j < OT; ++j) wv[j] = x16_w(w + (int64_t)j * K + k);                  \
        _Pragma("GCC unroll 8") for (int i = 0; i < MT; ++i) {                                                      \
            const x16_ivec xv = x16_x(x + (int64_t)i * Kp + k);                                                      \
            _Pragma("GCC unroll 8") for (int j = 0; j < OT; ++j) acc[i][j] = x16_dot(acc[i][j], xv, wv[j]);          \
        }                                                                                                            \
    }

// One tile: MT int16 rows of x (stride Kp, scales xs [MT, nb]) against OT int8 rows of W (row scales ws), all of K.
template <int MT, int OT>
static inline void tile_x16(const int16_t* x, int Kp, const float* xs, int nb, int K, const int8_t* w,
                            const float* ws, float* y, int ldy, Ahead& ahead_) {
    Ahead ahead = ahead_;                          // in registers for the loop
    constexpr int earn = OT * X16_STEP;            // the bytes of the block a step reads
    x16_sum accf[MT][OT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) accf[i][j] = x16_sum_zero();
    for (int b = 0; b < nb; ++b) {
        const int k0 = b * QB, k1 = std::min(K, k0 + QB);
        x16_ivec acc[MT][OT];
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] = x16_zero();
        int k = k0;
        if constexpr (MT == 1) {                   // one row: bound by memory, its prefetch paced step by step (a
            for (; k + X16_STEP <= k1; k += X16_STEP) {   // block's lines requested at once read 0.86x as fast:
                ahead.step(earn);                  // gemm_ab)
                CK_STEP_X16
            }
        } else {                                   // bound by the multiply-adds: the prefetch a block at a time (a
            const int steps = (k1 - k0) / X16_STEP;   // check a step cost a fifth from the caches), a whole block's
            ahead.step(earn * steps);              // steps unrolled (a loop of 8 a block ran no faster than the
                                                   // float32 tile from the caches)
#pragma GCC unroll 16
            for (int u = 0; u < (steps == QB / X16_STEP ? QB / X16_STEP : steps); ++u, k += X16_STEP) CK_STEP_X16
        }
        if (k < k1) {                              // the last partial step: each row's rest, zero-padded
            ahead.step(earn);
            x16_ivec wv[OT];
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) wv[j] = x16_w_tail(w + (int64_t)j * K + k, k1 - k);
#pragma GCC unroll 8
            for (int i = 0; i < MT; ++i) {
                const x16_ivec xv = x16_x(x + (int64_t)i * Kp + k);
#pragma GCC unroll 8
                for (int j = 0; j < OT; ++j) acc[i][j] = x16_dot(acc[i][j], xv, wv[j]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const float sx = xs[(int64_t)i * nb + b];
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) accf[i][j] = x16_sum_block(acc[i][j], sx, accf[i][j]);
        }
    }
    ahead_ = ahead;
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) y[(int64_t)i * ldy + j] = x16_sum_value(accf[i][j]) * ws[j];
}

#undef CK_STEP_X16

template <int MT>
static inline void rows_x16(const int16_t* x, int Kp, const float* xs, int nb, int K, const int8_t* w,
                            const float* ws, int n, float* y, int ldy, Ahead& ahead) {
    constexpr int OT = X16_STEP == 32 ? (MT <= 2 ? 4 : 3) : MT == 1 ? 4 : MT == 2 ? 3 : 2;   // AVX-512: 32 registers
    int o = 0;
    for (; o + OT <= n; o += OT) tile_x16<MT, OT>(x, Kp, xs, nb, K, w + (int64_t)o * K, ws + o, y + o, ldy, ahead);
    for (; o < n; ++o) tile_x16<MT, 1>(x, Kp, xs, nb, K, w + (int64_t)o * K, ws + o, y + o, ldy, ahead);
}

constexpr int PASS_ROWS_X16 = 4;                     // the most rows of x a pass over a block takes

// x [M, K] quantised (quantize_x16) into this thread's buffers: q [M, Kp] int16, s [M, nb] scales.
struct X16Rows {
    const int16_t* q;
    const float* s;
    int Kp, nb;
};
static X16Rows quantized_x16(const float* x, int M, int K) {
    const int Kp = (K + X16_STEP - 1) / X16_STEP * X16_STEP, nb = (K + QB - 1) / QB;
    thread_local std::vector<int16_t> q;
    thread_local std::vector<float> s;
    q.resize((size_t)M * Kp);
    s.resize((size_t)M * nb);
    quantize_x16(x, M, K, q.data(), Kp, s.data(), nb);
    return {q.data(), s.data(), Kp, nb};
}

// linear_block's order (a block of OB weight rows from memory, every pass of x's rows over it from the caches) for
// weight-only int8 on the int16 form: x quantised first, into this thread's buffer.
static void linear_block_x16(const float* x, int M, int K, const int8_t* w, const float* ws, int o0, int o1,
                             float* y, int ldy, Ahead after) {
    constexpr int OB = 32;
    const X16Rows xq = quantized_x16(x, M, K);
    const int Kp = xq.Kp, nb = xq.nb;
    const int passes = (M + PASS_ROWS_X16 - 1) / PASS_ROWS_X16;
    const auto rows_of = [&](int p) { return M / passes + (p < M % passes); };   // split evenly
    for (int ob = o0; ob < o1; ob += OB) {
        int n = (ob + OB < o1 ? ob + OB : o1) - ob;
        Ahead ahead = ahead_of(w, K, ob, OB, o1, passes, after);
        for (int p = 0, m = 0; p < passes; m += rows_of(p), ++p) {
            const int16_t* xm = xq.q + (int64_t)m * Kp;
            const float* sm = xq.s + (int64_t)m * nb;
            const int8_t* wb = w + (int64_t)ob * K;
            float* ym = y + (int64_t)m * ldy + ob;
            switch (rows_of(p)) {
                case 1: rows_x16<1>(xm, Kp, sm, nb, K, wb, ws + ob, n, ym, ldy, ahead); break;
                case 2: rows_x16<2>(xm, Kp, sm, nb, K, wb, ws + ob, n, ym, ldy, ahead); break;
                case 3: rows_x16<3>(xm, Kp, sm, nb, K, wb, ws + ob, n, ym, ldy, ahead); break;
                default: rows_x16<4>(xm, Kp, sm, nb, K, wb, ws + ob, n, ym, ldy, ahead); break;
            }
        }
    }
}
#endif

// W8A8: int8 activations (rows quantised by the caller, zero-padded to Kp, a multiple of 32) against int8 weight
// rows of K; exact int32 sums (so any order, tile or thread gives the same bits), then y = (float(sum) * xs[m]) *
// ws[o], as torch's `_int_mm(xq, wq.T).float() * xs[:, None] * ws`. AVX512-VNNI multiplies 64 pairs per
// instruction with vpdpbusd, which takes unsigned bytes against signed ones: x + 128 (its bits with the top one
// flipped) against w, then 128 * Σw taken off (Σw by the same instruction against ones; int32 arithmetic wraps, so
// the difference is exact whenever the true sum fits). AVX2 multiplies 32 pairs per
// step with maddubs (|x| as unsigned bytes against w carrying x's sign; a pair of products is at most
// 2 * 127 * 127, inside int16) and widens with madd; without AVX2 a plain int32 loop.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The int32 sums of MT x rows against OT W rows on AVX512-VNNI (see above).
template <int MT, int OT>
static inline void sums_vnni(const int8_t* x, int Kp, int K, const int8_t* w, int32_t (&sums)[MT][OT],
                             Ahead& ahead) {
    constexpr int earn = OT * 64;                  // the bytes of the block a step reads
    __m512i acc[MT][OT], wsum[OT];
#pragma GCC unroll 8
    for (int j = 0; j < OT; ++j) {
        wsum[j] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_setzero_si512();
    }
    const __m512i flip = _mm512_set1_epi8(char(0x80)), ones = _mm512_set1_epi8(1);
    for (int k = 0; k < K; k += 64) {
        ahead.step(earn);
        const __mmask64 m = k + 64 <= K ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;   // the last step: a tail
        __m512i wv[OT];
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) {             // masked-off bytes load as 0 (and fault on no page)
            wv[j] = _mm512_maskz_loadu_epi8(m, w + (int64_t)j * K + k);
            wsum[j] = _mm512_dpbusd_epi32(wsum[j], ones, wv[j]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
            const __m512i xv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, x + (int64_t)i * Kp + k), flip);
#pragma GCC unroll 8
            for (int j = 0; j < OT; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < OT; ++j) {
        const uint32_t bias = uint32_t(_mm512_reduce_add_epi32(wsum[j])) * 128u;
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) sums[i][j] = int32_t(uint32_t(_mm512_reduce_add_epi32(acc[i][j])) - bias);
    }
}
#endif

#if defined(__AVX2__)
// The sum of an int32 vector's 8 lanes in registers (int32 sums wrap, so any order gives the same bits; a store and
// a scalar loop took as long as a few steps of the tile).
static inline int32_t lanes_sum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}
#endif

template <int MT, int OT>
static inline void tile_i8(const int8_t* x, int Kp, int K, const int8_t* w, const float* xs, const float* ws,
                           float* y, int ldy, Ahead& ahead_) {
    Ahead ahead = ahead_;                          // in registers for the loop
    int32_t sums[MT][OT];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (MT > 1) {                        // one row: AVX2's form read the weights faster (gemm_ab)
        sums_vnni<MT, OT>(x, Kp, K, w, sums, ahead);
    } else
#endif
    {
#if defined(__AVX2__)
    constexpr int earn = OT * 32;                  // the bytes of the block a step reads
    __m256i acc[MT][OT];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) acc[i][j] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    alignas(32) int8_t tail[OT][32];
    for (int k = 0; k < K; k += 32) {
        ahead.step(earn);
        __m256i wv[OT];
        if (k + 32 <= K) {
            for (int j = 0; j < OT; ++j) wv[j] = _mm256_loadu_si256((const __m256i*)(w + (int64_t)j * K + k));
        } else {                                   // the last partial step: the rest of each row, zero-padded
            for (int j = 0; j < OT; ++j) {
                std::memset(tail[j], 0, 32);
                std::memcpy(tail[j], w + (int64_t)j * K + k, K - k);
                wv[j] = _mm256_load_si256((const __m256i*)tail[j]);
            }
        }
        for (int i = 0; i < MT; ++i) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + (int64_t)i * Kp + k));
            __m256i ax = _mm256_sign_epi8(xv, xv);
            for (int j = 0; j < OT; ++j) {
                __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(p, ones));
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < OT; ++j) sums[i][j] = lanes_sum_i32(acc[i][j]);
#else
    (void)Kp;
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < OT; ++j) sums[i][j] = 0;
    for (int k = 0; k < K; ++k) {
        if ((k & 63) == 0) ahead.step(OT * 64);
        for (int i = 0; i < MT; ++i)
            for (int j = 0; j < OT; ++j) sums[i][j] += int32_t(x[(int64_t)i * Kp + k]) * int32_t(w[(int64_t)j * K + k]);
    }
#endif
    }
    ahead_ = ahead;
    for (int i = 0; i < MT; ++i)
        for (int j = 0; j < OT; ++j) y[(int64_t)i * ldy + j] = (float(sums[i][j]) * xs[i]) * ws[j];
}

template <int MT>
static inline void rows_i8(const int8_t* x, int Kp, int K, const int8_t* w, const float* xs, const float* ws, int n,
                           float* y, int ldy, Ahead& ahead) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    constexpr int OT = MT == 1 || MT >= 3 ? 4 : 3;     // 32 registers: 3 and 4 rows take 4 weight rows too
#else
    constexpr int OT = MT == 1 ? 4 : MT == 2 ? 3 : 2;
#endif
    int o = 0;
    for (; o + OT <= n; o += OT)
        tile_i8<MT, OT>(x, Kp, K, w + (int64_t)o * K, xs, ws + o, y + o, ldy, ahead);
    for (; o < n; ++o) tile_i8<MT, 1>(x, Kp, K, w + (int64_t)o * K, xs, ws + o, y + o, ldy, ahead);
}

static void linear_block_i8(const int8_t* x, const float* xs, int M, int Kp, int K, const int8_t* w,
                            const float* ws, int o0, int o1, float* y, int ldy, Ahead after) {
    constexpr int OB = 32;
    for (int ob = o0; ob < o1; ob += OB) {
        int n = (ob + OB < o1 ? ob + OB : o1) - ob;
        Ahead ahead = ahead_of(w, K, ob, OB, o1, (M + 3) / 4, after);           // 4-row passes
        for (int m = 0; m < M; m += 4) {
            const int mt = M - m < 4 ? M - m : 4;
            const int8_t* xm = x + (int64_t)m * Kp;
            float* ym = y + (int64_t)m * ldy + ob;
            const int8_t* wb = w + (int64_t)ob * K;
            switch (mt) {
                case 1: rows_i8<1>(xm, Kp, K, wb, xs + m, ws + ob, n, ym, ldy, ahead); break;
                case 2: rows_i8<2>(xm, Kp, K, wb, xs + m, ws + ob, n, ym, ldy, ahead); break;
                case 3: rows_i8<3>(xm, Kp, K, wb, xs + m, ws + ob, n, ym, ldy, ahead); break;
                default: rows_i8<4>(xm, Kp, K, wb, xs + m, ws + ob, n, ym, ldy, ahead); break;
            }
        }
    }
}

}  // namespace colibri_native

#if defined(CK_X16_TILES)
namespace colibri_native {
// amx_x16.h (the amx level includes it after this file): the int16 form on AMX's int8 tiles from a few rows of x.
static void linear_x16_amx(const float* x, int M, int K, const int8_t* w, const float* ws, int o0, int o1, float* y,
                           int ldy, Ahead after);
}  // namespace colibri_native
#endif

#define CK_CAT2(a, b) a##b
#define CK_CAT(a, b) CK_CAT2(a, b)

// The entry point of this ISA level: wdtype 0 = float32, 1 = bf16, 2 = int8 (with `scale`) against float32 x, 3 =
// int8 against x that was bf16 (quantised to int16 where the level has CK_X16: float32 x keeps its precision);
// [next, next + next_bytes) is what the caller reads after this call (prefetched during its last block; null for
// nothing).
extern "C" void CK_CAT(colibri_linear_, CK_NAME)(const float* x, int M, int K, const void* w, int wdtype,
                                                  const float* scale, int o0, int o1, float* y, int ldy,
                                                  const void* next, int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    Ahead after{n, n ? n + next_bytes : n};
    if (wdtype == 0) linear_block(x, M, K, static_cast<const float*>(w), nullptr, o0, o1, y, ldy, after);
    else if (wdtype == 1) linear_block(x, M, K, static_cast<const uint16_t*>(w), nullptr, o0, o1, y, ldy, after);
#if defined(CK_X16)
#if defined(CK_X16_TILES)
    else if (wdtype == 3) linear_x16_amx(x, M, K, static_cast<const int8_t*>(w), scale, o0, o1, y, ldy, after);
#else
    else if (wdtype == 3) linear_block_x16(x, M, K, static_cast<const int8_t*>(w), scale, o0, o1, y, ldy, after);
#endif
#endif
    else linear_block(x, M, K, static_cast<const int8_t*>(w), scale, o0, o1, y, ldy, after);
}

// W8A8 activations, one row of K: scale = max(max|x| / 127, FLT_MIN), q = round-half-even(x / scale) clamped to
// [-127, 127], as kernels/formats/int8.py quantize_rows; the division and the rounding are IEEE's and a maximum has
// no order, so every level writes the bits of the scalar loop (which the torch-side build compiled for baseline
// x86-64, calling libm's nearbyintf per element: 9% of a layer's W8A8 experts at 32 tokens).
extern "C" void CK_CAT(colibri_quantize_row_, CK_NAME)(const float* row, int64_t K, int8_t* q, float* scale) {
    float amax = 0.f;
    int64_t k = 0;
#if defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8)                   // max(m, |x|): a NaN lane keeps m, as std::max(amax, NaN) does
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + k), magnitude), m);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float v : lanes) amax = std::max(amax, v);
#endif
    for (; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float s = std::max(amax / 127.0f, std::numeric_limits<float>::min());
    k = 0;
#if defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    for (; k + 8 <= K; k += 8) {                 // min(t, hi) is hi for a NaN t, as std::min(127.f, NaN)
        __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + k), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        alignas(32) int32_t v[8];
        _mm256_store_si256((__m256i*)v, _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(t, hi), lo)));
        for (int j = 0; j < 8; ++j) q[k + j] = int8_t(v[j]);
    }
#endif
    for (; k < K; ++k) q[k] = int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(row[k] / s))));
    *scale = s;
}

// W8A8 (see linear_block_i8): xq [M, Kp] quantised rows with scales xs [M]; w [Dout, K] int8 with scales ws.
extern "C" void CK_CAT(colibri_linear_i8_, CK_NAME)(const int8_t* xq, const float* xs, int M, int Kp, int K,
                                                     const int8_t* w, const float* ws, int o0, int o1, float* y,
                                                     int ldy, const void* next, int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    linear_block_i8(xq, xs, M, Kp, K, w, ws, o0, o1, y, ldy, Ahead{n, n ? n + next_bytes : n});
}
