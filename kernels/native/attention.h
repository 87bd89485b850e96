// Decode attention over the paged KV cache: one query row per sequence against its context's key and value rows
// where the cache holds them (no gather, no padding), for one KV head and the R query heads that share it (GQA).
// Included by isa_*.cpp after gemm.h (its vector types and widening loads), so it is compiled once per ISA level.
//
// The maths of SDPA's CPU flash kernel for one query: scores s_j = (q · k_j) · scale in float32 (each one vector
// accumulator over the head dim, keys in groups of 8 whose lanes one shuffle tree sums), m = the largest score (and the
// head's sink logit, GPT-OSS), p_j = exp(s_j - m), l = Σ p_j (+ exp(sink - m)), and out = (Σ p_j · v_j) / l, where
// p_j is rounded to bf16 for a bf16 cache before it weights the values (as the flash kernel feeds its reduced-type
// probabilities to the PV product) while l sums the unrounded ones. Every row's result depends on its own keys
// only: batch invariant by construction.
//
// Shapes: R query heads of one KV head, D the key dim, Dv the value dim, n context keys.

#include <unistd.h>

namespace colibri_native {

// exp(x) up to ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n by the exponent bits); x
// below -87.3 gives exp(-87.3) ≈ 1e-38, a weight that adds nothing beside the largest one's 1.
static inline fvec vexp(fvec x) {
    const fvec lo = fvec{} - 87.3f, hi = fvec{} + 88.0f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const fvec magic = fvec{} + 12582912.0f;                  // 1.5 * 2^23: adding it rounds to an integer
    fvec n = (x * 1.44269504088896341f + magic) - magic;
    fvec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    fvec y = fvec{} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    ivec e = (__builtin_convertvector(n, ivec) + 127) << 23;
    fvec scale;
    std::memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

static inline float bf16_round(float f) {                     // round to nearest even at bf16, kept as float32
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&f, &u, 4);
    return f;
}

// The lane sums of 8 accumulators as one vector (lane i = the sum of a[i]'s lanes): pairwise adds of shuffled
// halves, one fixed tree for every key of a group.
static inline fvec sums8(const fvec* a) {
#if CK_WIDTH == 8
    fvec h[4];
    for (int i = 0; i < 4; ++i)
        h[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    fvec q0 = __builtin_shufflevector(h[0], h[1], 0, 2, 8, 10, 4, 6, 12, 14) +
              __builtin_shufflevector(h[0], h[1], 1, 3, 9, 11, 5, 7, 13, 15);
    fvec q1 = __builtin_shufflevector(h[2], h[3], 0, 2, 8, 10, 4, 6, 12, 14) +
              __builtin_shufflevector(h[2], h[3], 1, 3, 9, 11, 5, 7, 13, 15);
    return __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
#else
    fvec out;                                        // wider vectors: each accumulator's lanes by lanes_sum
    float o[CK_WIDTH] = {};
    for (int i = 0; i < 8; ++i) o[i] = lanes_sum(a[i]);
    std::memcpy(&out, o, sizeof out);
    return out;
#endif
}

// Scores of query head q [D] against a group of 8 keys (rows k[j], all of D): s[j] = (q · k_j) · scale, each one
// vector accumulator over the head dim, the lanes summed by sums8.
static inline void score_group(const float* q, int D, const float* const* k, float* s, float scale) {
    fvec acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = fvec{};
    int d = 0;
    for (; d + CK_WIDTH <= D; d += CK_WIDTH) {
        const fvec qv = widen(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) acc[j] += qv * widen(k[j] + d);
    }
    if (d < D) {
        const fvec qv = widen_tail(q + d, D - d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) acc[j] += qv * widen_tail(k[j] + d, D - d);
    }
    float out[CK_WIDTH];
    fvec v = sums8(acc) * scale;
    std::memcpy(out, &v, sizeof out);
    std::memcpy(s, out, 8 * sizeof(float));
}

// p = exp(s - m) in place over n scores; returns l = Σ p (+ the sink's share); p rounded to bf16 if asked.
static inline float softmax_row(float* s, int n, const float* sink, bool round_p) {
    float m = sink ? *sink : -__builtin_inff();
    for (int j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
    fvec sum = {};
    int j = 0;
    for (; j + CK_WIDTH <= n; j += CK_WIDTH) {
        fvec p = vexp(load<fvec>(s + j) - m);
        sum += p;
        std::memcpy(s + j, &p, sizeof p);
    }
    float l = lanes_sum(sum);
    if (j < n) {
        float buf[CK_WIDTH] = {};
        std::memcpy(buf, s + j, (n - j) * sizeof(float));
        fvec p = vexp(load<fvec>(buf) - m);
        std::memcpy(buf, &p, sizeof p);
        for (int t = 0; t < n - j; ++t) {
            s[j + t] = buf[t];
            l += buf[t];
        }
    }
    if (sink) {
        float e[CK_WIDTH];
        fvec p = vexp(fvec{} + (*sink - m));
        std::memcpy(e, &p, sizeof p);
        l += e[0];
    }
    if (round_p)
        for (int t = 0; t < n; ++t) s[t] = bf16_round(s[t]);
    return l;
}

// One line into L1 (locality 3) or L2 (2). On x86 an asm statement: GCC 12 dropped every __builtin_prefetch of
// decode_group's key and value requests (a loop of them in a lambda: no prefetch instruction in the built library),
// so the keys were read at DRAM latency, one group of 8 after another.
template <int LOCALITY>
static inline void request_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
    if constexpr (LOCALITY == 3)
        __asm__ volatile("prefetcht0 %0" : : "m"(*p));
    else
        __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, LOCALITY);
#endif
}

// Requests a cache row's lines (`bytes` from `row`, which need not start a line) into L1 (locality 3) or L2 (2).
template <int LOCALITY>
static inline void request_row(const void* row, int bytes) {
    const char* p = static_cast<const char*>(row);
    for (int off = 0; off < bytes; off += 64) request_line<LOCALITY>(p + off);
    request_line<LOCALITY>(p + bytes - 1);
}


// Half this machine's L2 (sysconf; 256 KiB where it does not say): the most of a head's value rows that the scores'
// pass requests into L2 for the value pass, beside its keys. L2s run from 256 KiB to 2 MiB a core.
static inline int64_t values_in_l2() {
    static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
        const long l2 = 0;                          // not reported on this platform
#endif
        return l2 > 0 ? int64_t(l2) / 2 : int64_t(256) * 1024;
    }();
    return bytes;
}

// The value rows a chunk of keys holds (see weigh_values_rn): 8 KiB, a quarter of the smallest L1d of the x86 CPUs
// served (32 KiB), whatever the row size: 64 keys of a bf16 head of 64 dims, 16 of a float32 head of 128.
constexpr int VALUE_CHUNK_BYTES = 8192;

// The tail's accumulator of dims [d, d + w) of head r between chunks: zeros before the first, `acc` [RN, Dv] between
// them, out = acc / l after the last (vectors by value, so that the accumulators stay in registers).
static inline fvec resume(const float* acc, int64_t at, int w, bool first) {
    float buf[CK_WIDTH] = {};
    if (!first) std::memcpy(buf, acc + at, w * sizeof(float));
    return load<fvec>(buf);
}
static inline void pause(fvec a, float inv_l, float* acc, float* out, int64_t at, int w, bool last) {
    float o[CK_WIDTH];
    const fvec y = last ? a * inv_l : a;
    std::memcpy(o, &y, sizeof o);
    std::memcpy((last ? out : acc) + at, o, w * sizeof(float));
}

// out[r, :] = Σ_j p[r, j] v_j / l[r] for RN (1 to 4) heads: two vectors of value dims per pass over the keys (each
// value row widened once for the heads; the 2 x RN accumulators in registers), then a last single vector where Dv
// leaves one; tails zero-padded. Each element is one accumulator taking its keys in order, whatever RN.
// The keys go in chunks of VALUE_CHUNK_BYTES of rows, and every pass over the dims takes a chunk before the next (its
// accumulators kept in `acc` [RN, Dv] between chunks: the same adds in the same order), so a chunk's rows come from
// memory once and from L1 for the other passes (a pass over all the keys each re-read the rows from L3 or memory,
// a head's values past L2). The next chunk's rows are requested into L2 a share before each pass over this one (the
// rows are scattered over the cache's slots, so the hardware prefetcher cannot follow them: a pass stalled on every
// row), outside the loops over the keys, which keep their accumulators in registers that way (a request inside them
// spilled all eight, as did the tail's helpers above where the full vectors used them).
template <int RN, typename KT>
static inline void weigh_values_rn(const float* p, int64_t p_stride, int n, const KT* v, int64_t v_stride,
                                   const int64_t* slots, int Dv, const float* inv_l, float* out, float* acc) {
    const int row_bytes = Dv * int(sizeof(KT));
    int asked = 0;                                  // the value rows of keys [0, asked) are requested (into L2)
    auto request = [&](int upto) {
        for (; asked < upto && asked < n; ++asked) request_row<2>(v + slots[asked] * v_stride, row_bytes);
    };
    const int passes = (Dv + 2 * CK_WIDTH - 1) / (2 * CK_WIDTH);
    const int chunk = std::max(8, VALUE_CHUNK_BYTES / row_bytes);  // keys a chunk (the order of adds is the same)
    const int share = (chunk + passes - 1) / passes;   // the next chunk's rows a pass over the dims requests
    request(chunk);
    for (int j0 = 0; j0 < n; j0 += chunk) {
        const int j1 = n - j0 < chunk ? n : j0 + chunk;
        const bool first = j0 == 0, last = j1 == n;
        int d = 0;
        for (; d + 2 * CK_WIDTH <= Dv; d += 2 * CK_WIDTH) {
            request(asked + share);                // the next chunk's, a share before each pass over this one
            fvec a0[RN], a1[RN];
#pragma GCC unroll 4
            for (int r = 0; r < RN; ++r) {
                a0[r] = first ? fvec{} : load<fvec>(acc + (int64_t)r * Dv + d);
                a1[r] = first ? fvec{} : load<fvec>(acc + (int64_t)r * Dv + d + CK_WIDTH);
            }
            for (int j = j0; j < j1; ++j) {
                const KT* vj = v + slots[j] * v_stride + d;
                const fvec v0 = widen(vj), v1 = widen(vj + CK_WIDTH);
#pragma GCC unroll 4
                for (int r = 0; r < RN; ++r) {
                    const float pr = p[r * p_stride + j];
                    a0[r] += pr * v0;
                    a1[r] += pr * v1;
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < RN; ++r) {
                const fvec y0 = last ? a0[r] * inv_l[r] : a0[r], y1 = last ? a1[r] * inv_l[r] : a1[r];
                float* dst = (last ? out : acc) + (int64_t)r * Dv + d;
                std::memcpy(dst, &y0, sizeof y0);
                std::memcpy(dst + CK_WIDTH, &y1, sizeof y1);
            }
        }
        for (; d < Dv; d += CK_WIDTH) {
            const int w = Dv - d < CK_WIDTH ? Dv - d : CK_WIDTH;
            fvec a[RN];
#pragma GCC unroll 4
            for (int r = 0; r < RN; ++r) a[r] = resume(acc, (int64_t)r * Dv + d, w, first);
            for (int j = j0; j < j1; ++j) {
                const KT* vj = v + slots[j] * v_stride + d;
                fvec vv = w == CK_WIDTH ? widen(vj) : widen_tail(vj, w);
#pragma GCC unroll 4
                for (int r = 0; r < RN; ++r) a[r] += p[r * p_stride + j] * vv;
            }
#pragma GCC unroll 4
            for (int r = 0; r < RN; ++r) pause(a[r], inv_l[r], acc, out, (int64_t)r * Dv + d, w, last);
        }
        request(j1 + chunk);
    }
}

template <typename KT>
static inline void weigh_values(const float* p, int64_t p_stride, int rn, int n, const KT* v, int64_t v_stride,
                                const int64_t* slots, int Dv, const float* inv_l, float* out, float* acc) {
    switch (rn) {
        case 1: weigh_values_rn<1>(p, p_stride, n, v, v_stride, slots, Dv, inv_l, out, acc); break;
        case 2: weigh_values_rn<2>(p, p_stride, n, v, v_stride, slots, Dv, inv_l, out, acc); break;
        case 3: weigh_values_rn<3>(p, p_stride, n, v, v_stride, slots, Dv, inv_l, out, acc); break;
        default: weigh_values_rn<4>(p, p_stride, n, v, v_stride, slots, Dv, inv_l, out, acc); break;
    }
}

// One sequence and one KV head: q [R, D] float32 (the heads sharing it), k / v the cache rows of this KV head
// (slot s at k + s * k_stride), slots [n], sinks [R] or null; out [R, Dv]; scratch [R * n + max(8 * D, 4 * Dv)]
// floats (the scores, then a key group widened, then the value pass's accumulators between its chunks).
template <typename KT>
static void decode_group(const float* q, int R, int D, int Dv, const KT* k, const KT* v, int64_t k_stride,
                         int64_t v_stride, const int64_t* slots, int n, const float* sinks, float scale, float* out,
                         float* scratch) {
    float* kf = scratch + (int64_t)R * n;           // [8, D]: a bf16 group widened once for all R heads
    // the key rows of the group two ahead are requested into L1 while this one is scored (scattered slots: no
    // hardware prefetcher follows them; each group stalled on its rows before), and where the head's value rows fit
    // in half the L2 (values_in_l2), theirs too, for the pass over the values after the scores
    constexpr int KEYS_AHEAD = 16;                  // 8 to 64 read alike (a scratch driver, AVX2 EPYC)
    const int k_bytes = D * int(sizeof(KT)), v_bytes = Dv * int(sizeof(KT));
    const bool values_too = int64_t(n) * v_bytes <= values_in_l2();
    auto request = [&](int j1, int j2) {            // keys [j1, j2) of the context
        for (int j = j1; j < j2 && j < n; ++j) {
            request_row<3>(k + slots[j] * k_stride, k_bytes);
            if (values_too) request_row<2>(v + slots[j] * v_stride, v_bytes);
        }
    };
    request(0, KEYS_AHEAD);
    for (int j0 = 0; j0 < n; j0 += 8) {            // keys in groups of 8 (the last one padded with key 0's row)
        request(j0 + KEYS_AHEAD, j0 + KEYS_AHEAD + 8);
        const float* rows_[8];
        for (int j = 0; j < 8; ++j) {
            const KT* row = k + slots[j0 + j < n ? j0 + j : 0] * k_stride;
            if constexpr (sizeof(KT) == 4) {
                rows_[j] = reinterpret_cast<const float*>(row);
            } else {
                float* dst = kf + (int64_t)j * D;
                int d = 0;
                for (; d + CK_WIDTH <= D; d += CK_WIDTH) {
                    fvec w = widen(row + d);
                    std::memcpy(dst + d, &w, sizeof w);
                }
                for (; d < D; ++d) {
                    uint32_t u = uint32_t(row[d]) << 16;
                    std::memcpy(dst + d, &u, 4);
                }
                rows_[j] = dst;
            }
        }
        float s8[8];
        for (int r = 0; r < R; ++r) {
            score_group(q + (int64_t)r * D, D, rows_, s8, scale);
            std::memcpy(scratch + (int64_t)r * n + j0, s8, (n - j0 < 8 ? n - j0 : 8) * sizeof(float));
        }
    }
    float inv_l[4];
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int rn = R - r0 < 4 ? R - r0 : 4;
        for (int r = 0; r < rn; ++r) {
            float l = softmax_row(scratch + (int64_t)(r0 + r) * n, n, sinks ? sinks + r0 + r : nullptr,
                                  sizeof(KT) == 2);
            inv_l[r] = 1.0f / l;
        }
        weigh_values(scratch + (int64_t)r0 * n, n, rn, n, v, v_stride, slots, Dv, inv_l, out + (int64_t)r0 * Dv,
                     kf);                           // the key group's space holds the accumulators now
    }
}

}  // namespace colibri_native

// The entry point of this ISA level: kvtype 0 = float32, 1 = bf16 (as uint16); see decode_group.
extern "C" void CK_CAT(colibri_decode_attention_, CK_NAME)(const float* q, int R, int D, int Dv, const void* k,
                                                            const void* v, int kvtype, int64_t k_stride,
                                                            int64_t v_stride, const int64_t* slots, int n,
                                                            const float* sinks, float scale, float* out,
                                                            float* scratch) {
    using namespace colibri_native;
    if (kvtype == 0)
        decode_group(q, R, D, Dv, static_cast<const float*>(k), static_cast<const float*>(v), k_stride, v_stride,
                     slots, n, sinks, scale, out, scratch);
    else
        decode_group(q, R, D, Dv, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), k_stride,
                     v_stride, slots, n, sinks, scale, out, scratch);
}
