"""The modelled cache's block-page calls: a refused call changes nothing."""

from __future__ import annotations

import random

import pytest

from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import SimClock
from tiering.types import Tier


def _snapshot(kv: ModeledKVCache) -> tuple:
    return (tuple(kv.free_pages(t) for t in Tier), tuple(kv.block_pages(t) for t in Tier),
            kv.stats.bytes_d2h, kv.stats.bytes_disk_write)


@pytest.mark.parametrize("seed", range(5))
def test_a_refused_block_move_changes_nothing(seed):
    rng = random.Random(seed)
    kv = ModeledKVCache(rng.randint(2, 64), 4, 40, 40, 40,
                        LinkRates(1e9, 1e9, 1e8, 1e8, d2h_latency_s=1e-4), SimClock())
    held = rng.randint(1, 8)
    assert kv.take_block_pages(Tier.DEVICE, held)
    before = _snapshot(kv)
    # more pages than the source's blocks hold: refused before the destination is taken
    for bad in (held + 1, held + rng.randint(2, 20), -1, True, 1.0, "2"):
        with pytest.raises(ValueError, match="move_block_pages: n must be an int"):
            kv.move_block_pages(Tier.DEVICE, Tier.HOST, bad)
        assert _snapshot(kv) == before, f"n={bad!r} changed the cache"
    with pytest.raises(ValueError, match="no move from"):
        kv.move_block_pages(Tier.HOST, Tier.DEVICE, 1)
    assert _snapshot(kv) == before
    # a short destination is an expected shortage: False, nothing changed
    kv2 = ModeledKVCache(8, 4, 40, 2, 40, LinkRates.instant(), SimClock())
    assert kv2.take_block_pages(Tier.DEVICE, 3)
    snap = _snapshot(kv2)
    assert kv2.move_block_pages(Tier.DEVICE, Tier.HOST, 3) is False
    assert _snapshot(kv2) == snap
    # a legal move takes the destination, frees the source and counts its bytes
    n = rng.randint(1, held)
    assert kv.move_block_pages(Tier.DEVICE, Tier.HOST, n)
    assert kv.block_pages(Tier.DEVICE) == held - n and kv.block_pages(Tier.HOST) == n
    assert kv.stats.bytes_d2h == before[2] + n * kv.page_bytes
