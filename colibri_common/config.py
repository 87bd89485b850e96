"""Model configuration parsed from a Hugging Face `config.json`.

One model implementation serves every architecture; what differs between them is data (`ArchSpec`,
architectures.py): tensor names, qk-norm kind, attention bias, shared experts, dense-layer rules.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from colibri_common.architectures import ARCHITECTURES, SLIDING_KINDS, ArchSpec
from colibri_common.errors import CheckpointError, ConfigError
from colibri_common.rope_scaling import RopeScaling
from colibri_common.safetensors_header import read_header, read_index

# config.json's torch_dtype (transformers 5: dtype) as transformers reads it (getattr(torch, name)): the floating
# dtypes a checkpoint's weights are saved in, by their saved names and the aliases of them
STORED_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16", "float64": "float64", "double": "float64",
                 **{name: name for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")}}


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek-V2/V3): queries (through a q_lora_rank bottleneck when > 0) of
    qk_nope + qk_rope dims per head; keys and values expand from one kv_lora_rank latent per token, which the
    KV cache stores with the token's shared qk_rope key."""

    q_lora_rank: int              # 0: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # DeepSeek's rotary pairs are (x0, x1), (x2, x3), ...

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0 or self.qk_rope_head_dim % 2:
            raise ConfigError(f"config.json: q_lora_rank must be >= 0 and qk_rope_head_dim even, got "
                              f"{self.q_lora_rank}, {self.qk_rope_head_dim}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    arch: ArchSpec
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    clip_qkv: float | None
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    dense_intermediate_size: int          # width of dense MLP layers (Qwen2-MoE mlp_only_layers)
    shared_expert_intermediate_size: int  # 0 when there is no shared expert
    moe_layers: tuple[int, ...]           # layers with routed experts
    qk_norm: str = "none"                 # the architecture's kind, when its config turns it on
    rotary_dim: int = 0                   # leading dims of each head that RoPE rotates (partial rotary); 0 = D
    scoring: str = "softmax"              # routing (kernels.topk_route): scores, groups, scaling
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    rope_scaling: RopeScaling = RopeScaling()
    mla: MlaDims | None = None            # DeepSeek's latent attention; then head_dim = qk_nope + qk_rope
    sliding_window: int = 0               # a sliding layer's query sees its last `sliding_window` positions
    sliding_layers: tuple[int, ...] = ()  # the layers that slide (the others attend to the whole context)
    swiglu_alpha: float = 1.0             # the experts' gated activation (kernels.GatedAct): GPT-OSS clamps
    swiglu_limit: float | None = None
    swiglu_up_offset: float = 0.0
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"
    torch_dtype_from: str = "config.json"     # where torch_dtype was read: config.json, or the weights (from_dir)
    nextn_layers: int = 0                 # layers stored past num_layers for multi-token prediction (not served)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "num_experts", "top_k", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.json: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"config.json: top-k {self.top_k} exceeds the {self.num_experts} experts")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"config.json: partial_rotary_factor gives {self.rotary_dim} rotary dims of a "
                              f"{self.head_dim}-dim head; need an even number in 2..{self.head_dim}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"config.json: n_group={self.num_groups}, topk_group={self.topk_groups} do not fit "
                              f"{self.num_experts} experts (need n_group | experts and 1 <= topk_group <= n_group)")
        if self.num_groups > 1 and self.arch.group_score == "top2" and self.num_experts // self.num_groups < 2:
            raise ConfigError(f"config.json: n_group={self.num_groups} leaves groups of one expert; a group's "
                              f"top-2 score needs two")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ConfigError(f"config.json: layers {list(self.sliding_layers)} slide but sliding_window is "
                              f"{self.sliding_window}; need a positive window")
        if self.num_groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ConfigError(f"config.json: num_experts_per_tok={self.top_k} exceeds the experts of topk_group="
                              f"{self.topk_groups} groups")

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """What the KV cache holds per token and layer: (heads, K dims, V dims); latent attention keeps its
        kv_lora_rank latent as K and the shared rotary key as V, one 'head'."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: {'not a file' if path.exists() else 'not found'}; --model must be a Hugging "
                              f"Face checkpoint directory")
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must hold a JSON object (a model's config), not a {type(raw).__name__}")
        try:
            cfg = ModelConfig.from_dict(raw, source=str(path))
        except ConfigError as exc:                     # the checks' "config.json: ...", with the file's directory
            message = str(exc)
            if not message.startswith("config.json:"):
                raise
            raise ConfigError(f"{path}{message.removeprefix('config.json')}") from None
        except (ValueError, TypeError, AttributeError, KeyError) as exc:   # a value of the wrong type or form
            raise ConfigError(f"{path}: a value of the wrong type or form ({type(exc).__name__}: {exc}); is it a "
                              f"Hugging Face config.json?") from None
        extra = _generation_eos(Path(model_dir) / "generation_config.json")
        if extra - set(cfg.eos_token_ids):        # generate()'s stop tokens too (GPT-OSS: <|call|>, <|endoftext|>)
            cfg = dataclasses.replace(cfg, eos_token_ids=(*cfg.eos_token_ids,
                                                          *sorted(extra - set(cfg.eos_token_ids))))
        stored = stored_names(Path(model_dir)) if cfg.tie_word_embeddings or cfg.arch.shared_expert else set()
        if cfg.tie_word_embeddings and "lm_head.weight" in stored:
            # the output layer the checkpoint stores is the one used, as transformers loads it (it does not tie a
            # head it was given: a config that says tied over an untied checkpoint gave other tokens than it)
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
        shared = f".{cfg.arch.moe_prefix}.{cfg.arch.shared_prefix}."
        if cfg.arch.shared_expert and not cfg.shared_expert_intermediate_size and any(shared in n for n in stored):
            raise ConfigError(f"{path}: shared_expert_intermediate_size is 0, but the checkpoint stores shared expert "
                              f"weights (*{shared}*); set it to their width (transformers refuses it too)")
        if not raw.get("dtype") and not raw.get("torch_dtype"):    # none named: the weights' own, as transformers 5
            saved = weights_dtype(Path(model_dir))
            cfg = dataclasses.replace(cfg, torch_dtype=saved or cfg.torch_dtype, torch_dtype_from=(
                "the weights; config.json names none" if saved else "config.json names none: transformers 4's default"))
        return cfg

    @staticmethod
    def from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or '(none given)'}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}")
        name = known[0]
        arch = ARCHITECTURES[name]
        mha = "num_key_value_heads" in raw and raw["num_key_value_heads"] is None     # an explicit null: every head
        raw = {**dict(arch.defaults), **{k: v for k, v in raw.items() if v is not None}}
        if mha:
            raw.pop("num_key_value_heads", None)

        def need(*keys: str):
            for key in keys:
                if raw.get(key) is not None:
                    return raw[key]
            raise ConfigError(f"{source}: missing '{' or '.join(keys)}' required by {name}")

        def size(*keys: str) -> int:                    # a count or a dimension: a whole number from 1
            value = need(*keys)
            if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
                key = next(k for k in keys if raw.get(k) is not None)
                raise ConfigError(f"{source}: {key} must be a whole number from 1, got {value!r}")
            return int(value)

        for key, values in arch.allowed:
            if raw.get(key) not in values:
                raise ConfigError(f"{source}: {key} '{raw.get(key)}' is not one {name} can serve; supported: "
                                  f"{', '.join(str(v) for v in values if v is not None)}")
        act = raw.get("hidden_act", "silu")
        if not arch.clamped_swiglu and act not in ("silu", "swish"):    # GPT-OSS's experts clamp their own SwiGLU
            raise ConfigError(f"{source}: hidden_act '{act}' is not one {name} can serve; supported: silu (its "
                              f"experts and MLPs compute SiLU-gated units)")
        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        layers = size("num_hidden_layers")
        # as transformers: rope_scaling, where a config gives one, takes rope_parameters' place (its own rope_theta,
        # else the top level's or the architecture's default: not rope_parameters'); a long-context recipe adds it to
        # a config that transformers 5 saved with rope_parameters
        where = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
        rope = raw.get(where) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: {where} must be an object (rope_type, factor, ...), got {rope!r}")
        max_positions = size("max_position_embeddings") if "max_position_embeddings" in raw else 4096
        rope_scaling = RopeScaling.from_raw(rope, max_positions, raw, where)
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if not (math.isfinite(rope_theta) and rope_theta > 0):
            raise ConfigError(f"{source}: rope_theta must be a positive number, got {rope_theta}")
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not (math.isfinite(eps) and eps > 0):
            raise ConfigError(f"{source}: rms_norm_eps must be a positive number, got {eps}")
        if raw.get("use_sliding_window") and arch.sliding == "none":
            raise ConfigError(f"{source}: use_sliding_window with {name} is not supported yet")
        window, sliding = _sliding(arch, raw, layers, source)
        mlp_only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        dense_first = int(raw.get(arch.dense_first_key, 0) or 0) if arch.dense_first_key else 0
        moe_layers = tuple(
            i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0 and i >= dense_first
        )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        qkv_bias = bool(raw.get(arch.bias_key, arch.bias_default))
        width = size(arch.expert_width_key)
        shared = int(raw.get("shared_expert_intermediate_size", 0) or 0) if arch.shared_expert else 0
        if arch.shared_experts_key:
            shared = int(raw.get(arch.shared_experts_key, 0) or 0) * width
        head_dim = int(raw.get("head_dim") or hidden // heads)
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
        rotary = int(head_dim * float(partial or 1.0))           # as transformers rounds it
        if partial is None and raw.get("rotary_dim"):          # MiniMax-M2's published configs say it this way
            rotary = int(raw["rotary_dim"])
        qk_norm = arch.qk_norm if arch.qk_norm_key is None or raw.get(arch.qk_norm_key) else "none"
        scaling = float(raw.get("routed_scaling_factor", 1.0) or 1.0)
        grouped = arch.groups_when is None or raw.get(arch.groups_when[0]) == arch.groups_when[1]
        renorm = arch.renormalize if arch.renormalize is not None else bool(
            raw.get("norm_topk_prob", arch.norm_topk_default))
        mla = None
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if arch.attention == "mla":
            if qkv_bias:
                raise ConfigError(f"{source}: attention_bias with latent attention is not supported yet")
            mla = MlaDims(q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                          qk_nope_head_dim=int(need("qk_nope_head_dim")),
                          qk_rope_head_dim=int(need("qk_rope_head_dim")), v_head_dim=int(need("v_head_dim")),
                          rope_interleave=bool(raw.get("rope_interleave", True)))
            head_dim, rotary, kv_heads = mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.qk_rope_head_dim, heads
        return ModelConfig(
            architecture=name,
            arch=arch,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and arch.o_proj_bias,
            clip_qkv=None if raw.get("clip_qkv") is None else float(raw["clip_qkv"]),
            rope_theta=rope_theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_experts=size(*arch.experts_key),
            top_k=size(arch.topk_key),
            moe_intermediate_size=width,
            norm_topk_prob=renorm,
            dense_intermediate_size=int(raw.get("intermediate_size", 0) or 0),
            shared_expert_intermediate_size=shared,
            moe_layers=moe_layers,
            qk_norm=qk_norm,
            rotary_dim=rotary,
            scoring=arch.scoring,
            num_groups=int(raw.get("n_group", 1) or 1) if grouped else 1,
            topk_groups=int(raw.get("topk_group", 1) or 1) if grouped else 1,
            routed_scaling=scaling,
            rope_scaling=rope_scaling,
            mla=mla,
            sliding_window=window,
            sliding_layers=sliding,
            swiglu_alpha=float(raw["swiglu_alpha"]) if arch.clamped_swiglu else 1.0,
            swiglu_limit=float(raw["swiglu_limit"]) if arch.clamped_swiglu else None,
            swiglu_up_offset=1.0 if arch.clamped_swiglu else 0.0,
            eos_token_ids=eos_ids,
            torch_dtype=_stored_dtype(raw, source),
            nextn_layers=_nextn_layers(raw, layers, source),
        )


def _nextn_layers(raw: dict, layers: int, source: str) -> int:
    """The multi-token prediction layers stored past num_hidden_layers (DeepSeek-V3's and GLM-4.5's
    num_nextn_predict_layers, transformers' num_mtp_layers), which are not served: a whole number in 0..layers."""
    key = "num_mtp_layers" if raw.get("num_mtp_layers") is not None else "num_nextn_predict_layers"
    value = raw.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or not 0 <= value <= layers:
        raise ConfigError(f"{source}: {key} must be a whole number from 0 to num_hidden_layers ({layers}), got "
                          f"{value!r}")
    return int(value)


# the safetensors dtype codes of floating weights (those safetensors_header reads), by the saved names above
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn"}


def stored_names(model_dir: Path) -> set[str]:
    """The tensors the checkpoint stores: those its index names, else those of every *.safetensors header; an
    unreadable index or header is passed over (the checkpoint's own checks name it later)."""
    index = model_dir / "model.safetensors.index.json"
    names: set[str] = set()
    try:
        if index.is_file():
            return set(read_index(index))
        for f in sorted(model_dir.glob("*.safetensors")):
            try:
                names |= set(read_header(f))
            except CheckpointError:
                continue
    except (CheckpointError, OSError):
        pass
    return names


def weights_dtype(model_dir: Path) -> str | None:
    """The floating dtype most of the checkpoint's weight bytes are saved in, for a config.json that names none
    (transformers 5 then loads the weights in their own dtype: that of its first floating tensor, the same for a
    checkpoint of one dtype). The files the checkpoint is read from: those its index names, else every
    *.safetensors; one whose header cannot be read is passed over (the checkpoint's own checks name it later).
    None where no file says."""
    index = model_dir / "model.safetensors.index.json"
    try:
        files = sorted({model_dir / name for name in read_index(index).values()}) if index.is_file() else \
            sorted(model_dir.glob("*.safetensors"))
    except (CheckpointError, OSError):
        return None
    totals: dict[str, int] = {}
    for f in files:
        try:
            entries = read_header(f).values()
        except (CheckpointError, OSError):
            continue
        for entry in entries:
            if (name := SAFETENSORS_FLOATS.get(entry.dtype)) is not None:
                totals[name] = totals.get(name, 0) + entry.nbytes
    return max(totals, key=lambda name: totals[name]) if totals else None


def _stored_dtype(raw: dict, source: str) -> str:
    """The checkpoint's dtype by its saved name; a name that is no dtype of saved weights is refused here rather
    than served as some other dtype by --dtype auto. float32 where config.json names none, as transformers 4 took
    it (`from_dir` takes the weights' own then, as transformers 5)."""
    key = "dtype" if raw.get("dtype") else "torch_dtype"
    name = raw.get(key) or "float32"
    if not isinstance(name, str) or name not in STORED_DTYPES:
        raise ConfigError(f"{source}: {key} {name!r} is not a dtype a checkpoint's weights are saved in; "
                          f"use one of {', '.join(sorted(set(STORED_DTYPES.values())))}")
    return STORED_DTYPES[name]


def _sliding(arch: ArchSpec, raw: dict, layers: int, source: str) -> tuple[int, tuple[int, ...]]:
    """(window, sliding layers) as transformers reads them: every layer when a Mixtral config sets
    sliding_window; for GPT-OSS config.layer_types (by default even layers slide, odd ones are full)."""
    window = int(raw.get("sliding_window") or 0)
    if arch.sliding == "all":
        return window, tuple(range(layers)) if window else ()
    if arch.sliding != "layer_types":
        return 0, ()
    kinds = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(SLIDING_KINDS):
        raise ConfigError(f"{source}: layer_types must list {layers} kinds, each one of {', '.join(SLIDING_KINDS)}; "
                          f"got {kinds}")
    return window, tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")


def read_json(path: Path) -> object:
    """A checkpoint's JSON file (UTF-8, as JSON is), or a ConfigError that says what is wrong with it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc}); save it as UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{path}: its JSON nests too deeply to read; is it a Hugging Face file?") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def _generation_eos(path: Path) -> set[int]:
    """generation_config.json's eos_token_id (an int or a list), which transformers' generate() stops on too."""
    if not path.is_file():
        return set()
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos}")
    return set(ids)
