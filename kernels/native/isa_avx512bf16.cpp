// The avx512bf16 build of the native kernels (its compiler flags: kernels/native_build.py): gemm.h's code on 16
// lanes, and VDPBF16PS dot products for bf16 x against bf16 weights (dpbf16.h).
#define CK_WIDTH 16
#define CK_NAME avx512bf16
#include "gemm.h"
#include "attention.h"
#include "dpbf16.h"
