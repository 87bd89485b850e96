// colibri::moe_blocks_ and colibri::moe_sum_: the expert side of a layer, over the small-M linear of the ISA level
// in force (ops.cpp picks it, gemm.h computes it).
//
//   moe_blocks_(acc [T, H] float64, x [T, H], ids [T, K], weights [T, K], local [E_global], w13, w2, b13?, b2?, alpha,
//        limit, up_offset) with w13 and w2 registered by expert_blocks (below): the whole expert side of a
//        layer in one call: the pairs sorted by expert, x's rows gathered, each expert's FFN (gate/up, the gated
//        activation, down, in float32, biases included; every weight byte read once per call), the routed
//        weights and the float64 sum. Expert e's weights are row blocks (a packed stack's expert, or a mapped
//        checkpoint's gate, up and down tensors where they lie)
//   expert_blocks(blocks [E * parts], parts, scales [E] or []) -> id; expert_blocks_free(id): one projection's row
//        blocks (and int8 row scales) registered once, named by the id moe_blocks_ takes
//   moe_sum_(acc [T, H] float64, ys [P, H] float32, rows [P], weights [P]): acc[rows[p]] += ys[p] * weights[p]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "pool.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using colibri_ops::BLOCK;
using colibri_ops::grain;
using colibri_ops::Quantized;
using colibri_ops::quantize_rows;

// A block of rows of one expert's matrix, in place: a packed stack's expert, or a tensor of a mapped checkpoint
// (gate and up may be two blocks). `scale` is the int8 rows' scales, null for float weights.
struct Src {
    const char* w;
    const float* scale;
    int64_t rows;
};

struct Task {
    const char* w;                             // the block's first row
    const float* scale;
    int64_t row, n, o0, o1, col;               // the expert's first pair row and count, block rows, output column
};

// One projection of every expert with work: out[pairs of a] = in[pairs of a] @ (a's blocks stacked).T (float32);
// counts[a] pairs of active expert a, its blocks srcs[a]; `in` [n, K] float32. kind 3 (W8A8): in's rows are quantised
// first. `inb`, where given, is the rows as bf16 instead (bf16 weights on the level's bf16 products: AMX tiles or
// VDPBF16PS; `in` is null then).
void project(const float* in, const uint16_t* inb, int64_t n, const std::vector<int64_t>& counts,
             const std::vector<std::vector<Src>>& srcs, int kind, int64_t K, int64_t esize, at::Tensor& out) {
    const int64_t Dout = out.size(1);
    const float* xp = in;
    float* yp = out.data_ptr<float>();
    Quantized xq = kind == 3 ? quantize_rows(xp, n, K) : Quantized{};
    std::vector<Task> todo;
    int64_t row = 0;
    for (size_t a = 0; a < counts.size(); ++a) {
        int64_t col = 0;
        for (const Src& s : srcs[a]) {
            for (int64_t o = 0; o < s.rows; o += BLOCK)
                todo.push_back({s.w, s.scale, row, counts[a], o, std::min(s.rows, o + BLOCK), col});
            col += s.rows;
        }
        row += counts[a];
    }
    linear_fn fn = colibri_ops::linear_kernel();
    linear_i8_fn fn8 = colibri_ops::linear_i8_kernel();
    linear_bf16_fn fnb = colibri_ops::linear_bf16_kernel();
    int64_t mean_rows = 1 + n / std::max<int64_t>(1, int64_t(counts.size()));
    colibri_ops::parallel_for(0, int64_t(todo.size()), grain(mean_rows, K), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0, u; t < t1; t = u) {
            // this thread's consecutive blocks of one source for the same rows are one call (each output is still
            // one tile; the rows are packed once for AMX's tiles, and the call prefetches its own next block)
            Task j = todo[t];
            for (u = t + 1; u < t1 && todo[u].w == j.w && todo[u].row == j.row && todo[u].o0 == j.o1; ++u)
                j.o1 = todo[u].o1;
            const char* next = nullptr;                   // the next call's weight rows, requested during this one
            int64_t next_bytes = 0;
            if (u < t1) {
                const Task& n = todo[u];
                next = n.w + n.o0 * K * esize;
                next_bytes = (n.o1 - n.o0) * K * esize;
            }
            if (inb)
                fnb(inb + j.row * K, int(j.n), int(K), reinterpret_cast<const uint16_t*>(j.w), int(j.o0), int(j.o1),
                    yp + j.row * Dout + j.col, int(Dout), next, next_bytes);
            else if (kind == 3)
                fn8(xq.q.data() + j.row * xq.Kp, xq.scale.data() + j.row, int(j.n), int(xq.Kp), int(K),
                    reinterpret_cast<const int8_t*>(j.w), j.scale, int(j.o0), int(j.o1), yp + j.row * Dout + j.col,
                    int(Dout), next, next_bytes);
            else
                fn(xp + j.row * K, int(j.n), int(K), j.w, kind == 4 ? 3 : kind, j.scale, int(j.o0), int(j.o1),
                   yp + j.row * Dout + j.col, int(Dout), next, next_bytes);
        }
    });
}

// Whether every thread should run whole experts (ffn below): few rows per expert, so an expert costs
// its weights' bytes whatever its rows, and at least two experts per thread, so the shares are even.
bool by_expert(const std::vector<int64_t>& counts) {
    if (int64_t(counts.size()) < 2 * int64_t(at::get_num_threads())) return false;
    for (int64_t c : counts)
        if (c > 4) return false;                   // past one 4-row tile an expert's time grows with its rows
    return true;
}

// The expert FFN of the active experts (counts[a] sorted pairs each; `bias_row[a]` its row of b13/b2): gate/up,
// the gated activation, down, in float32, biases included, not yet weighted -> [P, H]. Two ways, to the same bits
// (each output is one kernel tile whichever thread or task computes it): each projection's row blocks of every
// expert shared by the threads (three parallel regions: gate/up, activation, down), or, with few rows per expert
// (by_expert), each thread running whole experts of its share in one region, no thread waiting on the others
// between an expert's projections and each expert's weights requested while the one before it computes.
at::Tensor ffn(const at::Tensor& xs, const std::vector<int64_t>& counts, const std::vector<int64_t>& bias_row,
               const std::vector<std::vector<Src>>& s13, const std::vector<std::vector<Src>>& s2, int kind,
               int64_t esize, int64_t I, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
               double alpha, c10::optional<double> limit, double up_offset, const at::Tensor& xb) {
    // the pairs' rows: float32 `xs`, or (bf16 weights on a level with bf16 products) bf16 `xb` instead, which
    // gate/up multiply with them (AMX tiles, VDPBF16PS); down's input, the float32 activation, keeps the float path
    const at::Tensor& rows_in = xb.defined() ? xb : xs;
    const int64_t P = rows_in.size(0), H = rows_in.size(1), I2 = 2 * I;
    const float* xp = xb.defined() ? nullptr : xs.data_ptr<float>();
    linear_bf16_fn fnb = colibri_ops::linear_bf16_kernel();
    const uint16_t* xbp = xb.defined() ? reinterpret_cast<const uint16_t*>(xb.data_ptr()) : nullptr;
    const auto f32 = rows_in.options().dtype(at::kFloat);
    at::Tensor gu = at::empty({P, I2}, f32);                                // [P, 2I]
    at::Tensor h = at::empty({P, I}, f32);                                  // [P, I]
    at::Tensor ys = at::empty({P, H}, f32);                                 // [P, H]
    at::Tensor bias13 = b13.has_value() ? b13->to(at::kFloat).contiguous() : at::Tensor();
    const float* g = gu.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    std::vector<int64_t> expert_of(P);                                      // each pair's bias row
    for (size_t a = 0, row = 0; a < counts.size(); row += counts[a], ++a)
        for (int64_t r = row; r < int64_t(row) + counts[a]; ++r) expert_of[r] = bias_row[a];
    const float al = float(alpha), off = float(up_offset);
    const bool clamp = limit.has_value();
    const float lim = clamp ? float(*limit) : 0.f;
    auto activate = [&](int64_t p0, int64_t p1) {                          // h[p] = act(gate, up) for p0 <= p < p1
        for (int64_t p = p0; p < p1; ++p) {
            const float* b = bias13.defined() ? bias13.data_ptr<float>() + expert_of[p] * I2 : nullptr;
            for (int64_t i = 0; i < I; ++i) {
                float gate = g[p * I2 + i] + (b ? b[i] : 0.f), up = g[p * I2 + I + i] + (b ? b[I + i] : 0.f);
                if (clamp) {
                    gate = std::min(gate, lim);
                    up = std::max(-lim, std::min(up, lim));
                }
                hp[p * I + i] = gate / (1.f + std::exp(-al * gate)) * (up + off);
            }
        }
    };
    if (by_expert(counts)) {
        const int64_t A = int64_t(counts.size());
        std::vector<int64_t> first(A + 1, 0);                               // each expert's first pair row
        for (int64_t a = 0; a < A; ++a) first[a + 1] = first[a] + counts[a];
        float* gp = gu.data_ptr<float>();
        float* yp = ys.data_ptr<float>();
        linear_fn fn = colibri_ops::linear_kernel();
        linear_i8_fn fn8 = colibri_ops::linear_i8_kernel();
        // W8A8: x's rows quantised here, each expert's activation rows by its thread (row by row, so the same
        // bits as the shared-blocks way's quantize_rows)
        Quantized xq = kind == 3 ? quantize_rows(xp, P, H) : Quantized{};
        Quantized hq = kind == 3 ? colibri_ops::quantized(P, I) : Quantized{};
        // y[n rows] = in[n rows] @ src.T, the bytes [next, next + next_bytes) requested during its last block
        auto project_rows = [&](const float* in, const uint16_t* inb, const Quantized& q, int64_t row, int64_t n,
                                int64_t K, const Src& src, float* y, int64_t ldy, const char* next,
                                int64_t next_bytes) {
            if (inb)
                fnb(inb + row * K, int(n), int(K), reinterpret_cast<const uint16_t*>(src.w), 0, int(src.rows), y,
                    int(ldy), next, next_bytes);
            else if (kind == 3)
                fn8(q.q.data() + row * q.Kp, q.scale.data() + row, int(n), int(q.Kp), int(K),
                    reinterpret_cast<const int8_t*>(src.w), src.scale, 0, int(src.rows), y, int(ldy), next, next_bytes);
            else
                fn(in + row * K, int(n), int(K), src.w, kind == 4 ? 3 : kind, src.scale, 0, int(src.rows), y,
                   int(ldy), next, next_bytes);
        };
        colibri_ops::parallel_for(0, A, 1, [&](int64_t a0, int64_t a1) {
            for (int64_t a = a0; a < a1; ++a) {
                const int64_t row = first[a], n = counts[a];
                const Src& down = s2[a][0];
                int64_t col = 0;
                for (size_t j = 0; j < s13[a].size(); ++j) {                 // gate/up: one call per row block
                    const Src& s = s13[a][j];
                    const bool last = j + 1 == s13[a].size();
                    const Src& next = last ? down : s13[a][j + 1];
                    project_rows(xp, xbp, xq, row, n, H, s, gp + row * I2 + col, I2, next.w,
                                 next.rows * (last ? I : H) * esize);
                    col += s.rows;
                }
                activate(row, row + n);
                if (kind == 3)
                    for (int64_t r = row; r < row + n; ++r)
                        colibri_ops::quantize_row(hp + r * I, I, hq.q.data() + r * hq.Kp, hq.scale.data() + r);
                const Src* after = a + 1 < a1 ? &s13[a + 1][0] : nullptr;   // the next expert's first block
                project_rows(hp, nullptr, hq, row, n, I, down, yp + row * H, H, after ? after->w : nullptr,
                             after ? after->rows * H * esize : 0);
            }
        });
    } else {
        project(xp, xbp, P, counts, s13, kind, H, esize, gu);
        colibri_ops::parallel_for(0, P, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, I)), activate);
        project(hp, nullptr, P, counts, s2, kind, I, esize, ys);
    }
    if (b2.has_value()) {
        at::Tensor bias2 = b2->to(at::kFloat);
        at::Tensor ids = at::from_blob(expert_of.data(), {P}, at::kLong);
        ys.add_(bias2.index_select(0, ids));
    }
    return ys;
}

// ap[rows[p], :] += double(yp[p, :] * weights[p]) for p < P (rows of H): the columns split over the threads, so no
// two write one element; the float64 sum of a token's few pairs is exact, so the order does not matter.
void add_weighted(double* ap, const float* yp, int64_t P, int64_t H, const int64_t* rows, const float* weights) {
    const int64_t cols_per_chunk = std::max<int64_t>(64, (int64_t(1) << 16) / std::max<int64_t>(1, P));
    colibri_ops::parallel_for(0, H, cols_per_chunk, [&](int64_t h0, int64_t h1) {
        for (int64_t p = 0; p < P; ++p) {
            const float* src = yp + p * H;
            double* dst = ap + rows[p] * H;
            const float wt = weights[p];
            for (int64_t h = h0; h < h1; ++h) dst[h] += double(src[h] * wt);
        }
    });
}

// acc[rows[p], :] += double(ys[p, :] * weights[p]) for every pair p: the routed weight multiplied in float32 (as
// torch's `ys *= w`), the sum in float64 (exact for a token's few pairs, so any order gives the same bits). The
// columns are split over the threads: no two write one element.
void moe_sum_(at::Tensor& acc, const at::Tensor& ys, const at::Tensor& rows, const at::Tensor& weights) {
    TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kDouble && acc.is_contiguous(), "colibri::moe_sum_: acc "
                "must be a contiguous float64 [T, H]");
    TORCH_CHECK(ys.dim() == 2 && ys.scalar_type() == at::kFloat && ys.size(1) == acc.size(1), "colibri::moe_sum_: "
                "ys must be float32 [P, H] with acc's H");
    const int64_t P = ys.size(0), T = acc.size(0), H = acc.size(1);
    TORCH_CHECK(rows.dim() == 1 && rows.size(0) == P && weights.dim() == 1 && weights.size(0) == P,
                "colibri::moe_sum_: rows and weights must be [P]");
    at::Tensor y = ys.contiguous(), r = rows.to(at::kLong).contiguous(), w = weights.to(at::kFloat).contiguous();
    const int64_t* rp = r.data_ptr<int64_t>();
    for (int64_t p = 0; p < P; ++p)
        TORCH_CHECK(rp[p] >= 0 && rp[p] < T, "colibri::moe_sum_: row ", rp[p], " of pair ", p, " is outside [0, ", T,
                    ")");
    add_weighted(acc.data_ptr<double>(), y.data_ptr<float>(), P, H, rp, w.data_ptr<float>());
}

// The whole expert side of a layer in one call: acc [T, H] float64 += Σ_k weights[t, k] · FFN_{e}(x[t]) over the
// pairs whose expert e = local[ids[t, k]] is held here (>= 0; `local` empty = ids are local rows already).
// Expert e's gate/up is w13[e * parts13 .. + parts13) stacked (row blocks), its down w2[e]; int8 weights come with
// their row scales s13[e], s2[e]. The pairs are sorted by expert (and by position within one, as a stable sort),
// x's rows gathered (rounded to the weights' dtype first where they are float and x is not: as the packed path
// does), the FFN run (`ffn`), and each pair's output times its weight (float32) summed into acc in float64.
void moe_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
          const at::Tensor& local, at::TensorList w13, int64_t parts13, at::TensorList w2, at::TensorList s13,
          at::TensorList s2, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha,
          c10::optional<double> limit, double up_offset, bool w8a8) {
    const char* op = "colibri::moe_blocks_";
    TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0), op,
                ": need x [T, H], ids and weights [T, K]");
    TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kDouble && acc.is_contiguous() && acc.sizes() == x.sizes(),
                op, ": acc must be a contiguous float64 [T, H]");
    const int64_t T = x.size(0), H = x.size(1), K = ids.size(1), E = int64_t(w2.size());
    TORCH_CHECK(parts13 >= 1 && int64_t(w13.size()) == E * parts13, op, ": w13 must hold parts13 blocks per expert");
    TORCH_CHECK(E > 0, op, ": no experts");
    const at::ScalarType dt = w2[0].scalar_type();
    const int kind = dt == at::kFloat ? 0 : dt == at::kBFloat16 ? 1 : 2;
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kChar, op, ": weights must be float32, bfloat16 "
                "or int8, got ", dt);
    TORCH_CHECK(kind != 2 || (int64_t(s13.size()) == E && int64_t(s2.size()) == E && parts13 == 1), op,
                ": int8 experts need one scale vector per expert for w13 and for w2 (and one gate/up block)");
    const int64_t I = w2[0].dim() == 2 ? w2[0].size(1) : -1;
    const int64_t esize = w2[0].element_size();
    at::Tensor id = ids.to(at::kLong).contiguous();
    at::Tensor lmap = local.defined() && local.numel() ? local.to(at::kLong).contiguous() : at::Tensor();
    const int64_t* ip = id.data_ptr<int64_t>();
    const int64_t* lp = lmap.defined() ? lmap.data_ptr<int64_t>() : nullptr;
    const int64_t G = lmap.defined() ? lmap.numel() : E;
    // counting sort of the pairs by local expert: stable, so within an expert pairs keep their flat order
    std::vector<int64_t> le(T * K), counts_all(E, 0);
    for (int64_t f = 0; f < T * K; ++f) {
        int64_t g = ip[f];
        int64_t e = g < 0 || g >= G ? -1 : lp ? lp[g] : g;
        TORCH_CHECK(e < E, op, ": expert map sends id ", g, " to row ", e, " of ", E);
        le[f] = e;
        if (e >= 0) ++counts_all[e];
    }
    std::vector<int64_t> start(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + counts_all[e];
    const int64_t P = start[E];
    if (P == 0) return;
    std::vector<int64_t> order(P), fill(start.begin(), start.end() - 1);
    for (int64_t f = 0; f < T * K; ++f)
        if (le[f] >= 0) order[fill[le[f]]++] = f;
    // x's rows for the pairs (rounded to the weights' float dtype first, as the packed path's cast), gathered once,
    // in the dtype they are multiplied in: bf16 where gate/up take the level's bf16 products (bf16 weights on AMX
    // tiles or VDPBF16PS), else float32. Weight-only int8 experts take the linear's own form at every row count, not
    // the widened tiles (native_int8_tiles: slower at 1 and 8 tokens, and bits of their own), since a pair's result
    // must not depend on how many pairs share its expert; on the amx level that form is itself on AMX's int8 tiles
    // from two rows, with the bits of one row on vectors (amx_x16.h)
    at::Tensor xw = (kind != 2 && x.scalar_type() != dt) ? x.to(dt) : x;
    const bool bf16_products = kind == 1 && colibri_ops::linear_bf16_kernel() != nullptr;
    at::Tensor src = bf16_products ? xw.contiguous() : xw.to(at::kFloat).contiguous();   // [T, H]
    at::Tensor xs = at::empty({P, H}, src.options());                                // [P, H]
    const char* sp = static_cast<const char*>(src.data_ptr());
    char* xsp = static_cast<char*>(xs.data_ptr());
    const int64_t row_bytes = H * src.element_size();
    const int64_t pairs_per_chunk = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, H));
    colibri_ops::parallel_for(0, P, pairs_per_chunk, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) std::memcpy(xsp + p * row_bytes, sp + (order[p] / K) * row_bytes, row_bytes);
    });
    std::vector<int64_t> counts, rows;
    std::vector<std::vector<Src>> src13, src2;
    auto block = [&](const at::Tensor& t, int64_t cols, const float* scale) {
        TORCH_CHECK(t.dim() == 2 && t.size(1) == cols && t.is_contiguous() && t.scalar_type() == dt && t.is_cpu(), op,
                    ": every weight block must be a contiguous CPU ", dt, " [rows, ", cols, "], got ", t.sizes(), " ",
                    t.scalar_type());
        return Src{static_cast<const char*>(t.data_ptr()), scale, t.size(0)};
    };
    auto scales = [&](const at::Tensor& s, int64_t n) -> const float* {
        TORCH_CHECK(s.dim() == 1 && s.size(0) == n && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
                    ": int8 scales must be contiguous float32 [", n, "]");
        return s.data_ptr<float>();
    };
    for (int64_t e = 0; e < E; ++e) {
        if (!counts_all[e]) continue;
        counts.push_back(counts_all[e]);
        rows.push_back(e);
        std::vector<Src> parts;
        int64_t total = 0;
        for (int64_t j = 0; j < parts13; ++j) {
            parts.push_back(block(w13[e * parts13 + j], H, kind == 2 ? scales(s13[e], w13[e].size(0)) : nullptr));
            total += parts.back().rows;
        }
        TORCH_CHECK(total == 2 * I, op, ": expert ", e, "'s gate/up has ", total, " rows, not 2I = ", 2 * I);
        src13.push_back(parts);
        src2.push_back({block(w2[e], I, kind == 2 ? scales(s2[e], H) : nullptr)});
        TORCH_CHECK(src2.back()[0].rows == H, op, ": expert ", e, "'s down must be [H=", H, ", I]");
    }
    TORCH_CHECK(!w8a8 || kind == 2, op, ": W8A8 takes int8 weights");
    // kind 3: W8A8; 4: weight-only int8 against bf16 x (the linear's wdtype 3: the int16 form where the level has it)
    const int ffn_kind = w8a8 ? 3 : kind == 2 && x.scalar_type() == at::kBFloat16 ? 4 : kind;
    at::Tensor ys = ffn(bf16_products ? at::Tensor() : xs, counts, rows, src13, src2, ffn_kind, esize, I, b13, b2,
                        alpha, limit, up_offset, bf16_products ? xs : at::Tensor());                      // [P, H]
    at::Tensor wf = weights.to(at::kFloat).contiguous();
    const float* wp = wf.data_ptr<float>();
    std::vector<int64_t> token(P);                                              // each pair's row of acc
    std::vector<float> pair_weight(P);
    for (int64_t p = 0; p < P; ++p) {
        token[p] = order[p] / K;
        pair_weight[p] = wp[order[p]];
    }
    add_weighted(acc.data_ptr<double>(), ys.data_ptr<float>(), P, H, token.data(), pair_weight.data());
}

// One projection of a layer's experts (every expert's gate/up blocks, or every expert's down), handed to the kernel
// once and named by a number: a call then passes two integers where it passed lists of 128-192 tensors, each list
// unboxed and every tensor checked and reference-counted at every call (8% of a one-stream decode step in-process:
// py-spy, the bench model, an AMD EPYC; a torch custom class instead costs a C++ exception a call, thrown by torch's
// __torch_function__ probe of the object). The registry holds the tensors, so their memory lives until the number is
// freed (kernels/native.py frees it with the Python object that owns it).
struct ExpertBlocks {
    std::vector<at::Tensor> blocks, scales;    // parts row blocks per expert, in order; int8 row scales per expert
    int64_t parts;
};

std::mutex registry_lock;
std::unordered_map<int64_t, std::shared_ptr<const ExpertBlocks>> registry;
int64_t registry_next = 1;

int64_t expert_blocks(at::TensorList blocks, int64_t parts, at::TensorList scales) {
    TORCH_CHECK(parts >= 1 && !blocks.empty() && int64_t(blocks.size()) % parts == 0, "colibri::expert_blocks: need ",
                "parts >= 1 row blocks per expert, got ", blocks.size(), " blocks in parts of ", parts);
    TORCH_CHECK(scales.empty() || int64_t(scales.size()) * parts == int64_t(blocks.size()),
                "colibri::expert_blocks: one scale vector per expert, or none");
    auto made = std::make_shared<const ExpertBlocks>(
        ExpertBlocks{std::vector<at::Tensor>(blocks.begin(), blocks.end()),
                     std::vector<at::Tensor>(scales.begin(), scales.end()), parts});
    std::lock_guard<std::mutex> hold(registry_lock);
    registry[registry_next] = std::move(made);
    return registry_next++;
}

void expert_blocks_free(int64_t id) {
    std::shared_ptr<const ExpertBlocks> gone;   // its tensors released after the lock (a deleter may take the GIL)
    std::lock_guard<std::mutex> hold(registry_lock);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    gone = std::move(it->second);
    registry.erase(it);
}

std::shared_ptr<const ExpertBlocks> blocks_of(int64_t id) {
    std::lock_guard<std::mutex> hold(registry_lock);
    auto it = registry.find(id);
    TORCH_CHECK(it != registry.end(), "colibri::moe_blocks_: no expert blocks numbered ", id, " (freed, or never "
                "made by colibri::expert_blocks)");
    return it->second;
}

}  // namespace

namespace colibri_ops {

// moe_ over registered blocks: w13's are gate/up (its parts per expert), w2's the downs (one block each).
void moe_blocks_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                 const at::Tensor& local, int64_t w13_id, int64_t w2_id, const c10::optional<at::Tensor>& b13,
                 const c10::optional<at::Tensor>& b2, double alpha, c10::optional<double> limit, double up_offset,
                 bool w8a8) {
    const auto w13 = blocks_of(w13_id), w2 = blocks_of(w2_id);
    TORCH_CHECK(w2->parts == 1, "colibri::moe_blocks_: each expert's down is one block");
    moe_(acc, x, ids, weights, local, w13->blocks, w13->parts, w2->blocks, w13->scales, w2->scales, b13, b2, alpha,
         limit, up_offset, w8a8);
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("expert_blocks(Tensor[] blocks, int parts, Tensor[] scales) -> int", &expert_blocks);
    m.def("expert_blocks_free(int id) -> ()", &expert_blocks_free);
    m.def("moe_blocks_(Tensor(a!) acc, Tensor x, Tensor ids, Tensor weights, Tensor local, "
          "int w13, int w2, Tensor? b13, Tensor? b2, float alpha, float? limit, float up_offset, "
          "bool w8a8=False) -> ()");
    m.def("moe_sum_(Tensor(a!) acc, Tensor ys, Tensor rows, Tensor weights) -> ()");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
    m.impl("moe_sum_", &moe_sum_);
    m.impl("moe_blocks_", &colibri_ops::moe_blocks_);
}
