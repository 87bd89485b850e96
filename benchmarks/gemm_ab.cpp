// Two builds of kernels/native/gemm.h side by side (benchmarks/gemm_ab.py compiles them as colibri_linear_A and
// colibri_linear_B, with the flags of one ISA level, and links this driver): each A/B round times both on the same
// weights in memory, alternating which goes first, and reports the best and mean time of each, with whether the
// two builds wrote the same bits.
//
//   gemm_ab layer KIND ROWS THREADS ROUNDS   a MoE layer of the bench shapes: 8 of 64 experts (H 1024, I 512),
//                                            fresh ones every call over 3 layers, whole experts per thread as
//                                            moe_op.cpp's by_expert does, each projection told the next one's bytes
//   gemm_ab linear KIND ROWS THREADS ROUNDS  lm_head [32000, 1024], its rows split over the threads, the calls
//                                            cycling through copies of it (over 4x a 32 MiB L3 in all)
//
// KIND: bf16 | int8 (weight-only, float32 rows) | int8b (weight-only, rows that were bf16: the entry point's wdtype
// 3, the int16 form on every level but generic) | w8a8 (int8 rows) | bf16dp (bf16 rows on dpbf16.h's
// colibri_linear_bf16_A/B, linked where gemm_ab.py compiled dpbf16.h in; a layer's down keeps the float path).
// The weights lie on 2 MiB pages (anonymous memory advised MADV_HUGEPAGE, the share the kernel granted printed as
// huge_kb), as in-place experts over a page cache of 2 MiB folios; every call reads them from memory (576 MiB of bf16
// experts across the 3 layers, 192 MiB a layer; lm_head 62.5 MiB in bf16, 31 in int8, in copies of at least 128 MiB
// together). Output: "A|B best_ms mean_ms GB/s", "same_bits 0|1", "huge_kb N".

#include <omp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

typedef void (*linear_fn)(const float*, int, int, const void*, int, const float*, int, int, float*, int, const void*,
                          int64_t);
typedef void (*linear_i8_fn)(const int8_t*, const float*, int, int, int, const int8_t*, const float*, int, int, float*,
                             int, const void*, int64_t);
extern "C" void colibri_linear_A(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                                 const void*, int64_t);
extern "C" void colibri_linear_B(const float*, int, int, const void*, int, const float*, int, int, float*, int,
                                 const void*, int64_t);
extern "C" void colibri_linear_i8_A(const int8_t*, const float*, int, int, int, const int8_t*, const float*, int, int,
                                    float*, int, const void*, int64_t);
extern "C" void colibri_linear_i8_B(const int8_t*, const float*, int, int, int, const int8_t*, const float*, int, int,
                                    float*, int, const void*, int64_t);
typedef void (*linear_bf16_fn)(const uint16_t*, int, int, const uint16_t*, int, int, float*, int, const void*, int64_t);
// dpbf16.h's, present only where the builds include it (weak: null otherwise, and bf16dp is refused)
extern "C" __attribute__((weak)) void colibri_linear_bf16_A(const uint16_t*, int, int, const uint16_t*, int, int,
                                                            float*, int, const void*, int64_t);
extern "C" __attribute__((weak)) void colibri_linear_bf16_B(const uint16_t*, int, int, const uint16_t*, int, int,
                                                            float*, int, const void*, int64_t);

namespace {

constexpr int H = 1024, I = 512, E = 64, LAYERS = 3, TOPK = 8, VOCAB = 32000;
constexpr size_t HUGE_PAGE = size_t(2) << 20;

// this process's anonymous memory on 2 MiB pages (AnonHugePages of /proc/self/smaps_rollup), -1 if unknown
long anon_huge_kb() {
    FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
    std::fclose(f);
    return kb;
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// `bytes` of random weights on 2 MiB pages: small finite bf16 values, or int8 in [-127, 127]
char* weights(size_t bytes, bool bf16) {
    void* raw = mmap(nullptr, bytes + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        std::perror("mmap");
        std::exit(2);
    }
    char* w = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw) + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1));
    madvise(w, bytes, MADV_HUGEPAGE);
    std::mt19937 rng(7);
    for (size_t i = 0; i + 4 <= bytes; i += 4) {           // 4 bytes a draw
        const uint32_t r = rng();
        if (bf16) {                                          // two values of magnitude 0.5-2, either sign
            const uint16_t v[2] = {uint16_t(0x3f00 + (r & 0x7f) + ((r >> 8) & 0x80) + ((r & 0x100) << 7)),
                                   uint16_t(0x3f00 + ((r >> 16) & 0x7f) + ((r >> 24) & 0x80) + ((r >> 9) & 0x8000))};
            std::memcpy(w + i, v, 4);
        } else {
            for (int j = 0; j < 4; ++j) w[i + j] = char(int((r >> (8 * j)) & 0xff) % 255 - 127);
        }
    }
    return w;
}

struct Bench {
    std::string mode;
    int kind = 1;                       // the entry point's wdtype: 1 bf16, 2 int8, 4 = wdtype 3; 3 = W8A8 (linear_i8);
                                        // 5 = bf16 rows on linear_bf16 (x's; h keeps the float path)
    int rows = 1;
    size_t esize = 2;
    char* w = nullptr;
    std::vector<float> x, h, scale, xs, y;
    std::vector<int8_t> xq, hq;
    std::vector<uint16_t> xb;           // x as bf16 (bf16dp)
    std::vector<int> picks;             // the experts of each call, TOPK a call
    int calls = 0;
    int copies = 1;                     // linear: copies of the matrix the calls cycle through

    size_t expert_bytes() const { return size_t(3) * I * H * esize; }          // gate/up [2I, H] + down [H, I]
    size_t matrix_bytes() const { return size_t(VOCAB) * H * esize; }
    size_t read_per_call() const { return mode == "layer" ? TOPK * expert_bytes() : matrix_bytes(); }

    // one projection, build A or B: columns o0..o1 of out [rows, ldy] = in [rows, K] @ W.T (W's rows o0..o1), the
    // bytes [next, next + next_bytes) told
    void project(bool b, const float* in, const int8_t* inq, int K, const char* W, int o0, int o1, float* out,
                 int ldy, const char* next, int64_t next_bytes) const {
        if (kind == 5 && in == x.data()) {
            linear_bf16_fn f = b ? colibri_linear_bf16_B : colibri_linear_bf16_A;
            f(xb.data(), rows, K, reinterpret_cast<const uint16_t*>(W), o0, o1, out, ldy, next, next_bytes);
        } else if (kind == 3) {
            linear_i8_fn f = b ? colibri_linear_i8_B : colibri_linear_i8_A;
            f(inq, xs.data(), rows, K, K, reinterpret_cast<const int8_t*>(W), scale.data(), o0, o1, out, ldy, next,
              next_bytes);
        } else {
            linear_fn f = b ? colibri_linear_B : colibri_linear_A;
            const int wd = kind == 4 ? 3 : kind == 5 ? 1 : kind;
            f(in, rows, K, W, wd, wd != 1 ? scale.data() : nullptr, o0, o1, out, ldy, next, next_bytes);
        }
    }

    void call(bool b, int c) {
        if (mode == "linear") {
#pragma omp parallel
            {
                int nt = omp_get_num_threads(), id = omp_get_thread_num();
                int o0 = int(int64_t(VOCAB) * id / nt), o1 = int(int64_t(VOCAB) * (id + 1) / nt);
                project(b, x.data(), xq.data(), H, w + size_t(c % copies) * matrix_bytes(), o0, o1, y.data(), VOCAB,
                        nullptr, 0);
            }
            return;
        }
        const char* layer = w + size_t(c % LAYERS) * E * expert_bytes();
        const int* ex = &picks[size_t(c % calls) * TOPK];
        const size_t b13 = size_t(2) * I * H * esize, b2 = size_t(H) * I * esize;
#pragma omp parallel
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num();
            int a0 = TOPK * id / nt, a1 = TOPK * (id + 1) / nt;
            for (int a = a0; a < a1; ++a) {
                const char* w13 = layer + b13 * ex[a];
                const char* w2 = layer + b13 * E + b2 * ex[a];
                float* gu = y.data() + size_t(a) * rows * (2 * I + H);                  // [rows, 2I] then [rows, H]
                project(b, x.data(), xq.data(), H, w13, 0, 2 * I, gu, 2 * I, w2, int64_t(b2));
                const char* nx = a + 1 < a1 ? layer + b13 * ex[a + 1] : nullptr;
                project(b, h.data(), hq.data(), I, w2, 0, H, gu + size_t(rows) * 2 * I, H, nx, nx ? int64_t(b13) : 0);
            }
        }
    }
};

}  // namespace

int main(int argc, char** argv) {
    // Linux's leave to use AMX tiles (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), for a B built with
    // gemm_ab.py --x16-tiles; refused (and never needed) elsewhere
    syscall(SYS_arch_prctl, 0x1023, 18);
    if (argc != 6) {
        std::fprintf(stderr, "usage: gemm_ab layer|linear bf16|int8|int8b|w8a8|bf16dp ROWS THREADS ROUNDS\n");
        return 2;
    }
    Bench bench;
    bench.mode = argv[1];
    const std::string kind = argv[2];
    bench.rows = std::atoi(argv[3]);
    const int threads = std::atoi(argv[4]), rounds = std::atoi(argv[5]);
    const bool bf16 = kind == "bf16" || kind == "bf16dp";
    if ((bench.mode != "layer" && bench.mode != "linear") ||
        (!bf16 && kind != "int8" && kind != "int8b" && kind != "w8a8") || bench.rows < 1 || bench.rows > 64 ||
        threads < 1 || rounds < 1) {
        std::fprintf(stderr, "gemm_ab: bad arguments (layer|linear, bf16|int8|int8b|w8a8|bf16dp, rows 1-64, threads, "
                     "rounds)\n");
        return 2;
    }
    if (kind == "bf16dp" && (!colibri_linear_bf16_A || !colibri_linear_bf16_B)) {
        std::fprintf(stderr, "gemm_ab: bf16dp needs both builds with dpbf16.h (gemm_ab.py --kinds bf16dp)\n");
        return 2;
    }
    bench.kind = kind == "bf16" ? 1 : kind == "bf16dp" ? 5 : kind == "int8" ? 2 : kind == "int8b" ? 4 : 3;
    bench.esize = bf16 ? 2 : 1;
    omp_set_num_threads(threads);
    if (bench.mode == "linear")
        bench.copies = int((size_t(128) << 20) / bench.matrix_bytes()) + 1;
    const size_t total = bench.mode == "layer" ? size_t(LAYERS) * E * bench.expert_bytes()
                                               : size_t(bench.copies) * bench.matrix_bytes();
    bench.w = weights(total, bf16);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    const int R = bench.rows;
    bench.x.resize(size_t(R) * H);
    bench.h.resize(size_t(R) * I);
    for (float& v : bench.x) v = uni(rng);
    for (float& v : bench.h) v = uni(rng);
    bench.xb.resize(bench.x.size());
    for (size_t i = 0; i < bench.x.size(); ++i) {              // x rounded to bf16 (nearest even), and x made those
        uint32_t u;                                            // values, so both kinds multiply the same rows
        std::memcpy(&u, &bench.x[i], 4);
        u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
        std::memcpy(&bench.x[i], &u, 4);
        bench.xb[i] = uint16_t(u >> 16);
    }
    bench.xq.resize(size_t(R) * H);
    bench.hq.resize(size_t(R) * I);
    for (int8_t& v : bench.xq) v = int8_t(int(rng() % 255) - 127);
    for (int8_t& v : bench.hq) v = int8_t(int(rng() % 255) - 127);
    bench.xs.assign(R, 0.01f);
    bench.scale.assign(std::max(VOCAB, 2 * I), 0.02f);
    bench.y.assign(bench.mode == "layer" ? size_t(TOPK) * R * (2 * I + H) : size_t(R) * VOCAB, 0.f);
    bench.calls = bench.mode == "layer" ? 64 : 1;
    for (int c = 0; c < bench.calls; ++c) {                  // TOPK distinct experts a call
        std::vector<int> all(E);
        for (int e = 0; e < E; ++e) all[e] = e;
        for (int k = 0; k < TOPK; ++k) std::swap(all[k], all[k + int(rng() % (E - k))]);
        bench.picks.insert(bench.picks.end(), all.begin(), all.begin() + TOPK);
    }
    // the same bits? one call of each on the same inputs, each into an output filled with NaN first (so an output
    // one build leaves unwritten differs)
    std::fill(bench.y.begin(), bench.y.end(), std::numeric_limits<float>::quiet_NaN());
    bench.call(false, 0);
    std::vector<float> ya = bench.y;
    std::fill(bench.y.begin(), bench.y.end(), std::numeric_limits<float>::quiet_NaN());
    bench.call(true, 0);
    const bool same = std::memcmp(ya.data(), bench.y.data(), ya.size() * sizeof(float)) == 0;

    const int per_round = bench.mode == "layer" ? 3 * bench.calls : 4 * bench.copies;   // all weights read afresh
    double best[2] = {1e30, 1e30}, sum[2] = {0, 0};
    for (int r = 0; r < rounds; ++r)
        for (int i = 0; i < 2; ++i) {
            const int v = (r + i) % 2;                       // A first in even rounds, B first in odd ones
            for (int c = 0; c < 4; ++c) bench.call(v == 1, c);   // warm the path, not the weights
            double t = now();
            for (int c = 0; c < per_round; ++c) bench.call(v == 1, c);
            double dt = (now() - t) / per_round;
            best[v] = std::min(best[v], dt);
            sum[v] += dt;
        }
    const double gb = double(bench.read_per_call()) / 1e9;
    for (int v = 0; v < 2; ++v)
        std::printf("%c %.4f %.4f %.2f\n", "AB"[v], best[v] * 1e3, sum[v] / rounds * 1e3, gb / best[v]);
    std::printf("same_bits %d\n", same ? 1 : 0);
    std::printf("huge_kb %ld\n", anon_huge_kb());
    return 0;
}
