// colibri::combine_replies: the router's sum of one MoE layer's answers, read where they lie in the workers' reply
// bytes (the same-host socket's frames: router_service/moe/in_flight.py), with the bits of the Python path
// (protobuf's parse, wire.decode, router_service/moe/combine.py):
//
//   combine_replies(payloads [P] uint8 ForwardResponse bytes, rows [P] (int64 [n_p], or empty = all T rows), T, H,
//                   dtype) -> (out [T, H] in dtype, each reply's compute_ms, each reply's instance)
//
//   every part's rows None: acc = part 0, acc += part 1, ...      else: acc = 0, then part by part acc[rows] += part
//   out = acc.to(dtype)                                           (torch's rounding, once: `rounded`)
//
// An empty `out` means "not this way": a reply that is not a float64 [n, H] sum of its rows, a row out of range, rows
// that are not a contiguous int64 [n] tensor, an instance not in ASCII (Python decodes the rest of UTF-8), or a field
// it does not expect goes to the Python path, which parses and says what is wrong. What it saves is a reply's
// three copies (protobuf's parse, the bytes field's read, the float64 add's new tensor) and the Python between them:
// at 32 rows a reply is 256 KiB, on caches the workers' weights have just flushed.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "bf16.h"
#include "ops.h"
#include "wire.h"

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace {

using colibri_wire::Cursor;
using colibri_wire::Field;
using colibri_wire::matrix;
using colibri_wire::parse_tensor;

struct Reply {
    Field output;
    double compute_ms = 0.0;
    int64_t instance_at = 0, instance_len = 0;
};

// ForwardResponse: output (1, a Tensor, once), compute_ms (2, double), instance (3, string); others skipped
bool parse_reply(const uint8_t* s, uint64_t n, Reply& r) {
    Cursor c{s, s + n};
    while (c.p < c.end) {
        uint64_t key, field;
        int wire_type;
        if (!c.varint(key) || !colibri_wire::field_of(key, field, wire_type)) return false;
        const uint8_t* b;
        uint64_t m;
        if (field == 1) {
            if (wire_type != 2 || r.output.seen || !c.bytes(b, m) || !parse_tensor(b, m, r.output)) return false;
            r.output.seen = true;
        } else if (field == 2) {
            if (wire_type != 1 || c.end - c.p < 8) return false;
            std::memcpy(&r.compute_ms, c.p, 8);
            c.p += 8;
        } else if (field == 3) {
            if (wire_type != 2 || !c.bytes(b, m)) return false;
            r.instance_at = b - s;
            r.instance_len = int64_t(m);
        } else if (!c.skip(wire_type)) {
            return false;
        }
    }
    return r.output.seen;
}

// dst[i] += the float64 at src + 8 i, for i < n (src need not be aligned: a protobuf bytes field's offset)
inline void add_sums(double* dst, const uint8_t* src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, src + i * int64_t(sizeof(double)), sizeof v);
        dst[i] += v;
    }
}

// acc [T, H] float64 rounded to `dtype` with torch's bits (acc.to(dtype): to float32, then to bfloat16 at nearest
// even; a NaN, which a worker's finite sums never hold, comes out 0x7FC0, as torch's scalar tail gives and not its
// vector lanes' 0xFFFF), in a plain loop for the two hidden dtypes rather than `to`'s TensorIterator path, which a
// decode step's one-row sum runs on caches the workers' weights have just flushed (docs/performance.md).
at::Tensor rounded(const at::Tensor& acc, at::ScalarType dtype) {
    if (dtype != at::kBFloat16 && dtype != at::kFloat) return acc.to(dtype);
    at::Tensor out = at::empty(acc.sizes(), at::TensorOptions().dtype(dtype));
    const double* a = acc.data_ptr<double>();
    const int64_t n = acc.numel();
    if (dtype == at::kFloat) {
        float* o = out.data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(a[i]);
    } else {
        uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
        for (int64_t i = 0; i < n; ++i) o[i] = colibri_bf16::bits(static_cast<float>(a[i]));
    }
    return out;
}

}  // namespace

namespace colibri_ops {

bool combine_into(at::TensorList payloads, at::TensorList rows, int64_t T, int64_t H, at::ScalarType dtype,
                  at::Tensor& out, std::vector<double>& ms, std::vector<std::string>* instances) {
    const int64_t P = int64_t(payloads.size());
    TORCH_CHECK(int64_t(rows.size()) == P && P > 0 && T > 0 && H > 0,
                "colibri::combine_replies: one rows tensor per payload, T and H positive");
    auto none = [] { return false; };       // where the Python path must take the replies
    std::vector<Reply> parts(P);
    bool all_rows = true;
    for (int64_t p = 0; p < P; ++p) {
        const at::Tensor& b = payloads[p];
        TORCH_CHECK(b.scalar_type() == at::kByte && b.dim() == 1 && b.is_contiguous(),
                    "colibri::combine_replies: each payload is a contiguous uint8 [B] tensor");
        if (!parse_reply(b.data_ptr<uint8_t>(), uint64_t(b.numel()), parts[p])) return none();
        const uint8_t* id = b.data_ptr<uint8_t>() + parts[p].instance_at;
        for (int64_t i = 0; i < parts[p].instance_len; ++i)
            if (id[i] >= 0x80) return none();                          // UTF-8 beyond ASCII: Python decodes it
        const at::Tensor& r = rows[p];
        const bool all = r.numel() == 0;
        if (!all) {
            if (r.scalar_type() != at::kLong || r.dim() != 1 || !r.is_contiguous()) return none();   // Python's to sum
            const int64_t* rp = r.data_ptr<int64_t>();
            for (int64_t i = 0; i < r.numel(); ++i)
                if (rp[i] < 0 || rp[i] >= T) return none();
        }
        all_rows = all_rows && all;
        uint64_t n, h;
        if (!matrix(parts[p].output, "float64", 8, n, h) || int64_t(h) != H || int64_t(n) != (all ? T : r.numel()))
            return none();
    }
    at::Tensor acc = all_rows ? at::empty({T, H}, at::kDouble) : at::zeros({T, H}, at::kDouble);   // [T, H]
    double* a = acc.data_ptr<double>();
    for (int64_t p = 0; p < P; ++p) {          // each reply's sums read where they lie (unaligned loads: a copy
        const Field& f = parts[p].output;      // of each to align it cost a pass over 192 KiB at 32 rows)
        const int64_t n = int64_t(f.shape[0]);
        const uint8_t* v = f.data;
        if (all_rows && p == 0) {
            std::memcpy(a, v, f.size);                                 // acc = part 0 (its -0.0 kept, as Python's)
        } else if (rows[p].numel() == 0) {
            add_sums(a, v, T * H);
        } else {
            const int64_t* rp = rows[p].data_ptr<int64_t>();
            for (int64_t i = 0; i < n; ++i) add_sums(a + rp[i] * H, v + i * H * int64_t(sizeof(double)), H);
        }
    }
    ms.resize(size_t(P));
    if (instances) instances->resize(size_t(P));
    for (int64_t p = 0; p < P; ++p) {
        ms[p] = parts[p].compute_ms;
        if (instances)
            (*instances)[p].assign(reinterpret_cast<const char*>(payloads[p].data_ptr<uint8_t>()) +
                                   parts[p].instance_at, size_t(parts[p].instance_len));
    }
    out = rounded(acc, dtype);
    return true;
}

}  // namespace colibri_ops

std::tuple<at::Tensor, std::vector<double>, std::vector<std::string>> combine_replies(
        at::TensorList payloads, at::TensorList rows, int64_t T, int64_t H, at::ScalarType dtype) {
    at::Tensor out;
    std::vector<double> ms;
    std::vector<std::string> instances;
    if (!colibri_ops::combine_into(payloads, rows, T, H, dtype, out, ms, &instances))   // the Python path's
        return std::make_tuple(at::empty({0}, at::TensorOptions().dtype(dtype)), std::vector<double>(),
                               std::vector<std::string>());
    return std::make_tuple(out, std::move(ms), std::move(instances));
}

TORCH_LIBRARY_FRAGMENT(colibri, m) {
    m.def("combine_replies(Tensor[] payloads, Tensor[] rows, int T, int H, ScalarType dtype) "
          "-> (Tensor, float[], str[])");
}

TORCH_LIBRARY_IMPL(colibri, CPU, m) { m.impl("combine_replies", &combine_replies); }
