"""The cache-block allocator of the serving engine.

Blocks are the pages of :class:`dsa.model.PagedKVCache` (one id addresses the same block in
every layer's MLA and indexer caches). The manager hands out block ids, takes them back,
refuses double frees and foreign ids, and can keep a few blocks out of circulation
(``reserved``: e.g. the scratch block that the padded rows of a CUDA-graph decode write to).
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, reserved: int = 0):
        if num_blocks - reserved < 1:
            raise ValueError(f"num_blocks: expected more than {reserved} reserved blocks, got {num_blocks}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        #: blocks never handed to a request (the last ``reserved`` ids)
        self.reserved_ids = list(range(num_blocks - reserved, num_blocks))
        self._free = deque(range(num_blocks - reserved))
        self._used: set = set()

    @property
    def capacity(self) -> int:
        """Blocks that requests can ever hold."""
        return self.num_blocks - len(self.reserved_ids)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def allocate(self, n: int) -> list:
        if n < 0 or n > len(self._free):
            raise RuntimeError(f"BlockManager: cannot allocate {n} blocks ({len(self._free)} free of {self.capacity})")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks) -> None:
        blocks = list(blocks)
        bad = [b for b in blocks if b not in self._used]
        if bad or len(set(blocks)) != len(blocks):
            raise RuntimeError(f"BlockManager: freeing blocks that are not allocated (or twice): {bad or blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)

    def all_free(self) -> bool:
        return not self._used and len(self._free) == self.capacity
