// y = x @ W.T on AMX tiles (Sapphire Rapids and later), for the amx level (isa_amx.cpp, after gemm.h): bf16 x
// against bf16 W (TDPBF16PS) and W8A8's int8 rows against int8 W (TDPBSSD). Included by that unit only.
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

// Tiles 0-1: C [16 W rows, N x rows], 2-3: A [16 W rows, 64 bytes], 4: B [16 groups, N x rows]: N * 4 bytes a row
// of B and C, so a B tile holds only the rows there are. Loaded for every pass: the thread may have run another AMX
// user (oneDNN) since.
static inline void configure_tiles(int N) {
    TileConfig cfg;
    for (int t = 0; t < 5; ++t) {
        cfg.colsb[t] = uint16_t(t == 2 || t == 3 ? 64 : 4 * N);
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));        // all 64 bytes an input (GCC 12's intrinsic names 8 of them)
}

// tileloadd with a memory clobber: GCC's _tile_loadd passes only the address, so stores into a buffer it reads
// (the zero-padded tails, the packed x) could be dropped or moved past it.
#define CK_TILE_LOAD(tmm, p, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tmm ::"r"(p), "r"(int64_t(stride)) : "memory")

template <typename T>   // uint16_t: bf16 against bf16; int8_t: int8 against int8
struct AmxTraits {
    static constexpr int KE = 64 / int(sizeof(T));   // K elements a tile row holds
};

// B: rows [0, n) of x [., ldx] (n <= N <= 16) as 4-byte groups of K (bf16 pairs, int8 quads) with each group's N
// rows side by side, [K / 4 rounded up][N], into `out` zeroed by the caller: a transpose of 4-byte words.
template <typename T>
static void pack_x(const T* x, int64_t ldx, int n, int K, int N, uint32_t* out) {
    const int bytes = K * int(sizeof(T)), full = bytes / 4;
    for (int i = 0; i < n; ++i) {
        const char* row = reinterpret_cast<const char*>(x + i * ldx);
        for (int g = 0; g < full; ++g) std::memcpy(out + (int64_t)g * N + i, row + 4 * g, 4);
        if (bytes > 4 * full) std::memcpy(out + (int64_t)full * N + i, row + 4 * full, bytes - 4 * full);
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

template <typename T>
static inline void dot_tiles() {          // C0 += A0 B, C1 += A1 B
    if constexpr (sizeof(T) == 2) {
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
    } else {
        _tile_dpbssd(0, 2, 4);
        _tile_dpbssd(1, 3, 4);
    }
}

// y[n, o] for x rows [0, M) and W rows [o0, o1): float C as it is (bf16), or int32 C times xs[n] then ws[o]
// (W8A8, as gemm.h's tile_i8). 32 W rows a block (two A tiles) streamed from memory once: every 16-row group of x
// passes over the block while it is in L1/L2; the next block's bytes, or `after` past the last, requested as the
// block's chunks are multiplied (gemm.h's Ahead).
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
    for (int g = 0; g < groups; ++g) {
        std::memset(packed.data() + g * group_words, 0, group_words * 4);
        pack_x(x + int64_t(g) * 16 * ldx, ldx, M - 16 * g < N ? M - 16 * g : N, K, N,
               packed.data() + g * group_words);
    }
    configure_tiles(N);
    alignas(64) T pad[1024 / sizeof(T)];
    alignas(64) int32_t c[32][16];                           // C0 and C1 as stored (float bits for bf16)
    for (int ob = o0; ob < o1; ob += 32) {
        const int rows = o1 - ob < 32 ? o1 - ob : 32;
        // every group passes over the block (ahead_of counts 4-row passes)
        Ahead ahead = ahead_of(w, int64_t(K) * int64_t(sizeof(T)), ob, 32, o1, 4 * groups, after);
        for (int g = 0; g < groups; ++g) {
            const uint32_t* xb = packed.data() + g * group_words;
            _tile_zero(0);
            _tile_zero(1);
            for (int kc = 0; kc < chunks; ++kc) {
                ahead.step(2048);
                CK_TILE_LOAD(4, xb + (int64_t)kc * 16 * N, 4 * N);
                int stride;
                const T* a0 = w_tile(w, K, ob, rows < 16 ? rows : 16, kc * KE, pad, stride);
                CK_TILE_LOAD(2, a0, stride);
                if (rows > 16) {
                    const T* a1 = w_tile(w, K, ob + 16, rows - 16, kc * KE, pad, stride);
                    CK_TILE_LOAD(3, a1, stride);
                } else {
                    _tile_zero(3);
                }
                dot_tiles<T>();
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[16], 64);
            for (int n = 16 * g; n < M && n < 16 * g + 16; ++n) {
                float* yn = y + (int64_t)n * ldy + ob;
                for (int r = 0; r < rows; ++r) {
                    if constexpr (sizeof(T) == 2) {
                        std::memcpy(yn + r, &c[r][n - 16 * g], 4);
                    } else {
                        yn[r] = (float(c[r][n - 16 * g]) * xs[n]) * ws[ob + r];
                    }
                }
            }
        }
    }
    _tile_release();                                         // back to the init state: cheaper context switches
    if (packed.size() > (size_t(1) << 20)) std::vector<uint32_t>().swap(packed);   // a prefill's 4 MiB+ not kept
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
