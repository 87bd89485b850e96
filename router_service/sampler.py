"""Greedy, temperature, top-k and top-p sampling with a per-request seeded generator.

A row whose logits are not finite, or whose sampling raises, gets a `SampleError` instead of a token: that
sequence alone fails, the others in the batch go on.

Shapes: B rows (sequences that sample this step), V vocabulary.
"""

from __future__ import annotations

import torch

from router_service.sequence import Sampling


class SampleError(Exception):
    """Why one row could not be sampled (the engine fails that sequence with INTERNAL)."""


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}     # by Sequence.uid

    def forget(self, uid: int) -> None:
        self._generators.pop(uid, None)

    def sample(self, logits: torch.Tensor, requests: list[tuple[int, Sampling]]) -> list[int | SampleError]:
        """logits [B, V] float32 -> one token id (or the row's error) per row."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()                  # [B]
        greedy = logits.argmax(dim=-1).tolist()                               # [B]
        out: list[int | SampleError] = []
        for row, (uid, sp) in enumerate(requests):
            if not finite[row]:
                out.append(SampleError("the model produced non-finite logits (inf/NaN) for this request"))
            elif sp.temperature < Sampling.GREEDY_BELOW:
                out.append(greedy[row])
            else:
                try:
                    out.append(self._sample_row(logits[row].cpu(), sp, self._generator(uid, sp)))
                except RuntimeError as exc:
                    out.append(SampleError(f"sampling failed: {exc}"))
        return out

    def _generator(self, uid: int, sp: Sampling) -> torch.Generator:
        gen = self._generators.get(uid)
        if gen is None:
            gen = torch.Generator()                # a CPU generator: sampling reads one row on the host
            if sp.seed is not None:
                gen.manual_seed(sp.seed)
            else:
                gen.seed()                         # from OS entropy; torch's global generator stays as it was
            self._generators[uid] = gen
        return gen

    @staticmethod
    def _sample_row(logits: torch.Tensor, sp: Sampling, gen: torch.Generator) -> int:
        scores = logits / sp.temperature                                      # [V]
        if sp.top_k > 0:
            kth = torch.topk(scores, min(sp.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if 0.0 < sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < sp.top_p                   # always keeps the top token
            probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=gen))
