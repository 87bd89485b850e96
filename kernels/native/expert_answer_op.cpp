// colibri::expert_answer: an expert worker's answer to one ForwardRequest, bytes in, bytes out, in one call (the
// same-host socket's plain calls: expert_service/fast_answer.py). The request's three tensors are read where they
// lie in its bytes, checked as the Python path checks them, summed by moe_blocks_ (moe_op.cpp) into float64, checked
// finite, and written as the ForwardResponse's bytes:
//
//   expert_answer(payload uint8 [B], x_dtype (0 float32, 1 bfloat16), H, E, explicit, local [E], w13, w2, b13?, b2?,
//                 alpha, limit?, up_offset, w8a8, instance) -> (reply uint8 [R], rows n, seconds)
//
//   reply = ForwardResponse{output: Tensor{"float64", [n, H], the sum's bytes}, compute_ms, instance}
//
// An empty reply means "not this way": whatever the Python path answers differently or refuses (hidden states in
// another dtype than the experts', ids or weights in other dtypes, a shape that disagrees, an id outside [-1, E), an
// explicit pair of an expert not held here, a sum that is not finite, a tensor field given twice) goes there, and
// it says what is wrong. The scalar fields (layer, epoch, holds, checkpoint, exact_sum, prefetch) are the Python
// side's: it parsed the message with protobuf first. What this saves is the Python of a call (three tensor decodes,
// the checks, the sum's zeros and finite check, the reply's tensor and message): ~0.3 ms a layer on the 2-core VMs,
// on caches the kernel has just flushed.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"
#include "wire.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace {

using colibri_wire::Cursor;
using colibri_wire::Field;
using colibri_wire::parse_tensor;
using colibri_wire::put_varint;
using colibri_wire::matrix;
using colibri_wire::varint_size;

// The request's hidden (2), topk_ids (3) and topk_weights (4); every other field skipped (the caller has them).
bool parse_request(const uint8_t* s, uint64_t n, Field& hidden, Field& ids, Field& weights) {
    Cursor c{s, s + n};
    while (c.p < c.end) {
        uint64_t key, field;
        int wire_type;
        if (!c.varint(key) || !colibri_wire::field_of(key, field, wire_type)) return false;
        if (field >= 2 && field <= 4) {
            Field& t = field == 2 ? hidden : field == 3 ? ids : weights;
            const uint8_t* b;
            uint64_t m;
            if (wire_type != 2 || t.seen || !c.bytes(b, m) || !parse_tensor(b, m, t)) return false;   // twice: merged
            t.seen = true;
        } else if (!c.skip(wire_type)) {
            return false;
        }
    }
    return hidden.seen && ids.seen && weights.seen;
}

}  // namespace

namespace colibri_ops {

std::tuple<at::Tensor, int64_t, double> expert_answer(
    const at::Tensor& payload, int64_t x_dtype, int64_t H, int64_t E, bool explicit_pairs, const at::Tensor& local,
    int64_t w13, int64_t w2, const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, double alpha,
    c10::optional<double> limit, double up_offset, bool w8a8, c10::string_view instance) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto none = std::make_tuple(at::empty({0}, at::kByte), int64_t(0), 0.0);
    TORCH_CHECK(payload.scalar_type() == at::kByte && payload.dim() == 1 && payload.is_contiguous(),
                "colibri::expert_answer: the payload is a contiguous uint8 [B] tensor");
    TORCH_CHECK(x_dtype == 0 || x_dtype == 1, "colibri::expert_answer: x_dtype is 0 (float32) or 1 (bfloat16)");
    TORCH_CHECK(local.scalar_type() == at::kLong && local.dim() == 1 && local.numel() == E && local.is_contiguous(),
                "colibri::expert_answer: local is the int64 [E] map from global ids to held rows");
    Field hidden, ids, weights;
    if (!parse_request(payload.data_ptr<uint8_t>(), uint64_t(payload.numel()), hidden, ids, weights)) return none;
    const at::ScalarType xt = x_dtype ? at::kBFloat16 : at::kFloat;
    uint64_t n, h, n2, K, n3, K3;
    if (!matrix(hidden, x_dtype ? "bfloat16" : "float32", x_dtype ? 2 : 4, n, h) || int64_t(h) != H ||
        !matrix(ids, "int32", 4, n2, K) || !matrix(weights, "float32", 4, n3, K3) || n2 != n || n3 != n || K3 != K)
        return none;
    // aligned copies (a tensor's bytes lie anywhere in the message); the ids checked as the Python path checks them
    at::Tensor x = at::empty({int64_t(n), H}, at::TensorOptions().dtype(xt));                       // [n, H]
    at::Tensor id = at::empty({int64_t(n), int64_t(K)}, at::TensorOptions().dtype(at::kInt));      // [n, K]
    at::Tensor w = at::empty({int64_t(n), int64_t(K)}, at::TensorOptions().dtype(at::kFloat));     // [n, K]
    std::memcpy(x.data_ptr(), hidden.data, hidden.size);
    std::memcpy(id.data_ptr(), ids.data, ids.size);
    std::memcpy(w.data_ptr(), weights.data, weights.size);
    const int32_t* ip = id.data_ptr<int32_t>();
    const int64_t* lp = local.data_ptr<int64_t>();
    for (uint64_t f = 0; f < n * K; ++f) {
        const int32_t g = ip[f];
        if (g < -1 || g >= E) return none;                           // out of range: the Python path says so
        if (explicit_pairs && g >= 0 && lp[g] < 0) return none;      // a pair of an expert not held here: refused
    }
    at::Tensor acc = at::zeros({int64_t(n), H}, at::TensorOptions().dtype(at::kDouble));           // [n, H]
    moe_blocks_(acc, x, id, w, local, w13, w2, b13, b2, alpha, limit, up_offset, w8a8);
    const double* sum = acc.data_ptr<double>();
    for (int64_t i = 0; i < acc.numel(); ++i)
        if (!std::isfinite(sum[i])) return none;                   // the Python path finds which experts, or inputs
    // ForwardResponse: output (1) = Tensor{dtype (1), shape (2, packed), data (3)}, compute_ms (2), instance (3)
    const uint64_t data = n * uint64_t(H) * 8;
    const uint64_t shape = varint_size(n) + varint_size(uint64_t(H));
    const uint64_t tensor = 2 + 7 + 1 + varint_size(shape) + shape + 1 + varint_size(data) + data;
    std::vector<uint8_t> head;
    head.reserve(64);
    head.push_back(0x0a);                                              // output
    put_varint(head, tensor);
    head.push_back(0x0a);                                              //   dtype
    head.push_back(7);
    head.insert(head.end(), {'f', 'l', 'o', 'a', 't', '6', '4'});
    head.push_back(0x12);                                              //   shape
    put_varint(head, shape);
    put_varint(head, n);
    put_varint(head, uint64_t(H));
    head.push_back(0x1a);                                              //   data
    put_varint(head, data);
    const uint64_t tail = 1 + 8 + 1 + varint_size(instance.size()) + instance.size();
    at::Tensor reply = at::empty({int64_t(head.size() + data + tail)}, at::TensorOptions().dtype(at::kByte));
    uint8_t* out = reply.data_ptr<uint8_t>();
    std::memcpy(out, head.data(), head.size());
    out += head.size();
    std::memcpy(out, sum, data);                                      // little-endian float64, as wire.encode
    out += data;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ms = seconds * 1e3;
    std::vector<uint8_t> end;
    end.push_back(0x11);                                               // compute_ms (double)
    const auto* mb = reinterpret_cast<const uint8_t*>(&ms);
    end.insert(end.end(), mb, mb + 8);
    end.push_back(0x1a);                                               // instance
    put_varint(end, instance.size());
    end.insert(end.end(), instance.begin(), instance.end());
    std::memcpy(out, end.data(), end.size());
    return std::make_tuple(reply, int64_t(n), seconds);
}

}  // namespace colibri_ops

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("expert_answer(Tensor payload, int x_dtype, int H, int E, bool explicit_pairs, Tensor local, int w13, "
          "int w2, Tensor? b13, Tensor? b2, float alpha, float? limit, float up_offset, bool w8a8, str instance) "
          "-> (Tensor, int, float)");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("expert_answer", &colibri_ops::expert_answer); }
