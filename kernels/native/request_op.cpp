// colibri::forward_request: one MoE layer's ForwardRequest serialized straight from the router's tensors, for a
// worker on the same-host socket (router_service/moe/remote.py), the bytes protobuf writes for the same message
// (fields in number order, defaults left out, the shape packed):
//
//   forward_request(hidden [n, H], ids [n, K] int32, weights [n, K] float32, layer, step, epoch, holds, checkpoint,
//                   explicit) -> uint8 [B]      (exact_sum set; no prefetch: a call with one takes the message path)
//
// holds and checkpoint are fixed64 on the wire: their 64 bits come as int64. What it saves is three tensor
// encodings (each a copy to bytes), the message's construction (another copy) and its serialization (another), and
// the Python between them: ~0.1-0.2 ms a layer at 32 rows on the 2-core VMs, on caches the workers have flushed.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "wire.h"

#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using colibri_wire::put_varint;
using colibri_wire::varint_size;

std::string_view dtype_name(at::ScalarType t) {
    switch (t) {
        case at::kFloat: return "float32";
        case at::kBFloat16: return "bfloat16";
        case at::kHalf: return "float16";
        case at::kDouble: return "float64";
        case at::kInt: return "int32";
        case at::kLong: return "int64";
        default: TORCH_CHECK(false, "colibri::forward_request: no wire name for ", t);
    }
}

// a Tensor message's bytes: dtype (1), shape (2, packed), data (3)
std::vector<uint8_t> tensor_head(const at::Tensor& t, uint64_t& data) {
    const std::string_view name = dtype_name(t.scalar_type());
    uint64_t shape = 0;
    for (int64_t d : t.sizes()) shape += varint_size(uint64_t(d));
    data = uint64_t(t.numel()) * uint64_t(t.element_size());
    std::vector<uint8_t> h;
    h.push_back(0x0a);
    put_varint(h, name.size());
    h.insert(h.end(), name.begin(), name.end());
    if (shape) {
        h.push_back(0x12);
        put_varint(h, shape);
        for (int64_t d : t.sizes()) put_varint(h, uint64_t(d));
    }
    if (data) {
        h.push_back(0x1a);
        put_varint(h, data);
    }
    return h;
}

}  // namespace

at::Tensor forward_request(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights, int64_t layer,
                           int64_t step, int64_t epoch, int64_t holds, int64_t checkpoint, bool explicit_pairs) {
    TORCH_CHECK(hidden.dim() == 2 && ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == hidden.size(0),
                "colibri::forward_request: need hidden [n, H], ids and weights [n, K]");
    TORCH_CHECK(layer >= 0 && step >= 0 && epoch >= 0, "colibri::forward_request: layer, step and epoch are >= 0");
    const at::Tensor ts[3] = {hidden.contiguous(), ids.contiguous(), weights.contiguous()};
    std::vector<uint8_t> head[3];
    uint64_t data[3];
    for (int i = 0; i < 3; ++i) head[i] = tensor_head(ts[i], data[i]);
    std::vector<uint8_t> out;                                          // everything but the three tensors' data
    out.reserve(96);
    std::vector<size_t> at(3);                                         // where each tensor's data goes in `out`
    if (layer) {
        out.push_back(0x08);
        put_varint(out, uint64_t(layer));
    }
    for (int i = 0; i < 3; ++i) {
        out.push_back(uint8_t(0x12 + 8 * i));                          // fields 2, 3, 4: length-delimited
        put_varint(out, head[i].size() + data[i]);
        out.insert(out.end(), head[i].begin(), head[i].end());
        at[i] = out.size();                                            // its data follows here
    }
    std::vector<uint8_t> tail;
    if (step) {
        tail.push_back(0x28);
        put_varint(tail, uint64_t(step));
    }
    tail.push_back(0x38);                                              // exact_sum = true
    tail.push_back(1);
    if (epoch) {
        tail.push_back(0x40);
        put_varint(tail, uint64_t(epoch));
    }
    const std::pair<uint8_t, int64_t> fixed[2] = {{0x49, holds}, {0x51, checkpoint}};   // fixed64 fields 9, 10
    for (const auto& [key, v] : fixed) {
        if (!v) continue;
        tail.push_back(key);
        const auto* b = reinterpret_cast<const uint8_t*>(&v);           // little-endian, as protobuf's fixed64
        tail.insert(tail.end(), b, b + 8);
    }
    if (explicit_pairs) {
        tail.push_back(0x58);
        tail.push_back(1);
    }
    at::Tensor buf = at::empty({int64_t(out.size() + data[0] + data[1] + data[2] + tail.size())}, at::kByte);
    uint8_t* p = buf.data_ptr<uint8_t>();
    size_t from = 0;
    for (int i = 0; i < 3; ++i) {                                      // the heads, each tensor's bytes after its own
        std::memcpy(p, out.data() + from, at[i] - from);
        p += at[i] - from;
        from = at[i];
        std::memcpy(p, ts[i].data_ptr(), data[i]);
        p += data[i];
    }
    std::memcpy(p, tail.data(), tail.size());
    return buf;
}

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("forward_request(Tensor hidden, Tensor ids, Tensor weights, int layer, int step, int epoch, int holds, "
          "int checkpoint, bool explicit_pairs) -> Tensor");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("forward_request", &forward_request); }
