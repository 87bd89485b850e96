// The avx2 build of the native kernels (its compiler flags: kernels/native_build.py).
#define CK_WIDTH 8
#define CK_NAME avx2
#include "gemm.h"
#include "attention.h"
