"""Greedy, temperature, top-k and top-p sampling with a per-request seeded generator.

Shapes: B rows (sequences that sample this step), V vocabulary.
"""

from __future__ import annotations

import torch

from router_service.sequence import Sampling


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[tuple[str, Sampling]]) -> list[int]:
        """logits [B, V] float32 -> one token id per row."""
        greedy = logits.argmax(dim=-1).tolist()                               # [B]
        out = []
        for row, (rid, sp) in enumerate(requests):
            if sp.temperature < Sampling.GREEDY_BELOW:
                out.append(greedy[row])
                continue
            gen = self._generators.get(rid)
            if gen is None:
                gen = torch.Generator()
                if sp.seed is not None:
                    gen.manual_seed(sp.seed)
                else:
                    gen.seed()                     # from OS entropy; torch's global generator stays as it was
                self._generators[rid] = gen
            out.append(self._sample_row(logits[row].cpu(), sp, gen))        # the generator is a CPU one
        return out

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
