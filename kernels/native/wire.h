// protobuf's wire format, as far as the ForwardRequest's and ForwardResponse's tensors need it (protos/expert.proto):
// a reader of varints, length-delimited fields and Tensor messages over a message's bytes (every read bounded by its
// end: a malformed message is a false return, never a read past it), and the writer's varints. Used by
// expert_answer_op.cpp (a worker's answer) and combine_op.cpp (the router's sum of the answers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace colibri_wire {

struct Cursor {
    const uint8_t* p;
    const uint8_t* end;

    bool varint(uint64_t& v) {
        v = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            if (p == end) return false;
            const uint8_t b = *p++;
            v |= uint64_t(b & 0x7f) << shift;
            if (!(b & 0x80)) return true;
        }
        return false;
    }
    bool bytes(const uint8_t*& s, uint64_t& n) {
        if (!varint(n) || n > uint64_t(end - p)) return false;
        s = p;
        p += n;
        return true;
    }
    bool skip(int wire_type) {            // a field this reader does not take (groups: not in these messages)
        uint64_t v;
        const uint8_t* s;
        switch (wire_type) {
            case 0: return varint(v);
            case 1: if (end - p < 8) return false; p += 8; return true;
            case 2: return bytes(s, v);
            case 5: if (end - p < 4) return false; p += 4; return true;
            default: return false;
        }
    }
};

// a field's number and wire type from its key; false for the numbers protobuf refuses (0, and 2^29 and above)
inline bool field_of(uint64_t key, uint64_t& field, int& wire_type) {
    field = key >> 3;
    wire_type = int(key & 7);
    return field != 0 && field < (uint64_t(1) << 29);
}

constexpr size_t MAX_DIMS = 8;             // a shape of more dimensions is declined (as wire.decode refuses it)

struct Field {                            // one Tensor message: dtype, shape, data
    std::string_view dtype;
    std::vector<uint64_t> shape;
    const uint8_t* data = nullptr;
    uint64_t size = 0;
    bool seen = false;
};

inline bool parse_tensor(const uint8_t* s, uint64_t n, Field& t) {
    Cursor c{s, s + n};
    bool dtype = false, data = false;
    while (c.p < c.end) {
        uint64_t key, field;
        int wire_type;
        if (!c.varint(key) || !field_of(key, field, wire_type)) return false;
        const uint8_t* b;
        uint64_t m;
        if (field == 1) {                                                   // string dtype
            if (wire_type != 2 || dtype || !c.bytes(b, m)) return false;
            t.dtype = std::string_view(reinterpret_cast<const char*>(b), m);
            dtype = true;
        } else if (field == 2 && wire_type == 2) {                          // repeated int64 shape, packed
            if (!c.bytes(b, m)) return false;
            Cursor d{b, b + m};
            while (d.p < d.end) {
                uint64_t v;
                if (!d.varint(v) || t.shape.size() >= MAX_DIMS) return false;
                t.shape.push_back(v);
            }
        } else if (field == 2 && wire_type == 0) {                          // or one by one
            uint64_t v;
            if (!c.varint(v) || t.shape.size() >= MAX_DIMS) return false;
            t.shape.push_back(v);
        } else if (field == 3) {                                            // bytes data
            if (wire_type != 2 || data || !c.bytes(t.data, t.size)) return false;
            data = true;
        } else if (field <= 3 || !c.skip(wire_type)) {
            return false;
        }
    }
    return true;
}

// [rows, cols] of `t` in `dtype` with `item`-byte elements and exactly their bytes, or false
inline bool matrix(const Field& t, std::string_view dtype, uint64_t item, uint64_t& rows, uint64_t& cols) {
    if (t.dtype != dtype || t.shape.size() != 2) return false;
    rows = t.shape[0];
    cols = t.shape[1];
    uint64_t elements, bytes;
    if (rows == 0 || cols == 0 || __builtin_mul_overflow(rows, cols, &elements) ||
        __builtin_mul_overflow(elements, item, &bytes) || rows > (uint64_t(1) << 31) || cols > (uint64_t(1) << 31))
        return false;
    return t.size == bytes;
}

inline void put_varint(std::vector<uint8_t>& out, uint64_t v) {
    while (v >= 0x80) {
        out.push_back(uint8_t(v) | 0x80);
        v >>= 7;
    }
    out.push_back(uint8_t(v));
}

inline size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        ++n;
    }
    return n;
}

}  // namespace colibri_wire
