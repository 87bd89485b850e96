// The amx build of the native kernels (its compiler flags: kernels/native_build.py): the avx512bf16 level's code,
// AMX tiles for bf16 x bf16 and W8A8 products (amx.h), and for weight-only int8 against bf16 x (amx_x16.h).
#define CK_WIDTH 16
#define CK_NAME amx
#define CK_X16_TILES 1
#include "gemm.h"
#include "attention.h"
#include "amx.h"
#include "amx_x16.h"
