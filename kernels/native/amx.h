// y = x @ W.T on AMX tiles (Sapphire Rapids and later), for the amx level (isa_amx.cpp, after gemm.h): bf16 x
// against bf16 W (TDPBF16PS), W8A8's int8 rows against int8 W (TDPBSSD), and bf16 x against weight-only int8 W
// widened to bf16 per block (TDPBF16PS; amx_linear_i8w). Included by that unit only.
//
// W is the A operand, straight from memory: a tile is 16 of its rows by 64 bytes (32 bf16 or 64 int8 of K), loaded
// with the row stride of W itself, so weights are read where they lie (a mapped checkpoint included), unpacked.
// x is the B operand: up to 16 rows per tile, repacked per call into the tile's layout (k in groups of 4 bytes,
// each group's tokens side by side), zero-padded past K and past the rows; x is small beside W. C [16 W rows, 16
// x rows] accumulates over K; stored and written transposed into y.
//
// A tile of 16 rows by 64 bytes is 1 KiB of W per instruction of 16 x 16 x 32 (bf16) or x 64 (int8) products, so
// one row of x is as bandwidth-bound as 16 (a core multiplies far faster than memory delivers).
//
// Numerics: int8 sums are exact int32 (the bits of every other level's W8A8). bf16: each product exact, float32
// sums in the tile's own fixed order, denormals flushed (the instruction's rule); an output element's sum
// depends on its W row and x row alone, so a row's result never depends on the other rows, nor on the threads.

#include <immintrin.h>

#include <vector>

namespace colibri_native {

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tileloadd with a memory clobber: GCC's _tile_loadd passes only the address, so stores into a buffer it reads
// (the zero-padded tails, the packed x) could be dropped or moved past it.
#define CK_TILE_LOAD(tmm, p, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(p), "r"(int64_t(stride)) : "memory")

template <typename T>   // uint16_t: bf16 against bf16; int8_t: int8 against int8
struct AmxTraits {
    static constexpr int KE = 64 / int(sizeof(T));   // K elements a tile row holds
};

// A 16 x 16 transpose of 32-bit elements in registers (unpack, then shuffles within and across 128-bit lanes):
// t[c] lane i = r[i] lane c. Bits moved as they are (float shuffles do no arithmetic).
static inline void transpose16(__m512 (&r)[16], __m512 (&t)[16]) {
    for (int i = 0; i < 8; ++i) {             // lane L: rows 2i, 2i+1 at columns 4L, 4L+1 (lo) and 4L+2, 4L+3 (hi)
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {             // r[4i + j], lane L: column 4L + j of rows 4i..4i+3
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {             // t[c]: column c of all 16 rows
        const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), v0 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD), v1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
        t[j] = _mm512_shuffle_f32x4(u0, v0, 0x88);
        t[8 + j] = _mm512_shuffle_f32x4(u0, v0, 0xDD);
        t[4 + j] = _mm512_shuffle_f32x4(u1, v1, 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(u1, v1, 0xDD);
    }
}

// B: rows [0, n) of x [., ldx] (n <= N <= 16) as 4-byte groups of K (bf16 pairs, int8 quads) with each group's N
// rows side by side, [chunks * 16 groups][N] for the tiles' chunks of 64 bytes of K: a transpose of 4-byte words,
// 16 groups at a time in registers (the element-by-element copy took a fifth of a 32-row bf16 call). Every word is
// written: rows past n and K past its end as zeros.
template <typename T>
static void pack_x(const T* x, int64_t ldx, int n, int K, int N, uint32_t* out) {
    const int bytes = K * int(sizeof(T)), chunks = (bytes + 63) / 64;
    if (N == 1) {                             // one row: the groups are its bytes in order
        std::memcpy(out, x, bytes);
        std::memset(reinterpret_cast<char*>(out) + bytes, 0, 64 * size_t(chunks) - bytes);
        return;
    }
    const __mmask16 keep = __mmask16((1u << N) - 1);
    for (int c = 0; c < chunks; ++c) {
        const int left = bytes - 64 * c;
        const __mmask64 m = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i) {
            const char* row = reinterpret_cast<const char*>(x + i * ldx) + 64 * c;
            r[i] = i < n ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(m, row)) : _mm512_setzero_ps();
        }
        transpose16(r, t);
        float* dst = reinterpret_cast<float*>(out + int64_t(c) * 16 * N);
        for (int g = 0; g < 16; ++g) _mm512_mask_storeu_ps(dst + g * N, keep, t[g]);
    }
}

// Where an A tile's bytes are read (and their row stride): W rows [o, o + rows) at chunk k in place, or (rows < 16,
// or a chunk past K) a zero-padded copy in `pad`.
template <typename T>
static inline const T* w_tile(const T* w, int K, int o, int rows, int k, T* pad, int& stride) {
    constexpr int KE = AmxTraits<T>::KE;
    if (rows == 16 && k + KE <= K) {
        stride = K * int(sizeof(T));
        return w + (int64_t)o * K + k;
    }
    std::memset(pad, 0, 1024);
    const int n = (K - k < KE ? K - k : KE) * int(sizeof(T));
    for (int r = 0; r < rows; ++r) std::memcpy(pad + r * KE, w + (int64_t)(o + r) * K + k, n);
    stride = 64;
    return pad;
}

// Tiles 0-3: C [16 W rows, N x rows] (A0 and A1 against B0, then against B1), 4-5: A [16 W rows, 64 bytes],
// 6-7: B [16 groups, N x rows]: two 16-row groups of x per pass over a block (the 8 tiles there are), so each A tile
// is loaded once for both. Loaded for every call: the thread may have run another AMX user (oneDNN) since.
static inline void configure_tiles_2x2(int N, bool two = true) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        if (!two && (t == 2 || t == 3 || t == 7)) continue;   // one group: those tiles unconfigured (unused)
        cfg.colsb[t] = uint16_t(t == 4 || t == 5 ? 64 : 4 * N);
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));        // all 64 bytes an input (GCC 12's intrinsic names 8 of them)
}

template <typename T, bool two>
static inline void dot_2x2() {               // C0 += A0 B0, C1 += A1 B0; with `two` C2 += A0 B1, C3 += A1 B1
    if constexpr (sizeof(T) == 2) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if constexpr (two) {
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 6);
        if constexpr (two) {
            _tile_dpbssd(2, 4, 7);
            _tile_dpbssd(3, 5, 7);
        }
    }
}

// A stored C tile [16 W rows][16 x rows] (float, or W8A8's int32 sums) into y: y[n, r] for x rows n < nn and W rows
// r < nr (y's row n at y + n * ldy), times ws[r] where given, after xs[n] for W8A8 (the scalar order: (float(C) *
// xs[n]) * ws[r]). A 16 x 16 transpose in registers (transpose16), so each x row is one masked store; an
// element-by-element copy cost more than the tiles' products at 32 rows.
template <bool I32>
static inline void put_transposed(const void* cp, int nn, int nr, const float* xs, const float* ws, float* y,
                                  int64_t ldy) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i)
        r[i] = I32 ? _mm512_cvtepi32_ps(_mm512_load_si512(static_cast<const int32_t*>(cp) + 16 * i))
                   : _mm512_load_ps(static_cast<const float*>(cp) + 16 * i);
    transpose16(r, t);
    const __mmask16 m = nr >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nr) - 1);
    const __m512 s = ws ? _mm512_maskz_loadu_ps(m, ws) : _mm512_setzero_ps();
    for (int n = 0; n < nn; ++n) {
        __m512 v = t[n];
        if (xs) v = _mm512_mul_ps(v, _mm512_set1_ps(xs[n]));
        if (ws) v = _mm512_mul_ps(v, s);
        _mm512_mask_storeu_ps(y + n * ldy, m, v);
    }
}

// C tiles 2h, 2h + 1 of a pass (x rows 16 g.., g = 2p + h; W rows ob.. and ob + 16..) into y, as put_transposed.
template <bool I32>
static inline void put_pass(const void* c0, const void* c1, int M, int g, int rows, const float* xs,
                            const float* ws, int ob, float* y, int64_t ldy) {
    const int nn = M - 16 * g < 16 ? M - 16 * g : 16;
    float* yg = y + (int64_t)16 * g * ldy + ob;
    const float* xg = I32 ? xs + 16 * g : nullptr;
    const float* w0 = ws ? ws + ob : nullptr;
    put_transposed<I32>(c0, nn, rows < 16 ? rows : 16, xg, w0, yg, ldy);
    if (rows > 16) put_transposed<I32>(c1, nn, rows - 16, xg, w0 ? w0 + 16 : nullptr, yg + 16, ldy);
}

// One pass of one (or, `two`, two) 16-row groups of x over W rows [ob, ob + rows) into C0-C1 (C2-C3): A tiles
// straight from W (w_tile), B from the packed groups at xb0 (and xb0 + group_words).
template <typename T, bool two>
static inline void amx_pass(const uint32_t* xb0, int64_t group_words, int N, int chunks, int K, const T* w, int ob,
                            int rows, T (&pad)[2][1024 / sizeof(T)], Ahead& ahead) {
    constexpr int KE = AmxTraits<T>::KE;
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int kc = 0; kc < chunks; ++kc) {
        ahead.step(two ? 4096 : 2048);
        CK_TILE_LOAD(6, xb0 + (int64_t)kc * 16 * N, 4 * N);
        if constexpr (two) CK_TILE_LOAD(7, xb0 + group_words + (int64_t)kc * 16 * N, 4 * N);
        int stride;
        const T* a0 = w_tile(w, K, ob, rows < 16 ? rows : 16, kc * KE, pad[0], stride);
        CK_TILE_LOAD(4, a0, stride);
        if (rows > 16) {
            const T* a1 = w_tile(w, K, ob + 16, rows - 16, kc * KE, pad[1], stride);
            CK_TILE_LOAD(5, a1, stride);
        } else {
            _tile_zero(5);
        }
        dot_2x2<T, two>();
    }
}

// y[n, o] for x rows [0, M) and W rows [o0, o1): float C as it is (bf16), or int32 C times xs[n] then ws[o]
// (W8A8, as gemm.h's tile_i8). 32 W rows a block (two A tiles) streamed from memory once: two 16-row groups of x a
// pass (2 x 2 tiles), further passes over the block from L1/L2; the next block's bytes, or `after` past the last,
// requested as the block's chunks are multiplied (gemm.h's Ahead).
template <typename T>
static void amx_linear(const T* x, int64_t ldx, int M, int K, const T* w, const float* xs, const float* ws, int o0,
                       int o1, float* y, int ldy, Ahead after) {
    constexpr int KE = AmxTraits<T>::KE;
    if (M <= 0) return;
    const int chunks = (K + KE - 1) / KE;
    const int N = M < 16 ? M : 16, groups = (M + 15) / 16;    // x rows a B tile holds (the last group zero-padded)
    const int64_t group_words = int64_t(chunks) * 16 * N;
    thread_local std::vector<uint32_t> packed;               // this thread's B tiles, kept between calls
    if (packed.size() < size_t(group_words * groups)) packed.resize(group_words * groups);
    for (int g = 0; g < groups; ++g)
        pack_x(x + int64_t(g) * 16 * ldx, ldx, M - 16 * g < N ? M - 16 * g : N, K, N,
               packed.data() + g * group_words);
    configure_tiles_2x2(N, groups > 1);
    constexpr bool I32 = sizeof(T) == 1;
    alignas(64) T pad[2][1024 / sizeof(T)];
    alignas(64) int32_t c[4][16][16];                        // C0-C3 as stored (float bits for bf16)
    for (int ob = o0; ob < o1; ob += 32) {
        const int rows = o1 - ob < 32 ? o1 - ob : 32;
        Ahead ahead = ahead_of(w, int64_t(K) * int64_t(sizeof(T)), ob, 32, o1, groups, after);   // a pass a group
        for (int g = 0; g < groups; g += 2) {
            if (g + 1 < groups)
                amx_pass<T, true>(packed.data() + g * group_words, group_words, N, chunks, K, w, ob, rows, pad, ahead);
            else
                amx_pass<T, false>(packed.data() + g * group_words, group_words, N, chunks, K, w, ob, rows, pad, ahead);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            put_pass<I32>(c[0], c[1], M, g, rows, xs, I32 ? ws : nullptr, ob, y, ldy);
            if (g + 1 < groups) {
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                put_pass<I32>(c[2], c[3], M, g + 1, rows, xs, I32 ? ws : nullptr, ob, y, ldy);
            }
        }
    }
    _tile_release();                                         // back to the init state: cheaper context switches
    if (packed.size() > (size_t(1) << 20)) std::vector<uint32_t>().swap(packed);   // a prefill's 4 MiB+ not kept
}

// Chunk kc of int8 W rows [o, o + rows) widened to bf16 into `a`: the two A tiles [32 rows][32 of K] of a 32-row
// block, rows past `rows` and K past its end zero. Exact: an int8 has at most 8 significant bits, so its float32 is
// a bf16 with 16 zero bits below (the conversion drops only zeros).
static inline void widen_chunk(const int8_t* w, int K, int o, int rows, int kc, uint16_t* a) {
    const int k = kc * 32;
    if (k + 32 <= K) {
        for (int r = 0; r < rows; ++r) {
            const int8_t* src = w + (int64_t)(o + r) * K + k;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)src)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 16))));
            _mm512_store_si512(a + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    } else {
        const __mmask32 m = (__mmask32(1) << (K - k)) - 1;  // the last chunk: masked-off bytes load as 0
        for (int r = 0; r < rows; ++r) {
            const __m256i b = _mm256_maskz_loadu_epi8(m, w + (int64_t)(o + r) * K + k);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
            _mm512_store_si512(a + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    for (int r = rows; r < 32; ++r) _mm512_store_si512(a + r * 32, _mm512_setzero_si512());
}

// The C tiles of a pass, stored and not yet written into y: written while the next pass multiplies (vector loads
// of a tile store's bytes right after it wait for the pass's last products and for the store to reach L1).
struct PendingPut {
    alignas(64) float c[4][16][16];
    int g = -1, ob = 0, rows = 0;           // g < 0: nothing pending
    bool two = false;
    inline void store(int g_, int ob_, int rows_, bool two_) {
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (two_) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        }
        g = g_, ob = ob_, rows = rows_, two = two_;
    }
    inline void put(int M, const float* ws, float* y, int ldy) {
        if (g < 0) return;
        put_pass<false>(c[0], c[1], M, g, rows, nullptr, ws, ob, y, ldy);
        if (two) put_pass<false>(c[2], c[3], M, g + 1, rows, nullptr, ws, ob, y, ldy);
        g = -1;
    }
};

// Weight-only int8 against bf16 x on tiles: each chunk of 32 W rows by 32 of K widened to bf16 (widen_chunk, into
// slots in L1/L2), two 16-row groups of x a pass (TDPBF16PS, 2 x 2 tiles); passes past the first (over 32 rows of x)
// reuse the widened block. y[n, o] = C[o, n] * ws[o]. The products are exact (int8 times bf16 fits float32's
// significand), summed in float32 in the tiles' order, denormals flushed: an output depends on its W row and x row
// alone (batch-invariant), with bits of its own (not the float path's).
//
// The vector units and the tiles work side by side: chunk kc + 1 (after a block's last chunk, the next block's
// first) is widened between chunk kc's tile loads and its products, and a pass's C tiles are written into y during
// the next pass's first chunk. Run one after the other (the widening just before its loads, C written right after
// its store) they took 1.8x as long at 32 rows with W in L2. The next block is requested as the chunks go, paced
// over the block's passes.
static void amx_linear_i8w(const uint16_t* x, int M, int K, const int8_t* w, const float* ws, int o0, int o1,
                           float* y, int ldy, Ahead after) {
    if (M <= 0) return;
    const int chunks = (K + 31) / 32;
    const int N = M < 16 ? M : 16, groups = (M + 15) / 16, pairs = (groups + 1) / 2;
    const int64_t group_words = int64_t(chunks) * 16 * N;
    thread_local std::vector<uint32_t> packed;               // this thread's B tiles
    thread_local std::vector<uint16_t> wide;                 // this thread's widened chunks (+ alignment slack)
    if (packed.size() < size_t(group_words * groups)) packed.resize(group_words * groups);
    if (wide.size() < size_t(chunks + 1) * 1024 + 32) wide.resize(size_t(chunks + 1) * 1024 + 32);
    uint16_t* buf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(wide.data()) + 63) & ~uintptr_t(63));
    for (int g = 0; g < groups; ++g)
        pack_x(x + int64_t(g) * 16 * K, K, M - 16 * g < N ? M - 16 * g : N, K, N, packed.data() + g * group_words);
    configure_tiles_2x2(N, groups > 1);
    // chunk kc's slot: one pass alternates two (4 KiB in L1), more keep the block's chunks for the later passes. A
    // slot is written only after the tile loads that read it last (program order), so no chunk is overwritten early.
    const auto slot = [&](int kc) { return pairs == 1 ? buf + (kc & 1) * 1024 : buf + int64_t(kc) * 1024; };
    PendingPut pending;
    widen_chunk(w, K, o0, o1 - o0 < 32 ? o1 - o0 : 32, 0, slot(0));
    for (int ob = o0; ob < o1; ob += 32) {
        const int rows = o1 - ob < 32 ? o1 - ob : 32;
        const int next_rows = o1 - ob - 32 < 32 ? o1 - ob - 32 : 32;   // <= 0 past the last block
        Ahead ahead = ahead_of(w, K, ob, 32, o1, 1, after);
        ahead.passes = pairs;               // the first pass's widening and every later pass earn the block's bytes
        for (int p = 0; p < pairs; ++p) {
            const uint32_t* xb0 = packed.data() + 2 * p * group_words;
            const bool two = 2 * p + 1 < groups;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int kc = 0; kc < chunks; ++kc) {
                const uint16_t* a = slot(kc);
                CK_TILE_LOAD(4, a, 64);
                CK_TILE_LOAD(5, a + 512, 64);
                CK_TILE_LOAD(6, xb0 + (int64_t)kc * 16 * N, 4 * N);
                if (two) CK_TILE_LOAD(7, xb0 + group_words + (int64_t)kc * 16 * N, 4 * N);
                if (p == 0 && kc + 1 < chunks) widen_chunk(w, K, ob, rows, kc + 1, slot(kc + 1));
                else if (p + 1 == pairs && kc + 1 == chunks && next_rows > 0)
                    widen_chunk(w, K, ob + 32, next_rows, 0, slot(0));
                ahead.step(1024);
                if (kc == 0) pending.put(M, ws, y, ldy);
                if (two) dot_2x2<uint16_t, true>();
                else dot_2x2<uint16_t, false>();
            }
            pending.store(2 * p, ob, rows, two);
        }
    }
    pending.put(M, ws, y, ldy);
    _tile_release();
    if (packed.size() > (size_t(1) << 20)) std::vector<uint32_t>().swap(packed);
    if (wide.size() > (size_t(1) << 20)) std::vector<uint16_t>().swap(wide);
}

}  // namespace colibri_native

// bf16 x [M, K] (values that are bf16) against bf16 w [Dout, K], rows o0..o1 of y [M, ldy] (float32).
extern "C" void colibri_linear_bf16_amx(const uint16_t* x, int M, int K, const uint16_t* w, int o0, int o1, float* y,
                                        int ldy, const void* next, int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    amx_linear<uint16_t>(x, K, M, K, w, nullptr, nullptr, o0, o1, y, ldy, Ahead{n, n ? n + next_bytes : n});
}

// W8A8 on tiles: the arguments of gemm.h's colibri_linear_i8_<ISA> (xq [M, Kp] rows quantised, scales xs; w int8
// [Dout, K] with scales ws), the same bits.
extern "C" void colibri_linear_i8_tiles_amx(const int8_t* xq, const float* xs, int M, int Kp, int K, const int8_t* w,
                                            const float* ws, int o0, int o1, float* y, int ldy, const void* next,
                                            int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    amx_linear<int8_t>(xq, Kp, M, K, w, xs, ws, o0, o1, y, ldy, Ahead{n, n ? n + next_bytes : n});
}

// Weight-only int8 w [Dout, K] (row scales ws) against bf16 x [M, K] on tiles (amx_linear_i8w), rows o0..o1 of y.
extern "C" void colibri_linear_i8w_bf16_amx(const uint16_t* x, int M, int K, const int8_t* w, const float* ws, int o0,
                                            int o1, float* y, int ldy, const void* next, int64_t next_bytes) {
    using namespace colibri_native;
    const char* n = static_cast<const char*>(next);
    amx_linear_i8w(x, M, K, w, ws, o0, o1, y, ldy, Ahead{n, n ? n + next_bytes : n});
}
