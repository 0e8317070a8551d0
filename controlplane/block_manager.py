"""Paged KV block manager: a free pool of fixed-size blocks and each sequence's block table.

The control plane owns every block decision; workers only mirror the tables it sends.
"""

from __future__ import annotations

import collections


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """New blocks a sequence needs so that its table covers ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_grow(self, seq_id: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq_id, num_tokens) + reserve <= len(self._free)

    def grow(self, seq_id: int, num_tokens: int) -> list[int]:
        """Appends blocks so the table covers ``num_tokens``; returns the new block ids."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"sequence {seq_id} needs {need} blocks, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        self.tables.setdefault(seq_id, []).extend(new)
        return new

    def free(self, seq_id: int) -> None:
        self._free.extend(self.tables.pop(seq_id, ()))
