// The amx build of the native kernels (its compiler flags: kernels/native_build.py): the avx512bf16 level's code,
// and AMX tiles for bf16 x bf16 and W8A8 products (amx.h).
#define CK_WIDTH 16
#define CK_NAME amx
#include "gemm.h"
#include "attention.h"
#include "amx.h"
