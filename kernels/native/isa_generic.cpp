// The generic build of the native kernels (its compiler flags: kernels/native_build.py).
#define CK_WIDTH 8
#define CK_NAME generic
#include "gemm.h"
#include "attention.h"
