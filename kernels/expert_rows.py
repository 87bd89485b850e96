"""A layer's experts computed where they lie: each expert's matrix as row blocks over the mapped checkpoint.

Where a checkpoint stores each expert's gate, up and down in the compute dtype (bf16 or float32, row-major
`[I, H]` / `[H, I]`, or a stacked `[E, 2I, H]` fused gate/up), the native expert FFN reads those bytes in place:
no packed copy, the page cache shared by every worker on the host and by a restarted one, start-up without a
pass over the weights, resident memory the pages the calls touch. `ExpertRows` holds the views; it has the
`shape` and `dtype` of the packed stack it replaces, so `kernels.fused_moe` takes either.

Shapes: E experts of the layer held here, D output rows of the matrix (2I for gate/up, H for down), K its input
width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ExpertRows:
    """`blocks[e]`: expert e's matrix [D, K] as one or more contiguous row blocks (gate rows then up rows for
    gate/up; their rows stacked are the matrix)."""

    blocks: tuple[tuple[torch.Tensor, ...], ...]

    def __post_init__(self) -> None:
        if not self.blocks or not all(self.blocks):
            raise ValueError("ExpertRows needs at least one expert, each with at least one row block")
        first = self.blocks[0][0]
        if first.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"experts computed in place are float32 or bfloat16, got {first.dtype}")
        K = first.shape[-1]
        rows = None
        for e, parts in enumerate(self.blocks):
            for b in parts:
                if b.dim() != 2 or b.shape[1] != K or b.dtype != first.dtype or not b.is_contiguous() \
                        or b.device.type != "cpu":
                    raise ValueError(f"expert {e}: every row block must be a contiguous CPU {first.dtype} [rows, "
                                     f"{K}], got {b.dtype} {list(b.shape)}")
            if len(parts) != len(self.blocks[0]):
                raise ValueError(f"expert {e} has {len(parts)} row blocks, expert 0 has {len(self.blocks[0])}: one "
                                 f"layout per layer")
            n = sum(b.shape[0] for b in parts)
            if rows is not None and n != rows:
                raise ValueError(f"expert {e} has {n} rows, expert 0 has {rows}: one matrix shape per layer")
            rows = n

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, D, K), as the packed stack's."""
        return len(self.blocks), sum(b.shape[0] for b in self.blocks[0]), self.blocks[0][0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks[0][0].dtype

    @property
    def nbytes(self) -> int:
        """The bytes the views span (mapped, resident only where touched)."""
        return sum(b.nbytes for parts in self.blocks for b in parts)

    def dim(self) -> int:
        return 3

    @property
    def parts(self) -> int:
        """Row blocks per expert."""
        return len(self.blocks[0])

    @cached_property
    def flat(self) -> tuple[torch.Tensor, ...]:
        """Every expert's blocks in order, as the native kernel takes them (made once)."""
        return tuple(b for parts in self.blocks for b in parts)

    def __getitem__(self, index: slice) -> ExpertRows:
        """The experts `index` selects (a slice), as the packed stack's rows."""
        return ExpertRows(self.blocks[index])

    def stacked(self) -> torch.Tensor:
        """A packed copy [E, D, K] (the tests' reference; never on the serving path)."""
        return torch.stack([torch.cat(parts) for parts in self.blocks])
