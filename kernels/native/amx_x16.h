// Weight-only int8 against bf16 x on AMX's int8 tiles, for the amx level (isa_amx.cpp, after amx.h; gemm.h's
// entry point sends its wdtype 3 here). x is the int16 form's (gemm.h's quantize_x16: each row in blocks of QB = 256
// along K, a float32 scale a block), split into two bytes, q = 256 * hi + lo with hi = q >> 8 (signed) and lo = q &
// 255 (unsigned), and multiplied by the int8 weights with TDPBSSD (W against hi) and TDPBSUD (W against lo) into two
// int32 tiles a block: 256 * C_hi + C_lo is the block's exact sum of w * q (its magnitude at most 256 * 127 * 32767
// < 2^31, and C_hi's and C_lo's less). Then per block acc = fma(float(sum), scale_b, acc) in float32, in block
// order, and y = acc * ws[o]: the arithmetic of the amx level's vector int16 form too (gemm.h's CK_X16_TILES), which
// takes the calls of few rows (X16_VECTOR_ROWS), so an output's bits depend on its W row and x row alone, never on
// how many rows share the call, nor on the tile or thread (a MoE layer's pair gets the same bits whatever its
// expert's other pairs).
//
// Why: the vector form multiplies 32 pairs an instruction for each row of x, so from a few rows a weight byte costs
// more multiply-adds than memory time (a MoE layer's int8 experts at 32 tokens, about 4 rows an expert, read 62% of
// the read rate with 83% of the time in the vector tiles: docs/performance.md). A tile multiplies 16 W rows by 64
// bytes of K against up to 16 rows of x, two instructions for both bytes of x.
//
// Tiles: 0-1 C (hi, lo), 2-3 A (16 W rows by 64 bytes straight from memory, amx.h's w_tile, for even and odd
// chunks), 4-5 B (hi, lo of one 16-row group of x, packed by amx.h's pack_x, even chunks), 6-7 B (odd chunks): a
// chunk's tiles are loaded while the chunk before's products may still run (one A tile reused chunk after chunk
// waits for them: 1.2x as long at one row). 16 W rows a block, streamed from memory once; each further 16 rows of x
// a pass over them from L1/L2. A block's C tiles are stored at its end and scaled into float32 sums after the next
// block's first products are issued.

#include <immintrin.h>

#include <vector>

namespace colibri_native {

// q [M, Kp] int16 rows (Kp a multiple of 32) -> hi [M, Kp] (q >> 8, signed) and lo [M, Kp] (q & 255, unsigned).
static inline void split_x16(const int16_t* q, int64_t n, int8_t* hi, uint8_t* lo) {
    const __m512i low_byte = _mm512_set1_epi16(0xff);
    for (int64_t k = 0; k < n; k += 32) {
        const __m512i v = _mm512_loadu_si512(q + k);
        _mm256_storeu_si256((__m256i*)(hi + k), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256((__m256i*)(lo + k), _mm512_cvtepi16_epi8(_mm512_and_si512(v, low_byte)));
    }
}

// A block's stored C tiles (hi, lo) of `rows` W rows into their float32 sums: acc[r] = fma(float(256 * hi + lo),
// scale, acc[r]) for each x row (lane).
static inline void scale_block(const int32_t (&hi)[16][16], const int32_t (&lo)[16][16], int rows, __m512 scale,
                               float (*acc)[16]) {
    for (int r = 0; r < rows; ++r) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[r]), 8), _mm512_load_si512(lo[r]));
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, _mm512_load_ps(acc[r])));
    }
}

// A pending block: its C tiles stored, its scaling left until the next block's first products are issued.
struct PendingBlock {
    alignas(64) int32_t c[2][16][16] = {};   // hi, lo; columns past the B tiles' stay zero (a store writes their width)
    __m512 scale = _mm512_setzero_ps();
    int rows = 0;                           // 0: nothing pending
    inline void store(int rows_, __m512 scale_) {
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        rows = rows_, scale = scale_;
    }
    inline void flush(float (*acc)[16]) {
        if (rows) scale_block(c[0], c[1], rows, scale, acc);
        rows = 0;
    }
};

// The weights' chunk NEAR chunks ahead in the block requested into L1 (the block's own lines are in L2 by then, from
// Ahead): a tile load from L2 waits on its 16 lines. At two rows of x the tiles ran 0.91-0.97x as fast as the vector
// lanes without this, 0.99-1.02x with it; requesting the next block's first chunks too (lines not yet in L2) ran
// 0.93-0.96x (C++ drivers over this file, one thread, alternating).
struct NearAhead {
    static constexpr int NEAR = 4;
    inline void step(const int8_t* w, int K, int ob, int o1, int kc, int chunks) const {
        const int k = kc + NEAR;
        if (k >= chunks || o1 - ob < 16) return;                      // a partial block's rows are copied anyway
        const int8_t* p = w + int64_t(ob) * K + int64_t(k) * 64;
        for (int r = 0; r < 16; ++r) __builtin_prefetch(p + int64_t(r) * K, 0, 3);
    }
};

// Tiles for 16 W rows a pass: 0-1 C (hi, lo), 2-3 A (even and odd chunks), 4-5 B (hi, lo, even), 6-7 B (odd).
static inline void configure_tiles_x16(int N) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = uint16_t(t == 2 || t == 3 ? 64 : 4 * N);
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

// One chunk's products into C 0-1 on tile set (A, BH, BL): its A tile (a, stride) and B tiles (hi h, lo l) loaded
// there, W against hi, then against lo, with the prefetch Ahead earns for half the chunk between them.
template <int A, int BH, int BL>
static inline void x16_chunk(const int8_t* a, int stride, const uint32_t* h, const uint32_t* l, int N, Ahead& ahead) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(a), "r"(int64_t(stride)), "i"(A) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(h), "r"(int64_t(4 * N)), "i"(BH) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(l), "r"(int64_t(4 * N)), "i"(BL) : "memory");
    __asm__ volatile("tdpbssd %%tmm%c1, %%tmm%c0, %%tmm0" ::"i"(A), "i"(BH));   // GCC's _tile_* name tiles by text
    ahead.step(512);
    __asm__ volatile("tdpbsud %%tmm%c1, %%tmm%c0, %%tmm1" ::"i"(A), "i"(BL));
}

// y[n, o] for x rows [0, M) (quantised: q [M, Kp], scales xs [M, nb]) and W rows [o0, o1) (int8, row scales ws).
static void amx_linear_x16(const int16_t* q, const float* xs, int M, int Kp, int K, const int8_t* w, const float* ws,
                           int o0, int o1, float* y, int ldy, Ahead after) {
    constexpr int CPB = QB / 64;                             // chunks of 64 bytes a block of x's scales covers
    const int chunks = (K + 63) / 64, nb = (K + QB - 1) / QB;
    const int N = M < 16 ? M : 16, groups = (M + 15) / 16;
    const int64_t group_words = int64_t(chunks) * 16 * N;
    thread_local std::vector<uint32_t> packed;               // the groups' hi B tiles, then their lo ones
    thread_local std::vector<int8_t> halves;                 // x's hi rows, then its lo rows
    thread_local std::vector<float> scales;                  // [groups][nb][16]: a block's scales across a group
    packed.resize(size_t(2 * groups) * group_words);
    halves.resize(size_t(2) * M * Kp);
    scales.assign(size_t(groups) * nb * 16, 0.f);
    int8_t* hi = halves.data();
    uint8_t* lo = reinterpret_cast<uint8_t*>(hi + int64_t(M) * Kp);
    split_x16(q, int64_t(M) * Kp, hi, lo);
    for (int g = 0; g < groups; ++g) {
        const int n = M - 16 * g < N ? M - 16 * g : N;
        pack_x(hi + int64_t(16) * g * Kp, Kp, n, K, N, packed.data() + g * group_words);
        pack_x(reinterpret_cast<const int8_t*>(lo) + int64_t(16) * g * Kp, Kp, n, K, N,
               packed.data() + (groups + g) * group_words);
        for (int i = 0; i < n; ++i)
            for (int b = 0; b < nb; ++b) scales[(size_t(g) * nb + b) * 16 + i] = xs[int64_t(16 * g + i) * nb + b];
    }
    configure_tiles_x16(N);
    alignas(64) int8_t pad[2][1024];
    alignas(64) float acc[16][16];
    PendingBlock pending;
    const NearAhead near;
    for (int ob = o0; ob < o1; ob += 16) {
        const int rows = o1 - ob < 16 ? o1 - ob : 16;
        Ahead ahead = ahead_of(w, K, ob, 16, o1, groups, after);            // a pass a group
        for (int g = 0; g < groups; ++g) {
            const uint32_t* bh = packed.data() + g * group_words;
            const uint32_t* bl = packed.data() + (groups + g) * group_words;
            std::memset(acc, 0, sizeof acc);
            for (int b = 0; b < nb; ++b) {
                _tile_zero(0);
                _tile_zero(1);
                const int k1 = (b + 1) * CPB < chunks ? (b + 1) * CPB : chunks;
                for (int kc = b * CPB; kc < k1; ++kc) {
                    int stride;
                    const int8_t* a = w_tile(w, K, ob, rows, kc * 64, pad[kc & 1], stride);
                    if (g == 0) near.step(w, K, ob, o1, kc, chunks);
                    ahead.step(512);
                    const uint32_t *h = bh + (int64_t)kc * 16 * N, *l = bl + (int64_t)kc * 16 * N;
                    if (kc & 1) x16_chunk<3, 6, 7>(a, stride, h, l, N, ahead);
                    else x16_chunk<2, 4, 5>(a, stride, h, l, N, ahead);
                    if (kc == b * CPB) pending.flush(acc);           // the last block's sums, beside these products
                }
                pending.store(rows, _mm512_loadu_ps(&scales[(size_t(g) * nb + b) * 16]));
            }
            pending.flush(acc);
            const int nn = M - 16 * g < 16 ? M - 16 * g : 16;
            put_transposed<false>(acc[0], nn, rows, nullptr, ws + ob, y + int64_t(16) * g * ldy + ob, ldy);
        }
    }
    _tile_release();
    if (packed.size() > (size_t(1) << 20)) std::vector<uint32_t>().swap(packed);   // a prefill's not kept
    if (halves.size() > (size_t(4) << 20)) std::vector<int8_t>().swap(halves);
}

// The calls of at most this many rows of x take gemm.h's vector int16 form (the same bits): at one row it read a MoE
// layer's int8 experts 1.1x as fast as the tiles (memory-bound either way; a tile multiplies 16 rows in the time of
// one). At two rows the tiles ran 0.97-0.99x as fast as the vector form's lanes did before, and the vector form with
// its exact totals 0.90x, so the tiles take them; from four rows the tiles ran 1.22x and more (docs/performance.md).
constexpr int X16_VECTOR_ROWS = 1;

static void linear_x16_amx(const float* x, int M, int K, const int8_t* w, const float* ws, int o0, int o1, float* y,
                           int ldy, Ahead after) {
    if (M <= X16_VECTOR_ROWS) return linear_block_x16(x, M, K, w, ws, o0, o1, y, ldy, after);
    const X16Rows xq = quantized_x16(x, M, K);
    amx_linear_x16(xq.q, xq.s, M, xq.Kp, K, w, ws, o0, o1, y, ldy, after);
}

}  // namespace colibri_native
