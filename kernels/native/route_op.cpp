// colibri::topk_route: a layer's routing (scores, the choice of k experts, their weights) in one call, where
// kernels/routing.py's torch form takes six to a dozen torch ops: on a 2-core AVX2 EPYC 71 / 83 / 100 µs a call
// at 1 / 8 / 32 rows of 64 experts, ~1 ms of a 20 ms one-stream decode step over 8 layers.
//
//   topk_route(logits [T, E], bias [E]?, k, scoring, renormalize, num_groups, topk_groups, group_score, scaling)
//     -> (weights float32 [T, k], ids int64 [T, k]), the chosen experts best first
//
// scoring 0 softmax, 1 sigmoid (then `bias` may steer the choice, never the weights), 2 top-k then softmax over
// the k (GPT-OSS); group_score 0 max, 1 sum of the top two (DeepSeek-V3). Each row as topk_route_torch computes
// it, in float32: the choice is torch.topk's own (the same std::nth_element / std::sort with its comparator, NaN
// first, so ties fall as torch's fall); exp is libm's, so a score may differ from torch's vectorised exp in its
// last bit. Rows are independent (batch-invariant), split across the pool only where there are many.
//
//   moe_route(h [T, H], ln [H], gate [E, H], eps, bias?, k, ...) -> (r [T, H], weights, ids)
//
// The MoE block's front in one call: r = rms_norm(h, ln), the gate's logits r @ gate.T (colibri::linear, in r's
// dtype), then topk_route on them; the bits of those three ops called one by one.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"
#include "pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Elem = std::pair<float, int64_t>;

// torch.topk(values, k, largest=True, sorted=True) of one row, as aten/src/ATen/native/TopKImpl.h computes it:
// partial_sort where k * 64 <= n, else nth_element and a sort of the first k - 1; NaN ranks above every number.
void topk(const float* v, int64_t n, int64_t k, std::vector<Elem>& queue, int64_t* ids) {
    queue.resize(n);
    for (int64_t j = 0; j < n; ++j) queue[j] = {v[j], j};
    const auto before = [](const Elem& x, const Elem& y) {
        return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
    };
    if (k * 64 <= n) {
        std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), before);
    } else {
        std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), before);
        std::sort(queue.begin(), queue.begin() + k - 1, before);
    }
    for (int64_t j = 0; j < k; ++j) ids[j] = queue[j].second;
}

void softmax(const float* x, int64_t n, float* p) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::isnan(x[j]) || x[j] > m ? x[j] : m;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) sum += p[j] = std::exp(x[j] - m);
    for (int64_t j = 0; j < n; ++j) p[j] /= sum;
}

struct Spec {
    int64_t E, k, scoring, groups, topk_groups, group_score;
    bool renormalize;
    float scaling;
};

struct Scratch {                                              // a chunk's buffers, reused row after row
    std::vector<float> buf;
    std::vector<Elem> queue;
    std::vector<int64_t> best;
    std::vector<char> kept;
};

void route_row(const float* x, const float* bias, const Spec& s, float* w, int64_t* ids, Scratch& sc) {
    const int64_t E = s.E, k = s.k;
    std::vector<float>& buf = sc.buf;
    std::vector<Elem>& queue = sc.queue;
    if (s.scoring == 2) {                                     // top-k of the logits, softmax over those k
        topk(x, E, k, queue, ids);
        buf.resize(2 * k);
        for (int64_t j = 0; j < k; ++j) buf[j] = x[ids[j]];
        softmax(buf.data(), k, buf.data() + k);
        for (int64_t j = 0; j < k; ++j) w[j] = buf[k + j] * s.scaling;
        return;
    }
    buf.resize(2 * E + s.groups);
    float* p = buf.data();                                    // [E] the scores
    float* choice = p + E;                                    // [E] what the choice ranks
    float* group = choice + E;                                // [G]
    if (s.scoring == 0) softmax(x, E, p);
    else
        for (int64_t e = 0; e < E; ++e) p[e] = 1.f / (1.f + std::exp(-x[e]));
    for (int64_t e = 0; e < E; ++e) choice[e] = bias ? p[e] + bias[e] : p[e];
    if (s.groups > 1) {
        const int64_t size = E / s.groups;
        std::vector<int64_t>& best = sc.best;
        best.resize(std::max<int64_t>(2, s.topk_groups));
        for (int64_t g = 0; g < s.groups; ++g) {
            const float* c = choice + g * size;
            if (s.group_score == 0) {                         // torch's max: NaN wins
                float m = c[0];
                for (int64_t j = 1; j < size; ++j) m = std::isnan(m) || m >= c[j] ? m : c[j];
                group[g] = m;
            } else {                                          // topk(2).values.sum()
                topk(c, size, 2, queue, best.data());
                group[g] = c[best[0]] + c[best[1]];
            }
        }
        topk(group, s.groups, s.topk_groups, queue, best.data());
        std::vector<char>& kept = sc.kept;
        kept.assign(s.groups, 0);
        for (int64_t j = 0; j < s.topk_groups; ++j) kept[best[j]] = 1;
        for (int64_t e = 0; e < E; ++e)
            if (!kept[e / size]) choice[e] = -std::numeric_limits<float>::infinity();
    }
    topk(choice, E, k, queue, ids);
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += w[j] = p[ids[j]];
    for (int64_t j = 0; j < k; ++j) w[j] = (s.renormalize ? w[j] / (sum + 1e-20f) : w[j]) * s.scaling;
}

}  // namespace

namespace colibri_ops {

std::tuple<at::Tensor, at::Tensor> topk_route(const at::Tensor& logits, const c10::optional<at::Tensor>& bias,
                                              int64_t k, int64_t scoring, bool renormalize, int64_t num_groups,
                                              int64_t topk_groups, int64_t group_score, double scaling) {
    const char* op = "colibri::topk_route";
    TORCH_CHECK(logits.dim() == 2 && logits.is_floating_point(), op, ": need float logits [T, E], got ",
                logits.scalar_type(), " ", logits.sizes());
    const int64_t T = logits.size(0), E = logits.size(1);
    TORCH_CHECK(k >= 1 && k <= E, op, ": k=", k, " must be in 1..", E);
    TORCH_CHECK(scoring >= 0 && scoring <= 2 && group_score >= 0 && group_score <= 1, op,
                ": scoring is 0 (softmax), 1 (sigmoid) or 2 (top-k then softmax); group_score 0 (max) or 1 (top 2)");
    TORCH_CHECK(num_groups >= 1 && E % num_groups == 0 && topk_groups >= 1 && topk_groups <= num_groups, op,
                ": need num_groups dividing E=", E, " and 1 <= topk_groups <= num_groups, got ", num_groups, " and ",
                topk_groups);
    TORCH_CHECK(num_groups == 1 || (scoring != 2 && k <= topk_groups * (E / num_groups) &&
                                    (group_score == 0 || E / num_groups >= 2)), op,
                ": group-limited choice needs softmax or sigmoid scores, k <= the kept groups' experts and, to sum "
                "the top two, groups of 2 or more");
    TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == E && bias->is_floating_point() &&
                                      scoring != 2), op, ": bias must be float [E=", E, "] with softmax or sigmoid "
                "scores");
    const at::Tensor x = logits.to(at::kFloat).contiguous();
    const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor w = at::empty({T, k}, x.options());
    at::Tensor ids = at::empty({T, k}, x.options().dtype(at::kLong));
    const Spec s{E, k, scoring, num_groups, topk_groups, group_score, renormalize, float(scaling)};
    const float* xp = x.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* wp = w.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    colibri_ops::parallel_for(0, T, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, E)),
                              [&](int64_t t0, int64_t t1) {
        Scratch sc;
        for (int64_t t = t0; t < t1; ++t) route_row(xp + t * E, bp, s, wp + t * k, ip + t * k, sc);
    });
    return {w, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& h, const at::Tensor& ln,
                                                       const at::Tensor& gate, double eps,
                                                       const c10::optional<at::Tensor>& bias, int64_t k, int64_t scoring,
                                                       bool renormalize, int64_t num_groups, int64_t topk_groups,
                                                       int64_t group_score, double scaling) {
    TORCH_CHECK(h.dim() == 2 && gate.dim() == 2 && gate.size(1) == h.size(1) && gate.scalar_type() == h.scalar_type(),
                "colibri::moe_route: need h [T, H] and a gate [E, H] of h's dtype, got ", h.scalar_type(), " ",
                h.sizes(), " and ", gate.scalar_type(), " ", gate.sizes());
    at::Tensor r = rms_norm(h, ln, eps);                                              // [T, H]
    at::Tensor logits = linear(r, gate, c10::nullopt, false);                         // [T, E]
    auto [w, ids] = topk_route(logits, bias, k, scoring, renormalize, num_groups, topk_groups, group_score, scaling);
    return {r, w, ids};
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("moe_route(Tensor h, Tensor ln, Tensor gate, float eps, Tensor? bias, int k, int scoring, bool renormalize, "
          "int num_groups, int topk_groups, int group_score, float scaling) -> (Tensor, Tensor, Tensor)");
    m.def("topk_route(Tensor logits, Tensor? bias, int k, int scoring, bool renormalize, int num_groups, "
          "int topk_groups, int group_score, float scaling) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
    m.impl("topk_route", &colibri_ops::topk_route);
    m.impl("moe_route", &colibri_ops::moe_route);
}
