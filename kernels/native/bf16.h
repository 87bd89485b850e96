// bfloat16 <-> float32 for the torch-side units' element loops, as c10::BFloat16 converts (round to nearest even,
// every NaN to 0x7FC0) but branch-free, so that loops of it vectorise (c10's isnan branch kept rope, rms_norm and
// the linear's bf16 output scalar). Raw bits: a bf16 tensor's data as uint16_t.
#pragma once

#include <cstdint>
#include <cstring>

namespace colibri_bf16 {

static inline float to_float(uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bits(float f) {                 // c10::detail::round_to_nearest_even
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7FC0) : r;
}

static inline float round(float f) { return to_float(bits(f)); }   // float(bf16(f))

}  // namespace colibri_bf16
