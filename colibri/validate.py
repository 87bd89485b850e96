"""`colibri validate`: check a checkpoint before serving it, and size the shards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from colibri_common.flags import option
from colibri_common.options import DTYPE_CHOICES, QUANTIZE, serving_dtype

if TYPE_CHECKING:   # the CLI builds its parser from ValidateOptions without importing torch
    from colibri_common.checkpoint import Checkpoint
    from colibri_common.config import ModelConfig


@dataclass(frozen=True)
class ValidateOptions:
    model: str = option("", "checkpoint directory", required=True, metavar="DIR")
    workers: int = option(2, "size the shards for this many workers")
    dtype: str = option("auto", "size the weights as serve --dtype would hold them (auto = as the checkpoint)",
                        choices=DTYPE_CHOICES)
    replicas: int = option(1, "every expert on this many workers (as for serve --replicas)")
    quantize: str | None = option(None, "size the shards as serve --quantize would hold them: int8 (weight-only) "
                                        "or w8a8, a byte a weight and a float32 scale a row", choices=QUANTIZE)
    cpu_forms: str = option("auto", "the forms file whose forms for this machine to report (as for serve)",
                            metavar="PATH|auto|off")

    def __post_init__(self) -> None:
        if self.workers <= 0:
            raise ValueError(f"--workers must be positive, got {self.workers}")
        if not 1 <= self.replicas <= self.workers:
            raise ValueError(f"--replicas {self.replicas}: need 1 <= R <= --workers ({self.workers})")


FLOATS = ("F32", "BF16", "F16")


def held_bytes(ckpt: Checkpoint, name: str, shape: tuple[int, ...], itemsize: int = 2) -> int:
    """What a tensor takes once loaded in a compute dtype of `itemsize` bytes: a float weight at that size, an
    FP8 or MXFP4 weight dequantised to it (MXFP4: two values a byte of its blocks; its scales are folded in)."""
    e = ckpt.check(name, shape)
    if e.dtype == "F8_E4M3":
        ckpt.check_fp8(name)
        return _numel(e.shape) * itemsize
    if e.dtype == "U8" and name.endswith("_blocks"):
        return 2 * _numel(e.shape) * itemsize
    if e.dtype == "U8" and name.endswith("_scales"):
        return 0
    return _numel(e.shape) * itemsize if e.dtype in FLOATS else e.nbytes


def expert_bytes(ckpt: Checkpoint, cfg: ModelConfig, layer: int, expert: int, itemsize: int = 2) -> int:
    from colibri_common.tensors import expert_bias_tensors, stored_expert_tensors

    layout, specs = stored_expert_tensors(cfg, layer, expert, ckpt)
    per_layer = [*expert_bias_tensors(cfg, layer).values()] + ([] if layout == "per_expert" else [*specs.values()])
    own = [] if layout != "per_expert" else [*specs.values()]
    return sum(held_bytes(ckpt, n, s, itemsize) for n, s in own) + \
        sum(held_bytes(ckpt, n, s, itemsize) // cfg.num_experts for n, s in per_layer)


def quantized_expert_bytes(cfg: ModelConfig) -> int:
    """One expert held as int8 (either mode): a byte a weight, a float32 scale per output row."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return 3 * H * I + (2 * I + H) * 4


def validate(model_dir: str, workers: int, replicas: int = 1, quantize: str | None = None,
             cpu_forms: str = "off", dtype: str = "auto") -> list[str]:
    """Returns the summary lines; raises ColibriError naming the first problem."""
    from colibri_common.chat_template import compile_error, load_chat_template
    from colibri_common.checkpoint import Checkpoint
    from colibri_common.config import ModelConfig
    from colibri_common.errors import CheckpointError, ConfigError
    from colibri_common.forms_file import describe_machine, in_force, resolve
    from colibri_common.placement import replica_experts
    from colibri_common.tensors import router_tensors, unused_tensors
    from colibri_common.tokenizer import Tokenizer
    from kernels import CANDIDATES, native

    if native.refused_override():               # what the router and workers would refuse at start
        raise ConfigError(native.refused_override())
    cfg = ModelConfig.from_dir(model_dir)
    ckpt = Checkpoint(model_dir)
    held = serving_dtype(dtype, cfg.torch_dtype)                  # what serve computes in: its weights' size
    itemsize = 4 if held == "float32" else 2
    router_bytes = sum(held_bytes(ckpt, n, s, itemsize) for n, s in router_tensors(cfg))
    per_expert = {(layer, e): quantized_expert_bytes(cfg) if quantize else expert_bytes(ckpt, cfg, layer, e, itemsize)
                  for layer in cfg.moe_layers for e in range(cfg.num_experts)}
    total_bytes = sum(e.nbytes for e in ckpt.entries.values())
    params = sum(_params(name, e.dtype, e.shape) for name, e in ckpt.entries.items())
    tok_path = Path(model_dir) / "tokenizer.json"
    tokenizer = Tokenizer.from_dir(model_dir)
    tok_vocab = None if tokenizer is None else tokenizer.vocab_size
    if tok_vocab is not None and tok_vocab > cfg.vocab_size:
        raise CheckpointError(f"{tok_path} has {tok_vocab} tokens but config.json vocab_size is "
                              f"{cfg.vocab_size}; they must agree")
    template, _ = load_chat_template(model_dir)      # as the router reads it (tokenizer_config.json, special tokens)
    if template is not None and (why := compile_error(template)) is not None:
        raise CheckpointError(f"{model_dir}: the chat template does not compile: {why}; fix its chat_template.jinja "
                              f"(or tokenizer_config.json's chat_template): /v1/chat/completions would answer 500")
    lines = [
        f"architecture     {cfg.architecture}",
        f"parameters       {params / 1e6:.1f}M ({total_bytes / 2**20:.1f} MiB on disk, {len(ckpt.entries)} tensors)",
        f"stored dtype     {cfg.torch_dtype} ({cfg.torch_dtype_from}); sized as served in {held} (--dtype {dtype})",
        "quantisation     " + ("; ".join(f"{k} ({n} tensors), dequantised to the compute dtype as they are read"
                                         for k, n in ckpt.quantized().items()) or "none"),
        f"layers           {cfg.num_layers} ({len(cfg.moe_layers)} with routed experts)",
        f"experts/layer    {cfg.num_experts}, top-{cfg.top_k}, width {cfg.moe_intermediate_size}"
        + (f", shared expert width {cfg.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size
           else "")
        + (", biases" if cfg.arch.expert_bias else "")
        + (f", clamped SwiGLU (alpha {cfg.swiglu_alpha:g}, limit {cfg.swiglu_limit:g})"
           if cfg.swiglu_limit is not None else ""),
        f"routing          {cfg.scoring}" + (" + correction bias" if cfg.arch.routing_bias else "")
        + (" (gate with bias)" if cfg.arch.gate_bias else "")
        + (f", top-{cfg.topk_groups} of {cfg.num_groups} groups" if cfg.num_groups > 1 else "")
        + (", renormalised" if cfg.norm_topk_prob else "")
        + (f", scaled x{cfg.routed_scaling:g}" if cfg.routed_scaling != 1 else ""),
        _attention_line(cfg),
        f"tokenizer        {'none' if tok_vocab is None else f'{tok_vocab} tokens'} (vocab_size {cfg.vocab_size})"
        f"; chat template {'none' if template is None else 'compiles'}",
        "unused tensors   " + _unused_line(cfg, *unused_tensors(cfg, ckpt.entries.keys())),
        f"router holds     {router_bytes / 2**20:.1f} MiB",
        "experts held     " + {None: "as stored (dequantised to the compute dtype)",
                               "int8": "int8 weight-only (--quantize int8): activations in the compute dtype",
                               "w8a8": "int8 weights and per-token int8 activations (--quantize w8a8)"}[quantize],
        f"this CPU         {describe_machine()}",
        f"                 {native.describe()}",
        *(f"                 {line}" for line in in_force(resolve(cpu_forms), CANDIDATES)),
    ]
    for i in range(workers):
        experts = replica_experts(cfg.num_experts, i, workers, replicas)
        b = sum(per_expert[(layer, e)] for layer in cfg.moe_layers for e in experts)
        held = f"experts {experts[0]}..{experts[-1]}" if experts == list(range(experts[0], experts[-1] + 1)) else \
            f"{len(experts)} experts ({', '.join(_ranges(experts))})"
        lines.append(f"worker {i}/{workers}     {held}: {b / 2**20:.1f} MiB")
    return lines


def _unused_line(cfg: ModelConfig, unused: list[str], nextn: list[str]) -> str:
    from colibri_common.tensors import summarise

    parts = [f"{len(unused)} that config.json leaves unread ({summarise(unused)}; transformers leaves them out too: "
             f"check num_hidden_layers and the keys that turn on biases or qk-norm)"] if unused else []
    if nextn:
        parts.append(f"{len(nextn)} tensors of {cfg.nextn_layers} multi-token prediction layer(s) past "
                     f"num_hidden_layers (not served)")
    return "; ".join(parts) or "none"


def _attention_line(cfg: ModelConfig) -> str:
    m = cfg.mla
    if m is not None:
        return (f"attention        latent: {cfg.num_heads} heads (no-position {m.qk_nope_head_dim} + rotary "
                f"{m.qk_rope_head_dim}, values {m.v_head_dim}), q_lora {m.q_lora_rank or 'none'}, KV cache "
                f"{m.kv_lora_rank} + {m.qk_rope_head_dim} values per token and layer")
    return (f"attention        {cfg.num_heads} heads x {cfg.head_dim}, {cfg.num_kv_heads} KV heads, "
            f"qk-norm {cfg.qk_norm}, bias {cfg.qkv_bias}"
            + (f", rotary on {cfg.rotary_dim} of {cfg.head_dim} dims" if cfg.rotary_dim != cfg.head_dim else "")
            + (", sinks" if cfg.arch.attention_sinks else "")
            + (f", sliding window {cfg.sliding_window} on {len(cfg.sliding_layers)} of {cfg.num_layers} layers"
               if cfg.sliding_layers else ""))


def _ranges(ids: list[int]) -> list[str]:
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None], strict=True):
        if b != a + 1:
            out.append(f"{start}..{a}" if a != start else str(a))
            start = b
    return out


def _params(name: str, dtype: str, shape: tuple[int, ...]) -> int:
    """Weights a tensor stores: two per byte of MXFP4 blocks, none in their scales (or FP8's)."""
    if dtype == "U8" and name.endswith("_blocks"):
        return 2 * _numel(shape)
    if (dtype == "U8" and name.endswith("_scales")) or name.endswith("_scale_inv"):
        return 0
    return _numel(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
