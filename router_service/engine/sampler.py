"""Batched sampling on one step's logits: penalties, min_tokens, greedy / temperature / top-k / top-p / min-p,
per-request seeds, log-probabilities.

Every stage is one tensor operation over the rows that use it (a row's knobs are gathered into [b] vectors);
Python runs per row only to gather those vectors and to draw a seeded row's noise from its own generator.
A token is drawn as argmax(p / q) with q ~ Exp(1) i.i.d. (the exponential race, the same law as sampling from
p), so unseeded rows share one batched noise draw and a seeded row reproduces whatever batch it is in (its noise
is indexed by token id on every path). Knob tensors are built on the logits' device; the noise comes from CPU
generators and is copied there.

A row whose logits are not finite, or whose sampling raises, gets a `SampleError` instead of a token: that
sequence alone fails, the others in the batch go on.

Shapes: B rows (sequences that sample this step), b a subset of them, V vocabulary, N top log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

import numpy as np
import torch

from router_service.engine.sequence import Sampled, Sampling


class SampleError(Exception):
    """Why one row could not be sampled (the engine fails that sequence with INTERNAL)."""


class SampleRow(Protocol):
    """What sampling reads of a sequence (`router_service.engine.sequence.Sequence` is one)."""

    uid: int | str
    sampling: Sampling
    prompt_ids: list[int]
    output_ids: list[int]


def _on_host(x: torch.Tensor) -> np.ndarray | None:
    """x [B, V] as a numpy view where it is a float32 CPU tensor, else None. numpy reduces a step's few rows on the
    calling thread; torch's sum or argmax over [1, 32000] starts an OpenMP region, whose sleeping threads (the
    native kernels have their own pool) took ~0.1 ms to wake, twice a step. Sampling a one-stream step of the small
    bench model in process (5.6 ms a step) took 135-140 µs that way and ~100 µs this way (25 µs in a warm loop: in
    the engine the sum reads logits the kernel pool's other thread has just written). Both take the first of equal
    maxima."""
    return x.detach().numpy() if x.device.type == "cpu" and x.dtype == torch.float32 else None


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos = eos_token_ids
        self._generators: dict[int | str, torch.Generator] = {}     # seeded requests', by uid
        self._prompt_seen: dict[int | str, torch.Tensor] = {}       # repetition penalty: prompt tokens [V], by uid
        self._unseeded = torch.Generator()                          # one for every unseeded row, from OS entropy
        self._unseeded.seed()

    def forget(self, uid: int | str) -> None:
        self._generators.pop(uid, None)
        self._prompt_seen.pop(uid, None)

    def sample(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> list[Sampled | SampleError]:
        """logits [B, V] float32 -> one `Sampled` (or the row's error) per row, in order."""
        out: list[Sampled | SampleError] = [SampleError("the model produced non-finite logits (inf/NaN) for "
                                                        "this request")] * len(rows)
        finite = self._finite_rows(logits)                                    # [B]
        ok = [r for r, f in enumerate(finite) if f]
        if not ok:
            return out
        try:
            x = raw = logits if len(ok) == len(rows) else logits[ok]            # [b, V]
            live = [rows[r] for r in ok]
            x = self._penalise(x, live)
            x = self._mask_stops(x, live)
            host = _on_host(x)
            tokens = (torch.from_numpy(host.argmax(axis=-1)) if host is not None    # [b] greedy rows keep these
                      else x.argmax(dim=-1))
            drawn = [i for i, row in enumerate(live) if not row.sampling.greedy]
            if drawn:
                tokens[drawn] = self._draw(x[drawn], [live[i] for i in drawn])
            logprobs = self._logprobs(raw, tokens, live)
        except RuntimeError as exc:         # something in one row broke a kernel: find it, fail it alone
            if len(rows) == 1:
                return [SampleError(f"sampling failed: {exc}")]
            return [self.sample(logits[r:r + 1], [rows[r]])[0] for r in range(len(rows))]
        for i, (r, tok) in enumerate(zip(ok, tokens.tolist(), strict=True)):
            lp = logprobs.get(i)
            out[r] = Sampled(tok) if lp is None else Sampled(tok, lp[0], lp[1])
        return out

    @staticmethod
    def _finite_rows(logits: torch.Tensor) -> list[bool]:
        """Which rows of logits [B, V] hold no inf or NaN. A row's sum is finite only if every element is (an inf
        or NaN makes it inf or NaN): one reduction, where isfinite + all is five ops over [B, V]; a non-finite sum
        (from an element, or large finite ones overflowing) is settled by the exact check."""
        host = _on_host(logits)
        if host is not None:
            with np.errstate(over="ignore", invalid="ignore"):                 # an overflow is what it checks
                finite = np.isfinite(host.sum(axis=-1)).tolist()                 # [B]
        else:
            finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        if not all(finite):
            finite = torch.isfinite(logits).all(dim=-1).tolist()
        return finite

    def tokens(self, logits: torch.Tensor, rows: Seq[SampleRow]) -> list[int | SampleError]:
        """`sample` without the log-probabilities: a token id or the row's error per row."""
        return [s if isinstance(s, SampleError) else s.token for s in self.sample(logits, rows)]

    # -- stages -------------------------------------------------------------------------------------
    def _prompt_mask(self, row: SampleRow, V: int, dev: torch.device) -> torch.Tensor:
        """The prompt's tokens as a [V] mask, built once per request (not per step: prompts are long)."""
        mask = self._prompt_seen.get(row.uid)
        if mask is None:
            mask = torch.zeros(V, dtype=torch.bool, device=dev)
            mask[torch.tensor(row.prompt_ids, dtype=torch.long, device=dev)] = True
            self._prompt_seen[row.uid] = mask
        return mask

    def _penalise(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Repetition (prompt + output tokens, as transformers), frequency and presence (output tokens, as
        OpenAI) penalties on the rows that set them; x [b, V] is copied before it is changed."""
        idx = [i for i, row in enumerate(rows) if row.sampling.penalised]
        if not idx:
            return x
        V, dev = x.shape[1], x.device
        sps = [rows[i].sampling for i in idx]
        longest = max(1, *(len(rows[i].output_ids) for i in idx))
        out_ids = torch.tensor([rows[i].output_ids + [V] * (longest - len(rows[i].output_ids)) for i in idx],
                               device=dev)                                                             # [p, n]
        counts = torch.zeros(len(idx), V + 1, device=dev).scatter_add_(
            1, out_ids, torch.ones(out_ids.shape, device=dev))[:, :V]                                  # [p, V]
        sub = x[idx].float()                                                                           # [p, V]
        if any(sp.repetition_penalty != 1 for sp in sps):
            prompt = torch.stack([self._prompt_mask(rows[i], V, dev) for i in idx])                   # [p, V]
            seen = prompt | (counts > 0)                                                               # [p, V]
            pen = torch.tensor([sp.repetition_penalty for sp in sps], device=dev)[:, None]         # [p, 1]
            sub = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
        freq = torch.tensor([sp.frequency_penalty for sp in sps], device=dev)[:, None]              # [p, 1]
        pres = torch.tensor([sp.presence_penalty for sp in sps], device=dev)[:, None]               # [p, 1]
        sub = sub - freq * counts - pres * (counts > 0)
        x = x.clone()
        x[idx] = sub.to(x.dtype)
        return x

    def _mask_stops(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Rows with fewer than `min_tokens` outputs cannot sample EOS (unless ignore_eos) or a stop token."""
        cells_r: list[int] = []
        cells_t: list[int] = []
        V = x.shape[1]
        for i, row in enumerate(rows):
            sp = row.sampling
            if len(row.output_ids) < sp.min_tokens:
                stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos)
                ids = [t for t in stops if 0 <= t < V]
                cells_r.extend([i] * len(ids))
                cells_t.extend(ids)
        if not cells_r:
            return x
        x = x.clone()
        x[torch.tensor(cells_r, device=x.device), torch.tensor(cells_t, device=x.device)] = float("-inf")
        return x

    def _draw(self, x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Sample one token per row of x [b, V] (every row has temperature > 0) -> [b]."""
        b, V = x.shape
        dev = x.device
        sps = [row.sampling for row in rows]
        temps = torch.tensor([sp.temperature for sp in sps], device=dev)[:, None]                   # [b, 1]
        scores = x.float() / temps                                                                   # [b, V]
        noise = self._noise(b, V, rows).to(dev)                                                      # [b, V]
        if all(sp.top_k <= 0 and sp.top_p >= 1.0 and sp.min_p <= 0 for sp in sps):
            probs = torch.softmax(scores, dim=-1)
            return (probs / noise).argmax(dim=-1)
        scores, order = scores.sort(dim=-1, descending=True)                                       # [b, V]
        rank = torch.arange(V, device=dev)[None, :]                                                  # [1, V]
        k = torch.tensor([sp.top_k if sp.top_k > 0 else V for sp in sps], device=dev)[:, None]      # [b, 1]
        probs = torch.softmax(scores.masked_fill(rank >= k, float("-inf")), dim=-1)                # top-k, renormed
        top_p = torch.tensor([sp.top_p if 0 < sp.top_p < 1 else 2.0 for sp in sps], device=dev)[:, None]
        cut = (probs.cumsum(dim=-1) - probs) >= top_p               # keeps the smallest prefix reaching top_p
        min_p = torch.tensor([sp.min_p for sp in sps], device=dev)[:, None]                         # [b, 1]
        cut |= probs < min_p * probs[:, :1]                         # probs[:, 0] is each row's likeliest token
        probs = probs.masked_fill(cut, 0.0)
        choice = (probs / noise.gather(1, order)).argmax(dim=-1, keepdim=True)   # each token id keeps its noise
        return order.gather(1, choice).squeeze(1)

    def _noise(self, b: int, V: int, rows: list[SampleRow]) -> torch.Tensor:
        """Exp(1) noise [b, V]: a seeded row's from its own generator, the others' from one batched draw."""
        noise = torch.empty(b, V)
        unseeded = [i for i, row in enumerate(rows) if row.sampling.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V).exponential_(generator=self._unseeded)
        for i, row in enumerate(rows):
            seed = row.sampling.seed
            if seed is None:
                continue
            gen = self._generators.get(row.uid)
            if gen is None:
                gen = self._generators[row.uid] = torch.Generator().manual_seed(seed)
            noise[i].exponential_(generator=gen)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    @staticmethod
    def _logprobs(x: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]
                  ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """For the rows that ask: the log-softmax of the model's own logits x, before penalties, the stop tokens'
        mask and the temperature (vLLM's default, `--logprobs-mode raw_logprobs`: the same request's values
        whatever its sampling asks), the sampled token's value and the N likeliest; one batched pass."""
        idx = [i for i, row in enumerate(rows) if row.sampling.wants_logprobs]
        if not idx:
            return {}
        lp = torch.log_softmax(x[idx].float(), dim=-1).cpu()                                       # [l, V]
        chosen = lp.gather(1, tokens[idx].cpu()[:, None]).squeeze(1).tolist()                       # [l]
        n = max(rows[i].sampling.top_logprobs for i in idx)
        top_v, top_i = lp.topk(min(n, lp.shape[1]), dim=-1) if n else (lp[:, :0], lp[:, :0].long())  # [l, N]
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = {}
        for j, i in enumerate(idx):
            m = rows[i].sampling.top_logprobs
            out[i] = (chosen[j], tuple(zip(top_i[j][:m], top_v[j][:m], strict=True)))
        return out
