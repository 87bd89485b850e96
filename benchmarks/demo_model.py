"""The demo checkpoint: a tiny Qwen3-MoE trained for TRAIN_STEPS steps on patterns it can learn (alphabet, counting,
weekdays), with a character-level tokenizer. Built once and cached under .cache/demo-model."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from colibri_common import page_cache

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
CHARS = sorted(set(ALPHABET + "0123456789 :,.\n"))
SEQ_LEN = 96
TRAIN_STEPS = 400   # bounded by steps, not seconds: the same model (and demo output) on a slow machine


def make_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def sample_line(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randrange(26)
        return "letters: " + " ".join(ALPHABET[(start + i) % 26] for i in range(26))
    if kind == 1:
        start = rng.randrange(90)
        return "count: " + " ".join(str(start + i) for i in range(14))
    start = rng.randrange(7)
    return "days: " + ", ".join(DAYS[(start + i) % 7] for i in range(8))


def corpus_batch(tok: Tokenizer, rng: random.Random, batch: int) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < SEQ_LEN + 1:
            ids += tok.encode(sample_line(rng) + "\n").ids
        off = rng.randrange(0, 8)
        rows.append(ids[off:off + SEQ_LEN + 1] if len(ids) >= off + SEQ_LEN + 1 else ids[:SEQ_LEN + 1])
    return torch.tensor(rows)


def build_demo_model(out: Path, steps: int = TRAIN_STEPS) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    rng = random.Random(0)
    tok = make_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                         max_position_embeddings=512, eos_token_id=1, bos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    bar = tqdm(range(1, steps + 1), desc="training the demo MoE (cached after this run)", unit="step",
               mininterval=1.0, disable=None)      # a bar on a terminal, not into a log file
    for step in bar:
        batch = corpus_batch(tok, rng, 24)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    page_cache.drop_checkpoint(out)        # the next reader fills the page cache in 2 MiB pages
    tok.save(str(out / "tokenizer.json"))
    return out
