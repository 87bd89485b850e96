"""The weight formats, each layout written once: what the kernels compute and what the checkpoint loaders read.

- `int8`   per-output-row int8 with float32 scales (`--quantize int8|w8a8`, `--quantize-dense`): `Int8Weight`,
           `quantize_int8`, and the per-row activation quantiser of W8A8.
- `fp8`    block-scaled float8 e4m3 as DeepSeek-V3 / Kimi K2 publish it: `Fp8Weight` (held on GPUs),
           `dequantize` (CPUs, at load), `SCALE_SUFFIX`, `DEFAULT_BLOCK`.
- `mxfp4`  OCP microscaling e2m1 with e8m0 block scales as GPT-OSS publishes its experts: `Mxfp4Weight` (held
           on GPUs), `dequantize` (CPUs, as a worker packs), `BLOCK`, `SCALE_BIAS`, `E2M1`.
"""
