// The avx512bf16 build of the native kernels (its compiler flags: kernels/native_build.py).
#define CK_WIDTH 16
#define CK_NAME avx512bf16
#include "gemm.h"
#include "attention.h"
