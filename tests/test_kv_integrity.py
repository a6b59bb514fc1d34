"""``PagedKVCache.check_integrity`` really checks: each kind of record it cross-checks,
broken on its own in a cache that passed the check just before, is named.

The stateful tests call ``check_integrity`` after every operation; they prove something
only if it fails on a broken record. Each case builds the same small world (a published
prefix, a request mapping it and writing its own tail, a request on host, one on disk),
checks it passes (the control), breaks one record, and expects the message that names
that record. Nothing here is a product path: the breakage is done to the records.
"""

from __future__ import annotations

import pytest
import torch
from conftest import write_random
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.blocks import KeyRoot
from tiering.core.pools import PoolIntegrityError
from tiering.core.staging import StagingConfig
from tiering.disk import DiskConfig
from tiering.types import RequestState, Tier

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4)
T = GEOM.page_tokens


def world(tmp_path, *, prefix=True, seed=0):
    """"a" published 16 of its 18 tokens, "b" maps those 4 blocks and wrote 6 more,
    "h" is on host, "d" on disk. Returns the cache, which has passed check_integrity."""
    disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=32 * GEOM.page_bytes,
                      chunk_bytes=2 * GEOM.page_bytes)
    kv = PagedKVCache(GEOM, "cpu", 16, 8, disk=disk, staging=StagingConfig(buffers=2, pages=2),
                      stage_disk_io=True)
    gen = torch.Generator().manual_seed(seed)
    if prefix:
        assert kv.enable_prefix_cache(KeyRoot(GEOM.fingerprint(), "m", page_tokens=T))
        ids = torch.randint(0, 1000, (18,), generator=gen, dtype=torch.long)
        kv.ingest_request("a")
        write_random(kv, "a", gen, 18)
        assert kv.publish_prefix("a", ids) == 16
        kv.ingest_request("b")
        assert kv.attach_prefix("b", ids) == 16
        write_random(kv, "b", gen, 6, start=16)
    for rid in ("h", "d"):
        kv.ingest_request(rid)
        write_random(kv, rid, gen, 7)
        assert kv.offload(rid) > 0
    assert all(r.ok for r in kv.synchronize(10))
    assert kv.demote("d")
    assert all(r.ok for r in kv.synchronize(10))
    assert kv.state_of("h") is S.ON_HOST and kv.state_of("d") is S.ON_DISK
    kv.check_integrity()  # the control: the world before the breakage passes
    return kv


def _drop_own_device_page(kv):
    kv._reqs["b"].device.pop()


def _swap_page_table(kv):
    r = kv._reqs["b"]
    kv.device_page_table("b")  # build the table, then point its first entry elsewhere
    r.index = r.index.clone()
    r.index[0] = r.device[-1]


def _forget_disk_extent(kv):
    kv._reqs["d"].disk = None


def _drop_host_page(kv):
    kv._reqs["h"].host.pop()


def _unmap_last_block(kv):
    r = kv._reqs["b"]  # "a" (the publisher) and "b" map it: refs 2, one mapping left
    r.blocks.pop()
    r.shared.pop()


def _blocks_without_pages(kv):
    kv._reqs["b"].shared.pop()


def _lose_a_crc(kv):
    key = kv._reqs["b"].blocks[0]
    del kv._prefix.crc[key]


def _policy_forgets_a_block(kv):
    key = kv._reqs["b"].blocks[0]
    kv._prefix.policies[Tier.DEVICE].on_remove(key)


def _map_the_wrong_page(kv):
    r = kv._reqs["b"]
    r.shared[0], r.shared[1] = r.shared[1], r.shared[0]


def _hold_a_staging_buffer(kv):
    assert kv._ring.acquire(0) is not None


def _wrong_state(kv):
    kv._reqs["h"].state = S.RESIDENT


def _written_past_the_end(kv):
    kv._reqs["b"].written[1] = [(16, 23)]  # b holds 22 tokens


def _written_spans_overlap(kv):
    kv._reqs["b"].written[0] = [(16, 20), (18, 22)]  # a merge left undone


@pytest.mark.parametrize(("breakage", "what"), [
    (_drop_own_device_page, r"b: \d+ device pages for 22 tokens"),
    (_swap_page_table, r"b: device page table \[.*\] != slots"),
    (_forget_disk_extent, r"disk holds 1 extents, records 0"),
    (_drop_host_page, r"host pool: owner 'h': pool says \[\d+, \d+\], records say \[\d+\]"),
    (_drop_host_page, r"h: 1 host pages, needs 2"),
    (_unmap_last_block, r"block [0-9a-f]+: refs 2, mappings 1"),
    (_blocks_without_pages, r"b: 4 blocks but 3 shared pages"),
    (_lose_a_crc, r"has no crc32c"),
    (_policy_forgets_a_block, r"is not tracked by the device policy"),
    (_map_the_wrong_page, r"b: block 0 on page \d+, index says"),
    (_hold_a_staging_buffer, r"staging ring: 1 of 2 buffers still held"),
    (_wrong_state, r"h: state resident"),
    (_written_past_the_end, r"b: layer 1 written spans \[\(16, 23\)\] \(of 1\) for 22 tokens"),
    (_written_spans_overlap, r"b: layer 0 written spans \[\(16, 20\), \(18, 22\)\]"),
])
def test_each_broken_record_is_named(tmp_path, closing, breakage, what):
    kv = world(tmp_path)
    breakage(kv)
    with pytest.raises(PoolIntegrityError, match=what):
        kv.check_integrity()
    closing.call(_quiet_close, kv)


def test_prefix_mappings_without_a_prefix_cache_are_named(tmp_path, closing):
    kv = world(tmp_path, prefix=False)
    kv._reqs["h"].shared.append(0)
    kv._reqs["h"].blocks.append(b"k" * 16)
    with pytest.raises(PoolIntegrityError, match="h: maps prefix blocks with no prefix cache"):
        kv.check_integrity()
    closing.call(_quiet_close, kv)


def _quiet_close(kv):
    """Close a cache whose records a test broke: the close may complain; a test that
    broke them on purpose does not care how."""
    try:
        kv.close()
    except Exception:  # the records were broken on purpose
        pass
