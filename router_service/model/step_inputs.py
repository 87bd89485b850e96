"""The tensors one engine step needs, built once per step from the scheduled sequences.

Shapes: T tokens in the step, B sequences that sample, Bd decode sequences, Cmax the longest decode
context, C one prefill's context (cached + new), n its new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: `num_new` query tokens after `num_cached` cached ones."""

    num_cached: int
    num_new: int
    block_table: list[int]
    sample: bool            # the step ends at this sequence's last prompt token or decodes: sample it


@dataclass
class StepInputs:
    token_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T]
    slots: torch.Tensor              # [T] KV slot each new token writes
    num_decode: int                  # rows [0, num_decode) are decode tokens, one per sequence
    decode_slots: torch.Tensor       # [Bd, Cmax] KV slots each decode query reads (padded)
    decode_mask: torch.Tensor        # [Bd, 1, 1, Cmax] True where a slot is valid
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]  # (row, n, slots [ctx], mask | None)
    sample_rows: torch.Tensor        # [B] rows whose logits are sampled
    window: int = 0                  # sliding layers' window W (0: the model has none); their keys, Cw <= W:
    decode_window_slots: torch.Tensor | None = None    # [Bd, Cw] the last Cw positions' slots (padded)
    decode_window_mask: torch.Tensor | None = None     # [Bd, 1, 1, Cw] True where within the window
    prefill_windows: list[tuple[int, torch.Tensor]] = field(default_factory=list)   # per prefill: keys from lo,
                                                                                    # mask [n, ctx - lo]
    decode_lens: torch.Tensor | None = None          # [Bd] valid slots of each decode_slots row (a prefix)
    decode_window_lens: torch.Tensor | None = None   # [Bd] the same for decode_window_slots
    decode_table: torch.Tensor | None = None         # [Bd, NB] each decode sequence's blocks (0-padded), as the
                                                     # paged kernel reads them with decode_lens (a sliding layer:
                                                     # the last `window` of them)
    max_position: int = -1                           # the largest of `positions`, known on the host (-1: not)

    def to(self, device: torch.device) -> StepInputs:
        """These inputs on `device` (asynchronous copies on a GPU; the same object on the CPU)."""
        if device.type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return StepInputs(
            token_ids=move(self.token_ids), positions=move(self.positions), slots=move(self.slots),
            num_decode=self.num_decode, decode_slots=move(self.decode_slots), decode_mask=move(self.decode_mask),
            prefills=[(row, n, move(slots), move(mask)) for row, n, slots, mask in self.prefills],
            sample_rows=move(self.sample_rows), window=self.window,
            decode_window_slots=move(self.decode_window_slots), decode_window_mask=move(self.decode_window_mask),
            prefill_windows=[(lo, move(m)) for lo, m in self.prefill_windows], decode_lens=move(self.decode_lens),
            decode_window_lens=move(self.decode_window_lens), decode_table=move(self.decode_table),
            max_position=self.max_position)

    @staticmethod
    def build(seqs: list[SeqSlice], token_ids: list[int], block_size: int, window: int = 0) -> StepInputs:
        """`seqs` must list decode sequences (num_new == 1, num_cached > 0) first. With a `window`, the sliding
        layers' masks too: a query at position p sees keys p - window < j <= p (as transformers' overlay)."""
        positions: list[int] = []      # plain Python: a decode step adds one token per sequence
        slots: list[int] = []
        for s in seqs:
            for p in range(s.num_cached, s.num_cached + s.num_new):
                positions.append(p)
                slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        num_decode = 0
        while num_decode < len(seqs) and seqs[num_decode].num_new == 1 and seqs[num_decode].num_cached > 0:
            num_decode += 1
        decode = seqs[:num_decode]
        if decode:
            # numpy, not torch ops: this runs first in a step, on caches the last step's weights have flushed, where
            # each torch op costs ~100 µs (docs/performance.md, "That Python runs on caches ...")
            lens_np = np.array([s.num_cached + 1 for s in decode], dtype=np.int64)                # [Bd]
            cmax = int(lens_np.max())
            nblk = (cmax + block_size - 1) // block_size
            table_np = np.array([s.block_table[:nblk] + [0] * (nblk - len(s.block_table[:nblk])) for s in decode],
                                dtype=np.int64)                                                   # [Bd, NB]
            dslots_np = (table_np[:, :, None] * block_size + np.arange(block_size)).reshape(len(decode), -1)
            table, lens = torch.from_numpy(table_np), torch.from_numpy(lens_np)   # (views cut in numpy: no op)
            dslots = torch.from_numpy(dslots_np[:, :cmax])                                        # [Bd, Cmax]
            dmask = torch.from_numpy((np.arange(cmax)[None, :] < lens_np[:, None])[:, None, None, :])  # [Bd, 1, 1, C]
            if window:                       # query at position len - 1 sees positions len - W .. len - 1
                cw = min(window, cmax)
                pos = (lens - window).clamp(min=0)[:, None] + torch.arange(cw)[None, :]         # [Bd, Cw]
                wmask = (pos < lens[:, None])[:, None, None, :]                                # [Bd, 1, 1, Cw]
                wslots = dslots.gather(1, pos.clamp(max=cmax - 1))                             # [Bd, Cw]
                wlens = lens.clamp(max=cw)                                                     # [Bd]
        else:
            table = torch.zeros(0, 0, dtype=torch.long)
            dslots = torch.zeros(0, 0, dtype=torch.long)
            dmask = torch.zeros(0, 1, 1, 0, dtype=torch.bool)
            lens = torch.zeros(0, dtype=torch.long)
        if not (decode and window):
            wslots, wmask, wlens = dslots, dmask, lens
        prefills, windows = [], []
        row = num_decode
        for s in seqs[num_decode:]:
            ctx = s.num_cached + s.num_new
            pos = torch.arange(ctx)                                                           # [ctx]
            ctx_slots = torch.tensor(s.block_table)[pos // block_size] * block_size + pos % block_size
            mask = None
            if s.num_cached:  # query i (position num_cached + i) sees keys 0..num_cached + i
                q_pos = torch.arange(s.num_cached, ctx)[:, None]
                mask = torch.arange(ctx)[None, :] <= q_pos                                    # [n, ctx]
            prefills.append((row, s.num_new, ctx_slots, mask))
            if window:                       # query at position p sees keys p - W < j <= p
                lo = max(0, s.num_cached - window + 1)
                q_pos = torch.arange(s.num_cached, ctx)[:, None]
                keys = torch.arange(lo, ctx)[None, :]
                windows.append((lo, (keys <= q_pos) & (keys > q_pos - window)))              # [n, ctx - lo]
            row += s.num_new
        sample_rows, row = [], 0
        for s in seqs:
            row += s.num_new
            if s.sample:
                sample_rows.append(row - 1)
        rows = np.array([token_ids, positions, slots], dtype=np.int64)                           # [3, T]
        return StepInputs(
            token_ids=torch.from_numpy(rows[0]), positions=torch.from_numpy(rows[1]), slots=torch.from_numpy(rows[2]),
            num_decode=num_decode, decode_slots=dslots, decode_mask=dmask,
            prefills=prefills, sample_rows=torch.from_numpy(np.array(sample_rows, dtype=np.int64)),
            window=window, decode_window_slots=wslots if window else None,
            decode_window_mask=wmask if window else None, prefill_windows=windows,
            decode_lens=lens, decode_window_lens=wlens if window else None, decode_table=table,
            max_position=max(positions, default=-1),
        )
