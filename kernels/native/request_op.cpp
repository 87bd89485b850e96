// colibri::forward_request: one MoE layer's ForwardRequest serialized straight from the router's tensors, for a
// worker on the same-host socket (router_service/moe/remote.py), the bytes protobuf writes for the same message
// (fields in number order, defaults left out, the shape packed):
//
//   forward_request(hidden [n, H], ids [n, K] int32, weights [n, K] float32, layer, step, epoch, holds, checkpoint,
//                   explicit) -> uint8 [B]      (exact_sum set; no prefetch: a call with one takes the message path)
//
//   forward_send(fd, hidden [T, H], ids [T, K], weights [T, K], rows, layer, step, epoch, holds, checkpoint, explicit)
//       -> int: the message of `rows` (int64 [n]; None: all T) of the three, the bytes forward_request writes for
//       those rows (their index_select), as one frame (colibri_common/frames.py: an 8-byte header, then the
//       message) written to the connected socket `fd`: 0 once all of it is written, else -errno (OSError in Python)
//
// holds and checkpoint are fixed64 on the wire: their 64 bits come as int64. What it saves is three tensor
// encodings (each a copy to bytes), the message's construction (another copy) and its serialization (another), and
// the Python between them: ~0.1-0.2 ms a layer at 32 rows on the 2-core VMs, on caches the workers have flushed.
// forward_send saves the rest of the way to the socket: the tensor's numpy view, the header's packing, the copy
// that puts the two together and Python's sendall (42 µs cold for the view alone on the Zen 4 VM).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "wire.h"

#include <cerrno>
#include <cstring>
#include <optional>
#include <poll.h>
#include <string_view>
#include <sys/socket.h>
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

// a Tensor message's bytes for n rows of the 2-D t: dtype (1), shape (2, packed), data (3)
std::vector<uint8_t> tensor_head(const at::Tensor& t, int64_t n, uint64_t& data) {
    const std::string_view name = dtype_name(t.scalar_type());
    const int64_t dims[2] = {n, t.size(1)};
    uint64_t shape = 0;
    for (int64_t d : dims) shape += varint_size(uint64_t(d));
    data = uint64_t(n) * uint64_t(t.size(1)) * uint64_t(t.element_size());
    std::vector<uint8_t> h;
    h.push_back(0x0a);
    put_varint(h, name.size());
    h.insert(h.end(), name.begin(), name.end());
    if (shape) {
        h.push_back(0x12);
        put_varint(h, shape);
        for (int64_t d : dims) put_varint(h, uint64_t(d));
    }
    if (data) {
        h.push_back(0x1a);
        put_varint(h, data);
    }
    return h;
}

// The message's bytes, written where `room(size)` says (a pointer to `size` bytes).
// `rows` (int64 [n], or undefined: every row): the rows of the three tensors the message carries, in that order.
template <typename Room>
void serialize(Room room, const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
               const at::Tensor& rows, int64_t layer, int64_t step, int64_t epoch, int64_t holds, int64_t checkpoint,
               bool explicit_pairs) {
    TORCH_CHECK(hidden.dim() == 2 && ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == hidden.size(0),
                "colibri::forward_request: need hidden [T, H], ids and weights [T, K]");
    TORCH_CHECK(layer >= 0 && step >= 0 && epoch >= 0, "colibri::forward_request: layer, step and epoch are >= 0");
    const int64_t T = hidden.size(0);
    const int64_t* picked = nullptr;
    int64_t n = T;
    if (rows.defined()) {
        TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
                    "colibri::forward_request: rows is a contiguous int64 [n]");
        picked = rows.data_ptr<int64_t>();
        n = rows.numel();
        for (int64_t i = 0; i < n; ++i)
            TORCH_CHECK(picked[i] >= 0 && picked[i] < T, "colibri::forward_request: row ", picked[i], " is not in [0, ",
                        T, ")");
    }
    const at::Tensor ts[3] = {hidden.contiguous(), ids.contiguous(), weights.contiguous()};
    std::vector<uint8_t> head[3];
    uint64_t data[3];
    for (int i = 0; i < 3; ++i) head[i] = tensor_head(ts[i], n, data[i]);
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
    uint8_t* p = room(out.size() + data[0] + data[1] + data[2] + tail.size());
    size_t from = 0;
    for (int i = 0; i < 3; ++i) {                                      // the heads, each tensor's bytes after its own
        std::memcpy(p, out.data() + from, at[i] - from);
        p += at[i] - from;
        from = at[i];
        if (picked == nullptr) {
            std::memcpy(p, ts[i].data_ptr(), data[i]);
            p += data[i];
        } else {
            const size_t row = size_t(ts[i].size(1)) * size_t(ts[i].element_size());
            const auto* base = static_cast<const uint8_t*>(ts[i].data_ptr());
            for (int64_t r = 0; r < n; ++r, p += row) std::memcpy(p, base + size_t(picked[r]) * row, row);
        }
    }
    std::memcpy(p, tail.data(), tail.size());
}

}  // namespace

at::Tensor forward_request(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights, int64_t layer,
                           int64_t step, int64_t epoch, int64_t holds, int64_t checkpoint, bool explicit_pairs) {
    at::Tensor buf;
    serialize([&](size_t n) { buf = at::empty({int64_t(n)}, at::kByte); return buf.data_ptr<uint8_t>(); },
              hidden, ids, weights, at::Tensor(), layer, step, epoch, holds, checkpoint, explicit_pairs);
    return buf;
}

int64_t forward_send(int64_t fd, const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                     const std::optional<at::Tensor>& rows, int64_t layer, int64_t step, int64_t epoch, int64_t holds,
                     int64_t checkpoint, bool explicit_pairs) {
    thread_local std::vector<uint8_t> frame;                           // reused: no allocation a layer
    constexpr size_t HEADER = 8;                                       // u32 size (LE), status 0, three zero bytes
    serialize([&](size_t n) { frame.resize(HEADER + n); return frame.data() + HEADER; },
              hidden, ids, weights, rows.has_value() ? *rows : at::Tensor(), layer, step, epoch, holds, checkpoint,
              explicit_pairs);
    const uint64_t size = frame.size() - HEADER;
    TORCH_CHECK(size < (uint64_t(1) << 32), "colibri::forward_send: a message of ", size, " bytes is over a frame's");
    for (int i = 0; i < 4; ++i) frame[i] = uint8_t(size >> (8 * i));
    std::memset(frame.data() + 4, 0, 4);
    const uint8_t* p = frame.data();
    size_t left = frame.size();
    int64_t rc = 0;
    while (left && !rc) {
        const ssize_t n = ::send(int(fd), p, left, MSG_NOSIGNAL);
        if (n >= 0) {
            p += n;
            left -= size_t(n);
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {          // a non-blocking socket, full: wait for room
            pollfd w{int(fd), POLLOUT, 0};
            if (::poll(&w, 1, -1) < 0 && errno != EINTR) rc = -errno;
        } else if (errno != EINTR) {
            rc = -errno;
        }
    }
    if (frame.capacity() > (size_t(1) << 22)) std::vector<uint8_t>().swap(frame);   // a prefill's: not kept
    return rc;
}

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("forward_request(Tensor hidden, Tensor ids, Tensor weights, int layer, int step, int epoch, int holds, "
          "int checkpoint, bool explicit_pairs) -> Tensor");
    m.def("forward_send(int fd, Tensor hidden, Tensor ids, Tensor weights, Tensor? rows, int layer, int step, "
          "int epoch, int holds, int checkpoint, bool explicit_pairs) -> int");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) {
    m.impl("forward_request", &forward_request);
    m.impl("forward_send", &forward_send);
}
