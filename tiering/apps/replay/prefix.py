"""The index of retained prefixes: finished requests' KV, keyed by chains of block ids.

In a Mooncake trace a request's prompt is a chain of block ids, one per
512-token block, and equal ids mean an identical prefix up to and including
that block. So one block id names a whole prefix, and the longest prefix a new
request shares with any retained entry is found by walking its chain until a
block no entry holds.

``PrefixIndex`` only keeps the bookkeeping: which entry holds which blocks and
how recently each entry was used. Where an entry's KV lives, and freeing it, is
the simulator's business; ``add`` tells it which older entries the new one
makes redundant (their chain is a prefix of the new chain).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice


class PrefixIndex:
    """Retained entries: rid -> chain of block ids, with an LRU order."""

    def __init__(self) -> None:
        self._chains: dict[str, tuple[int, ...]] = {}
        # block id -> entries holding it, in the order they were added (a dict as an
        # ordered set, so that every walk over it is deterministic)
        self._holders: dict[int, dict[str, None]] = {}
        self._tails: dict[int, dict[str, None]] = {}  # block id -> entries ending there
        self._lru: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, rid: object) -> bool:
        return rid in self._chains

    def chain(self, rid: str) -> tuple[int, ...]:
        return self._chains[rid]

    def longest_match(self, hash_ids: Sequence[int], newest: int = 16) -> tuple[int, list[str]]:
        """(blocks matched, up to ``newest`` entries holding all of them, newest first).

        A miss is ``(0, [])``. Only the newest holders are returned because a
        shared first block (a system prompt) may be held by every entry.
        """
        holders = self._holders
        depth = 0
        found: dict[str, None] | None = None
        for block in hash_ids:
            held = holders.get(block)
            if not held:
                break
            found = held
            depth += 1
        if found is None:
            return 0, []
        return depth, list(islice(reversed(found), newest))

    def add(self, rid: str, chain: Sequence[int]) -> list[str]:
        """Register ``rid`` holding ``chain``; returns the entries it makes redundant.

        The caller frees those and then calls ``remove`` for each.
        """
        if rid in self._chains:
            raise ValueError(f"prefix entry {rid!r} is already registered")
        chain = tuple(chain)
        if not chain:
            raise ValueError(f"prefix entry {rid!r}: the chain must hold at least one block")
        redundant: list[str] = []
        for block in chain:
            redundant.extend(self._tails.get(block, ()))
        self._chains[rid] = chain
        for block in chain:
            self._holders.setdefault(block, {})[rid] = None
        self._tails.setdefault(chain[-1], {})[rid] = None
        self._lru[rid] = None
        return redundant

    def remove(self, rid: str) -> None:
        chain = self._chains.pop(rid)
        for block in chain:
            held = self._holders[block]
            del held[rid]
            if not held:
                del self._holders[block]
        tails = self._tails[chain[-1]]
        del tails[rid]
        if not tails:
            del self._tails[chain[-1]]
        del self._lru[rid]

    def touch(self, rid: str) -> None:
        """The entry was used now (it moves to the warm end of the LRU order)."""
        self._lru.move_to_end(rid)

    def coldest_first(self) -> Iterator[str]:
        """Entries from least to most recently used (a snapshot: safe to remove while
        iterating)."""
        return iter(list(self._lru))
