"""The bench checkpoints, random weights in bfloat16, built once and cached under .cache/:

- `bench` (the default): Qwen3-MoE shape, hidden 1024, 8 layers, 64 experts top-8, width 512, 16 heads x 64,
  4 KV heads, vocab 32000 (892M parameters; a one-stream decode step reads ≈310 MB);
- `small`: hidden 768, 8 layers, 32 experts top-4, width 384, 12 heads x 64, 4 KV heads, vocab 32000 (≈0.29B
  parameters; ≈125 MB a one-stream step), where the fixed per-layer costs weigh more.

    python -m benchmarks.bench_model [--size bench|small]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from colibri_common import page_cache

CACHE = Path(__file__).resolve().parent.parent / ".cache"
BENCH_DIR = CACHE / "bench-model"
SIZES = {
    "bench": dict(hidden_size=1024, num_attention_heads=16, num_experts=64, num_experts_per_tok=8,
                  moe_intermediate_size=512, intermediate_size=2048),
    "small": dict(hidden_size=768, num_attention_heads=12, num_experts=32, num_experts_per_tok=4,
                  moe_intermediate_size=384, intermediate_size=1536),
}


def bench_dir(size: str = "bench") -> Path:
    return BENCH_DIR if size == "bench" else CACHE / f"bench-model-{size}"


def bench_config(size: str = "bench"):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=32000, num_hidden_layers=8, num_key_value_heads=4, head_dim=64,
                          norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
                          eos_token_id=None, bos_token_id=None, pad_token_id=None, **SIZES[size])


def ensure_bench_model(path: Path | None = None, size: str = "bench") -> Path:
    path = path or bench_dir(size)
    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return path
    from transformers import AutoModelForCausalLM

    print(f"building the {size} bench checkpoint in {path} (once)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(bench_config(size), dtype=torch.bfloat16)
    model.save_pretrained(path)
    page_cache.drop_checkpoint(path)        # the next reader fills the page cache in 2 MiB pages
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="bench")
    print(ensure_bench_model(size=ap.parse_args().size))
