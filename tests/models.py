"""Random-weight checkpoints built with transformers (the oracle), for the tests and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MiniMaxM2Config,
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

COMMON = dict(vocab_size=256, hidden_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)


def small_config(arch: str, **overrides) -> PretrainedConfig:
    """Small configs with a non-power-of-two somewhere: hidden 96, expert width 40, and 60 experts for
    Qwen3-MoE, 16 for GLM-4.5 (top-3 in 2 of 4 groups), 8 for the others (top-3 for MiniMax-M2)."""
    if arch == "mixtral":
        kw = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=40)
        cfg = MixtralConfig(**{**COMMON, **kw, **overrides})
    elif arch == "qwen2_moe":
        kw = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, intermediate_size=64,
                  shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                  decoder_sparse_step=1, qkv_bias=True, num_hidden_layers=3)
        cfg = Qwen2MoeConfig(**{**COMMON, **kw, **overrides})
    elif arch == "qwen3_moe":
        kw = dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=40, norm_topk_prob=True,
                  head_dim=32)
        cfg = Qwen3MoeConfig(**{**COMMON, **kw, **overrides})
    elif arch == "glm4_moe":   # every feature on: 4 groups (top 2), bias, dense first layer, partial rotary
        kw = dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=40, intermediate_size=64,
                  n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True, use_qk_norm=True, attention_bias=True, head_dim=32, num_hidden_layers=3)
        cfg = Glm4MoeConfig(**{**COMMON, **kw, **overrides})
    elif arch == "minimax_m2":   # sigmoid + correction bias, full-width qk-norm, rotary on 16 of 32 dims
        kw = dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=40, head_dim=32, rotary_dim=16)
        cfg = MiniMaxM2Config(**{**COMMON, **kw, **overrides})
    elif arch in ("deepseek_v2", "deepseek_v3"):   # latent attention, dense first layer, shared expert, groups
        kw = dict(n_routed_experts=12, num_experts_per_tok=3, moe_intermediate_size=40, intermediate_size=64,
                  n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=24, n_group=4, topk_group=2, num_hidden_layers=3,
                  num_key_value_heads=4)
        if arch == "deepseek_v2":
            kw |= dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=2.0)
            cfg = DeepseekV2Config(**{**COMMON, **kw, **overrides})
        else:
            kw |= dict(q_lora_rank=48, routed_scaling_factor=2.5, norm_topk_prob=True)
            cfg = DeepseekV3Config(**{**COMMON, **kw, **overrides})
    elif arch == "gpt_oss":   # sinks, sliding (window 4) and full layers, YaRN, biases, a clamp low enough to bite
        kw = dict(num_local_experts=8, num_experts_per_tok=3, intermediate_size=40, head_dim=32, sliding_window=4,
                  swiglu_limit=2.0, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 1.5e5})
        cfg = GptOssConfig(**{**COMMON, **kw, **overrides})
    elif arch == "olmoe":
        kw = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=40, norm_topk_prob=False)
        cfg = OlmoeConfig(**{**COMMON, **kw, **overrides})
    else:
        raise ValueError(arch)
    return cfg


def build_model(cfg: PretrainedConfig, seed: int = 0, std: float = 0.2, dtype: torch.dtype = torch.float32):
    """Weights scaled up (std ≈ 0.2) so routing and greedy choices are far from ties."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):                     # large enough to take a real share of attention
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):    # non-zero, so choosing and weighting differ
                b.copy_(0.3 * torch.randn_like(b))
    return model


def save_checkpoint(model, path: Path, max_shard_size: str | None = None) -> Path:
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return path


def memorize(model, steps: int = 50, seed: int = 0) -> torch.Tensor:
    """Train `model` briefly to memorise 8 arithmetic sequences (mod 256): afterwards its greedy choices on
    them are well separated (top-2 gaps ≈60% of the largest logit), a checkpoint on which a lossy path
    (int8) must give exactly the oracle's tokens. Returns the sequences [8, 24]."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 256, (8, 1), generator=g)
    strides = torch.randint(1, 9, (8, 1), generator=g)
    data = (starts + strides * torch.arange(24)) % 256                             # [8, 24]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return data


class Oracle:
    """A transformers model and its saved checkpoint; its outputs are cached for the whole session."""

    def __init__(self, model, path: Path) -> None:
        self.model, self.path = model, path
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._greedy:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            self._greedy[key] = out[0, len(prompt):].tolist()
        return self._greedy[key]

    @torch.no_grad()
    def greedy_many(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """`greedy` of each prompt, those of one length in one batched `generate` (no padding: 16 streams of
        120 tokens in 1 s instead of 10; the same tokens as one by one)."""
        todo: dict[int, list[list[int]]] = {}
        for p in prompts:
            if (tuple(p), n) not in self._greedy:
                todo.setdefault(len(p), []).append(list(p))
        for length, group in todo.items():
            out = self.model.generate(torch.tensor(group), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            for p, row in zip(group, out, strict=True):
                self._greedy[(tuple(p), n)] = row[length:].tolist()
        return [self._greedy[(tuple(p), n)] for p in prompts]

    @torch.no_grad()
    def step_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n, V] at each of the n = len(tokens) steps of generating `tokens` after `prompt`."""
        seq = prompt + tokens[:-1]
        return self.model(torch.tensor([seq])).logits[0, len(prompt) - 1:].float()

    @torch.no_grad()
    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self._logits:
            self._logits[key] = self.model(torch.tensor([prompt])).logits[0, -1].float()
        return self._logits[key]


def bf16_errors(token: int, logits: torch.Tensor, want: torch.Tensor, hf: torch.Tensor) -> tuple[float, float]:
    """(err, hf_err): how far an engine's first-step `logits` and transformers' bf16 `hf` are from the exact `want`
    (the same bf16 weights computed in float32), each relative to want's largest logit. Checks the engine's first
    `token` is the exact model's wherever its top-2 margin is wider than twice err."""
    scale = float(want.abs().max())
    hf_err = float((hf - want).abs().max()) / scale
    err = float((logits - want).abs().max()) / scale
    top2 = want.topk(2).values
    if float(top2[0] - top2[1]) > 2 * err * scale:
        assert token == int(want.argmax()), (token, int(want.argmax()), err)
    return err, hf_err
