"""The bench checkpoint: Qwen3-MoE shape, hidden 1024, 8 layers, 64 experts top-8, width 512, 16 heads x 64,
4 KV heads, vocab 32000 (892M parameters), random weights in bfloat16. Built once, cached."""

from __future__ import annotations

from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench-model"


def bench_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
                          moe_intermediate_size=512, intermediate_size=2048, norm_topk_prob=True,
                          max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None)


def ensure_bench_model(path: Path = BENCH_DIR) -> Path:
    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return path
    from transformers import AutoModelForCausalLM

    print(f"building the bench checkpoint in {path} (once)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(bench_config(), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(ensure_bench_model())
