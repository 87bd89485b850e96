"""KV-cache block bookkeeping: plain Python, no torch."""

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
        table.extend(self._free.pop() for _ in range(need))

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()
