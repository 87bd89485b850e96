// What the torch-side translation units share: the entry points of the ISA level in force (ops.cpp picks it).
#pragma once

#include <cstdint>

extern "C" {
// colibri_decode_attention_<ISA> (attention.h)
typedef void (*attention_fn)(const float*, int, int, int, const void*, const void*, int, int64_t, int64_t,
                             const int64_t*, int, const float*, float, float*, float*);
}

namespace colibri_ops {
attention_fn attention_kernel();   // the level in force's decode attention
}
