"""The expert-cache bench checkpoint: random weights whose routing is skewed the way real routing is.

Random gates route uniformly, so every expert is hot and no cache can help; real MoE routing is skewed
(a topic, a language, a code base each favour a subset of experts). Here the vocabulary is split into
`TOPICS` ranges, and topic t owns a direction d_t of the hidden space (orthonormal). Its tokens' embeddings
carry a large component along d_t, every MoE gate favours experts e ≡ t (mod TOPICS) along d_t, and the
lm_head favours topic t's tokens along d_t, so a prompt of topic t keeps routing to (and generating
within) its topic's experts. The experts themselves, attention and the rest stay random.

Shape: Qwen3-MoE, hidden 1024, 8 layers, 32 experts top-4, width 1024, 16 heads x 64, 4 KV heads, vocab
8192; 1.7B parameters, 1.5 GiB of experts in bfloat16. Built once, cached in .cache/.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from colibri_common import page_cache

SKEWED_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench-skewed-model"
TOPICS = 4


def skewed_config(hidden: int = 1024, layers: int = 8, experts: int = 32, width: int = 1024, vocab: int = 8192):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=64, num_experts=experts, num_experts_per_tok=4,
                          moe_intermediate_size=width, intermediate_size=2 * width, norm_topk_prob=True,
                          max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None,
                          bos_token_id=None, pad_token_id=None)


@torch.no_grad()
def skew(model, seed: int = 0, embed: float = 4.0, gate: float = 1.0, head: float = 1.0) -> None:
    """Give `model` (a transformers Qwen3-MoE) the topic structure described above, in place."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    H, V, E = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    d = torch.linalg.qr(torch.randn(H, TOPICS, generator=g))[0].T                # [TOPICS, H] orthonormal
    topic = torch.arange(V) * TOPICS // V                                         # [V]
    emb = model.model.embed_tokens.weight
    emb.copy_((emb.float() + embed * d[topic]).to(emb.dtype))          # [V, H]
    lm_head = model.lm_head.weight
    lm_head.copy_((lm_head.float() + head * d[topic]).to(lm_head.dtype))  # [V, H]
    expert_topic = torch.arange(E) % TOPICS                                       # [E]
    for layer in model.model.layers:
        w = layer.mlp.gate.weight                                                 # [E, H]
        w.copy_((w.float() + gate * d[expert_topic]).to(w.dtype))


def topic_prompts(n: int, length: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts, each of one topic (topics shuffled): (prompts, their topics)."""
    rnd = random.Random(seed)
    topics = [i % TOPICS for i in range(n)]
    rnd.shuffle(topics)
    size = vocab // TOPICS
    return [[t * size + rnd.randrange(size) for _ in range(length)] for t in topics], topics


def ensure_skewed_model(path: Path = SKEWED_DIR, **shape) -> Path:
    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return path
    from transformers import AutoModelForCausalLM

    print(f"building the skewed expert-cache bench checkpoint in {path} (once)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(skewed_config(**shape), dtype=torch.bfloat16)
    skew(model)
    model.save_pretrained(path)
    page_cache.drop_checkpoint(path)        # the next reader fills the page cache in 2 MiB pages
    return path


if __name__ == "__main__":
    print(ensure_skewed_model())
