"""KV-cache block bookkeeping: plain Python, no torch.

A block may be in several tables (the n choices of one request share their prompt's full blocks): each block
counts its tables, and returns to the free list when the last one releases it.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks                                  # tables holding each block

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it holds `num_tokens`; all or nothing."""
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} KV blocks, {len(self._free)} free")
        for _ in range(need):
            block = self._free.pop()
            self._refs[block] = 1
            table.append(block)

    def share(self, blocks: list[int]) -> list[int]:
        """A new table holding these (already held, full) blocks too."""
        for block in blocks:
            assert self._refs[block] > 0, f"block {block} is not held"
            self._refs[block] += 1
        return list(blocks)

    def release(self, table: list[int]) -> None:
        for block in reversed(table):
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"block {block} released twice"
            if self._refs[block] == 0:
                self._free.append(block)
        table.clear()
