"""Prefix reuse in PagedKVCache: publish, look up, attach through device, host and disk.

Every test fills pages with random bytes and checks what ``read`` returns bit
for bit against what was published; ``check_integrity`` runs after every
operation. Where a hit and a recompute would give the same bytes, the tests
also check the reuse path ran (hit counters, shared page numbers, moves) and
keep a negative control (a changed root, a corrupted block).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_leading, write_random
from tiering.policies.blocks import LRUBlocks
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.resources.kv_prefix import BLOCKS

from tiering.blocks import KeyRoot
from tiering.disk import DiskConfig
from tiering.types import IllegalTransition, RequestState, Tier

S = RequestState
GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4)
T = GEOM.page_tokens


def root(model: str = "m") -> KeyRoot:
    return KeyRoot(GEOM.fingerprint(), model, page_tokens=T)


def make(tmp_path=None, device_pages=16, host_pages=8, disk_pages=32, model="m", **kw):
    disk = None
    if tmp_path is not None:
        disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=disk_pages * GEOM.page_bytes,
                          chunk_bytes=2 * GEOM.page_bytes)
    kv = PagedKVCache(GEOM, "cpu", device_pages, host_pages, disk=disk, **kw)
    # lru, named: these tests count moves in recency order; the default policy has its own tests
    assert kv.enable_prefix_cache(root(model), policy="lru")
    return kv


def tokens(gen, n):
    return torch.randint(0, 1000, (n,), generator=gen, dtype=torch.long)


def published(kv, gen, rid="a", n=18):
    ids = tokens(gen, n)
    kv.ingest_request(rid)
    data = write_random(kv, rid, gen, n)
    assert kv.publish_prefix(rid, ids) == (n // T) * T
    kv.check_integrity()
    return ids, data


def squeeze_device(kv, gen, rid="big"):
    """Fill the device with a new request so the cache must move unmapped blocks down."""
    kv.ingest_request(rid)
    free = kv.device_pool.free_pages + kv._prefix.unmapped(Tier.DEVICE)
    write_random(kv, rid, gen, free * T)
    kv.check_integrity()


def published_off_device(kv, gen):
    """Publish a prefix as "a", remove "a", then squeeze the device so its blocks move down."""
    ids, data = published(kv, gen)
    kv.remove_request("a")
    squeeze_device(kv, gen)
    return ids, data


def attach_and_load(kv, rid, ids):
    kv.ingest_request(rid)
    got = kv.attach_prefix(rid, ids)
    kv.check_integrity()
    if kv.is_offloaded(rid):
        from tiering.resources.base import ResourceStep, StepContext

        assert not kv.admit(ResourceStep(rid), StepContext())
        assert kv.reload(rid)
        kv.check_integrity()
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.admit(ResourceStep(rid), StepContext())
    return got


def test_device_hit_shares_the_pages_without_a_copy():
    gen = torch.Generator().manual_seed(1)
    with make() as kv:
        ids, data = published(kv, gen)
        pages = kv.page_table("a")[:4]
        kv.remove_request("a")
        kv.check_integrity()
        assert kv.cached_prefix(ids).tokens == 16
        assert kv.device_used_bytes() == 0  # unmapped blocks count as free room
        got = attach_and_load(kv, "b", ids)
        assert got == 16 and kv.num_tokens("b") == 16
        assert kv.page_table("b") == pages  # the same pages: shared, not copied
        assert kv.prefix_stats()["hit_tokens_device"] == 16
        assert kv.stats.bytes_host_to_device == kv.stats.bytes_disk_to_device == 0
        assert_leading(kv, "b", data, 16)
        # a second request maps the same pages at once; both are counted
        got = attach_and_load(kv, "c", ids)
        assert kv.page_table("c") == pages
        assert kv._prefix.index.get(kv._prefix.keys(ids)[0]).refs == 2
        # the rest is the request's own: it computes and writes it
        rest = write_random(kv, "c", gen, 2, start=16)
        kv.write("c", 0, 16, rest[0][0], rest[0][1])
        kv.check_integrity()


def test_a_published_page_is_immutable():
    gen = torch.Generator().manual_seed(2)
    with make() as kv:
        ids, data = published(kv, gen)
        k = torch.randn(1, GEOM.num_kv_heads, GEOM.head_dim, generator=gen).to(GEOM.dtype)
        with pytest.raises(ValueError, match="published page 3"):
            kv.write("a", 0, 15, k, k)
        assert_leading(kv, "a", data, 18)  # nothing changed
        kv.write("a", 0, 16, k, k)  # the unpublished tail is writable
        kv.check_integrity()


def test_publish_is_idempotent_and_rejects_other_tokens():
    gen = torch.Generator().manual_seed(3)
    with make() as kv:
        ids, _ = published(kv, gen)
        before = kv.prefix_stats()["blocks_published"]
        assert kv.publish_prefix("a", ids) == 16
        assert kv.prefix_stats()["blocks_published"] == before
        other = ids.clone()
        other[1] += 1
        with pytest.raises(ValueError, match="page 0 was published from other token ids"):
            kv.publish_prefix("a", other)
        with pytest.raises(ValueError, match="holds 18 tokens"):
            kv.publish_prefix("a", tokens(gen, 19))
        with pytest.raises(ValueError, match="one-dimensional"):
            kv.publish_prefix("a", ids.reshape(2, 9))
        kv.check_integrity()


def test_cached_prefix_changes_nothing():
    gen = torch.Generator().manual_seed(4)
    with make() as kv:
        ids, _ = published(kv, gen)
        kv.remove_request("a")
        snap = (dict(kv.prefix_stats()), kv.device_pool.used_pages)
        hit = kv.cached_prefix(ids)
        assert (hit.tokens, hit.device, hit.host, hit.disk) == (16, 16, 0, 0)
        assert kv.cached_prefix(ids[:9]).tokens == 8
        assert (dict(kv.prefix_stats()), kv.device_pool.used_pages) == snap
        kv.check_integrity()


def test_changed_root_gives_no_hit():
    gen = torch.Generator().manual_seed(5)
    with make(model="m") as kv:
        ids, _ = published(kv, gen)
        kv.remove_request("a")
        assert kv.cached_prefix(ids).tokens == 16
    with make(model="other-model") as kv2:
        ids2, _ = published(kv2, torch.Generator().manual_seed(5))
        assert torch.equal(ids2, ids)
        kv2.remove_request("a")
        keys_m = set(kv2._prefix.keys(ids))
        assert keys_m.isdisjoint({x for x in KeyRoot(GEOM.fingerprint(), "m", page_tokens=T).keys(ids)})
    # the same cache under another root finds nothing of the first root's blocks
    with make(model="m") as kv3:
        published(kv3, torch.Generator().manual_seed(5))
        kv3.remove_request("a")
        kv3._prefix.root = KeyRoot(GEOM.fingerprint(), "m2", page_tokens=T).key
        assert kv3.cached_prefix(ids).tokens == 0
        assert attach_and_load(kv3, "b", ids) == 0


def test_host_hit_is_loaded_through_reload_and_bitwise():
    gen = torch.Generator().manual_seed(6)
    with make(device_pages=8, host_pages=8) as kv:
        ids, data = published_off_device(kv, gen)
        st = kv.prefix_stats()
        assert st["blocks_device_to_host"] == 4 and st["blocks_on_host"] == 4
        assert kv.host_used_bytes() == 0  # unmapped host blocks count as room too
        kv.remove_request("big")
        hit = kv.cached_prefix(ids)
        assert (hit.tokens, hit.host) == (16, 16)
        kv.ingest_request("b")
        assert kv.attach_prefix("b", ids) == 16
        assert kv.is_offloaded("b") and kv.reload_bytes("b") == 4 * GEOM.page_bytes
        kv.check_integrity()
        assert kv.reload("b")
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.state_of("b") is S.RESIDENT and kv.num_tokens("b") == 16
        assert_leading(kv, "b", data, 16)
        st = kv.prefix_stats()
        assert st["hit_tokens_host"] == 16 and st["blocks_host_to_device"] == 4
        assert st["blocks_on_device"] == 4 and st["blocks_on_host"] == 0  # moved, not copied


def _disk_full_of_blocks(kv, gen):
    """4 cached blocks on a 4-page disk and a live request "h" holding 2 of 4 host pages."""
    ids, _ = published_off_device(kv, gen)  # device -> host
    kv.remove_request("big")
    kv.ingest_request("h")
    write_random(kv, "h", gen, 2 * T)
    assert kv.offload("h") > 0  # the cached blocks went to disk to make host room
    kv.synchronize(10)
    kv.check_integrity()
    assert kv.cached_prefix(ids).disk == 16 and kv.state_of("h") is S.ON_HOST
    return ids


@pytest.mark.parametrize("move", ["offload", "demote"])
def test_a_live_request_goes_to_disk_before_cached_blocks_stay_there(tmp_path, move):
    """A live request's offload (host full) or demotion takes disk room from cached blocks,
    as it does on the device and the host. Before, it was refused while the disk held
    blocks no request maps (an offload returned 0, a demotion False)."""
    gen = torch.Generator().manual_seed(11)
    with make(tmp_path, device_pages=8, host_pages=4, disk_pages=4) as kv:
        ids = _disk_full_of_blocks(kv, gen)
        if move == "offload":  # the host has 2 pages left: 4 must go to disk
            kv.ingest_request("x")
            data = write_random(kv, "x", gen, 4 * T)
            assert kv.offload("x") == 4 * GEOM.page_bytes
            rid = "x"
        else:
            data = None
            assert kv.demote("h")
            rid = "h"
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.state_of(rid) is S.ON_DISK
        st = kv.prefix_stats()
        assert st["blocks_on_disk"] == 0 and st["dropped_evicted"] >= 1
        assert kv.cached_prefix(ids).tokens == 0  # the blocks left, not the request
        if data is not None:
            assert kv.reload(rid)
            kv.synchronize(10)
            kv.check_integrity()
            assert_leading(kv, rid, data, 4 * T)


def test_a_live_request_does_not_take_disk_room_a_loading_block_holds(tmp_path):
    """Control: a disk block a request is loading is not dropped for a demotion."""
    gen = torch.Generator().manual_seed(12)
    with make(tmp_path, device_pages=12, host_pages=4, disk_pages=4) as kv:
        ids = _disk_full_of_blocks(kv, gen)
        kv.ingest_request("b")
        assert kv.attach_prefix("b", ids) == 16 and kv.is_offloaded("b")  # its load is pending
        assert not kv.demote("h")  # every disk block is mapped by its loader
        kv.check_integrity()
        assert kv.state_of("h") is S.ON_HOST and kv.prefix_stats()["blocks_on_disk"] == 4


def test_disk_hit_is_bitwise_and_blocks_are_packed(tmp_path):
    gen = torch.Generator().manual_seed(7)
    with make(tmp_path, device_pages=8, host_pages=4) as kv:
        ids, data = published_off_device(kv, gen)  # device -> host
        kv.remove_request("big")
        kv.ingest_request("h")
        write_random(kv, "h", gen, 2)
        assert kv.offload("h") > 0  # host room for a live request: cached blocks go to disk
        kv.synchronize(10)
        kv.check_integrity()
        st = kv.prefix_stats()
        assert st["blocks_host_to_disk"] == 4 and st["disk_block_writes"] == 1  # one write
        assert kv.cached_prefix(ids).disk == 16
        got = attach_and_load(kv, "b", ids)
        assert got == 16 and kv.num_tokens("b") == 16
        assert_leading(kv, "b", data, 16)
        assert kv.prefix_stats()["hit_tokens_disk"] == 16
        kv.remove_request("b")
        kv.remove_request("h")
        kv.check_integrity()


def test_corrupt_host_block_turns_the_hit_into_a_miss():
    gen = torch.Generator().manual_seed(8)
    for corrupt in (False, True):  # the first pass is the control: nothing corrupted, all hit
        with make(device_pages=8, host_pages=8) as kv:
            ids, data = published_off_device(kv, gen)
            kv.remove_request("big")
            keys = kv._prefix.keys(ids)
            if corrupt:
                slot = kv._prefix.index.location(keys[2]).handle
                kv._host[slot].view(-1)[5] += 1.0  # one value of block 2 changes
            kv.ingest_request("b")
            assert kv.attach_prefix("b", ids) == 16  # optimistic until loaded
            assert kv.reload("b")
            kv.synchronize(10)
            kv.check_integrity()
            valid = kv.num_tokens("b")
            assert valid == (8 if corrupt else 16)
            assert_leading(kv, "b", data, valid)
            if corrupt:
                assert keys[2] not in kv._prefix.index and keys[3] not in kv._prefix.index
                assert kv._prefix.index.dropped["corrupt"] == 1
                assert kv.cached_prefix(ids).tokens == 8
                # the caller recomputes from the valid count: the tail is the request's own
                redo = write_random(kv, "b", gen, 10, start=8)
                assert kv.read("b", 0)[0][8:].equal(redo[0][0])


def test_corrupt_disk_block_is_detected(tmp_path):
    gen = torch.Generator().manual_seed(9)
    with make(tmp_path, device_pages=8, host_pages=4) as kv:
        ids, data = published_off_device(kv, gen)
        kv.remove_request("big")
        kv.ingest_request("h")
        write_random(kv, "h", gen, 2)
        kv.offload("h")
        kv.synchronize(10)
        keys = kv._prefix.keys(ids)
        assert kv._prefix.index.location(keys[0]).tier is Tier.DISK
        kv._prefix.crc[keys[1]] ^= 1  # the stored block no longer matches what was published
        got = attach_and_load(kv, "b", ids)
        assert got == 16 and kv.num_tokens("b") == 4
        assert_leading(kv, "b", data, 4)
        assert kv.cached_prefix(ids).tokens == 4
        kv.check_integrity()


def test_offloading_a_request_with_shared_blocks_moves_only_its_own_pages():
    gen = torch.Generator().manual_seed(10)
    with make(device_pages=16, host_pages=16) as kv:
        ids, data = published(kv, gen, "a", 18)
        attach_and_load(kv, "b", ids)
        tail = write_random(kv, "b", gen, 6, start=16)
        shared = kv.page_table("b")[:4]
        assert kv.reclaimable("b") == 2 * GEOM.page_bytes  # its own 2 pages, not the 4 shared
        assert kv.offload("b") == 2 * GEOM.page_bytes
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.page_table("a")[:4] == shared  # still mapped, never copied or freed
        assert_leading(kv, "a", data, 18)
        assert kv.reload("b")
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.page_table("b")[:4] == shared
        k, v = kv.read("b", 0)
        assert torch.equal(k[:16], data[0][0][:16]) and torch.equal(k[16:], tail[0][0])
        assert kv.stats.bytes_device_to_host == 2 * GEOM.page_bytes


def test_bad_input_names_what_was_wrong_and_changes_nothing(closing):
    gen = torch.Generator().manual_seed(11)
    with make() as kv:
        ids, _ = published(kv, gen)
        with pytest.raises(IllegalTransition, match="attach only a fresh request"):
            kv.attach_prefix("a", ids)
        kv.ingest_request("b")
        with pytest.raises(ValueError, match="must be >= 0"):
            kv.attach_prefix("b", torch.tensor([1, -2, 3]))
        assert kv.num_tokens("b") == 0
        kv.check_integrity()
    plain = closing(PagedKVCache(GEOM, "cpu", 4, 4))
    plain.ingest_request("x")
    with pytest.raises(RuntimeError, match="not enabled"):
        plain.cached_prefix([1, 2, 3, 4])


def test_removing_a_loader_in_flight_leaks_nothing():
    gen = torch.Generator().manual_seed(12)
    with make(device_pages=8, host_pages=8) as kv:
        ids, _ = published_off_device(kv, gen)
        kv.remove_request("big")
        kv.ingest_request("b")
        kv.attach_prefix("b", ids)
        assert kv.reload("b")
        kv.remove_request("b")
        kv.check_integrity()
        kv.synchronize(10)
        kv.check_integrity()
        assert kv.in_flight() == 0
        assert kv.device_used_bytes() == 0 and kv.host_used_bytes() == 0
        held = kv.device_pool.holdings()
        assert set(held) <= {BLOCKS}


def test_negative_control_without_the_crc_check_corruption_would_be_served(monkeypatch):
    """The corruption test above detects something real: with the check disabled,
    the same flipped value reaches ``read``."""
    import tiering.resources.kv_prefix as kp

    monkeypatch.setattr(kp, "crc_page", lambda t: 0)
    gen = torch.Generator().manual_seed(8)
    with make(device_pages=8, host_pages=8) as kv:
        ids, data = published_off_device(kv, gen)
        kv.remove_request("big")
        keys = kv._prefix.keys(ids)
        kv._host[kv._prefix.index.location(keys[2]).handle].view(-1)[5] += 1.0
        attach_and_load(kv, "b", ids)
        assert kv.num_tokens("b") == 16
        k, _ = kv.read("b", 0)
        assert not torch.equal(k[:16], data[0][0][:16])


def test_engine_hooks_resolve_apply_and_extend(closing):
    """The seed's prefix hooks on the same machinery: resolve says how much, apply attaches,
    extend keys generated pages as they fill."""
    gen = torch.Generator().manual_seed(13)
    with make() as kv:
        assert kv.prefix_skip_safe and kv.keys_prefix_chains
        assert kv.fingerprint() == GEOM.fingerprint().encode()
        ids = tokens(gen, 10)
        kv.ingest_request("a")
        kv.apply_cached_prefix("a", "n", "w", ids, None)
        data = write_random(kv, "a", gen, 10)
        kv.extend_prefix_chain("a", "n", "w", tokens(gen, 2))  # 12 tokens known, 10 held
        assert kv.prefix_stats()["blocks_published"] == 2
        more = write_random(kv, "a", gen, 2, start=10)
        kv.extend_prefix_chain("a", "n", "w", tokens(gen, 1))
        assert kv.prefix_stats()["blocks_published"] == 3  # the third page filled
        chain = kv._reqs["a"].chain_tokens
        kv.remove_request("a")
        hit = kv.resolve_cached_prefix("b", "n", "w", chain[:12])
        assert (hit.label, hit.tokens, hit.position) == ("w", 8, 8)  # the last token is run
        kv.ingest_request("b")
        kv.apply_cached_prefix("b", "n", "w", chain[:13], kv.resolve_cached_prefix("b", "n", "w", chain[:13]))
        assert kv.num_tokens("b") == 12
        k, _ = kv.read("b", 0)
        assert torch.equal(k[:10], data[0][0]) and torch.equal(k[10:12], more[0][0])
        kv.check_integrity()
    plain = closing(PagedKVCache(GEOM, "cpu", 4, 4))
    assert plain.resolve_cached_prefix("x", "n", "w", [1, 2, 3]) is None
    assert not plain.keys_prefix_chains



def test_making_host_room_that_drops_the_victims_parent_frees_its_page():
    """A device victim whose parent is the host's only victim: moving the child down first
    makes room on the host, which drops the parent and the child with it. The allocation
    goes on with the freed page (it used to fail inside the index)."""
    gen = torch.Generator().manual_seed(3)
    with make(device_pages=4, host_pages=1) as kv:
        ids, data = published(kv, gen, "a", 9)  # blocks 0 and 1 on the device
        kv.remove_request("a")
        kv.ingest_request("big")
        write_random(kv, "big", gen, 12)  # block 0 (older) moves to the host; block 1 stays
        keys = kv._prefix.keys(ids)
        assert kv._prefix.index.location(keys[0]).tier is Tier.HOST
        assert kv._prefix.index.location(keys[1]).tier is Tier.DEVICE
        kv.remove_request("big")
        kv.ingest_request("big2")
        want = write_random(kv, "big2", gen, 16)  # needs every device page: block 1 must go
        assert keys[0] not in kv._prefix.index and keys[1] not in kv._prefix.index
        assert kv.prefix_stats()["dropped_with_ancestor"] == 1
        assert_leading(kv, "big2", want, 16)
        kv.check_integrity()


@pytest.mark.parametrize("kw, what", [
    ({"shared_refresh_s": float("nan")}, "shared_refresh_s must be a finite number > 0, got nan"),
    ({"shared_refresh_s": float("inf")}, "shared_refresh_s must be a finite number > 0, got inf"),
    ({"shared_refresh_s": -1.0}, "shared_refresh_s must be a finite number > 0"),
    ({"disk_batch_pages": 0}, "disk_batch_pages must be an int >= 1, got 0"),
    ({"disk_batch_pages": True}, "disk_batch_pages must be an int >= 1, got True"),
    ({"policy": "nope"}, "unknown block policy 'nope'"),
])
def test_bad_prefix_arguments_are_refused_on_every_call(closing, kw, what):
    """A bad ``shared_refresh_s`` was taken without a shared tier, and on a second call every
    argument was ignored, so ``disk_batch_pages=0`` or a NaN refresh came back True."""
    kv = closing(PagedKVCache(GEOM, "cpu", 4, 4))
    with pytest.raises(ValueError, match=what):
        kv.enable_prefix_cache(root(), **kw)
    assert not kv.prefix_enabled
    assert kv.enable_prefix_cache(root())  # the control
    with pytest.raises(ValueError, match=what):
        kv.enable_prefix_cache(root(), **kw)
    assert kv.prefix_enabled and kv._prefix.disk_batch_pages == 16
    kv.check_integrity()


def test_a_key_root_for_another_page_size_or_geometry_is_refused(closing):
    """A root built for pages of 8 tokens (or another geometry) was taken by a cache whose pages
    hold 4: its keys then named pages of another size under a root that says otherwise."""
    kv = closing(PagedKVCache(GEOM, "cpu", 4, 4))
    with pytest.raises(ValueError, match="root's page_tokens is 8, the cache's pages hold 4"):
        kv.enable_prefix_cache(KeyRoot(GEOM.fingerprint(), "m", page_tokens=8))
    other = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=T)
    with pytest.raises(ValueError, match="root's geometry_fingerprint is"):
        kv.enable_prefix_cache(KeyRoot(other.fingerprint(), "m", page_tokens=T))
    assert not kv.prefix_enabled
    assert kv.enable_prefix_cache(root())
    assert kv.enable_prefix_cache(root().key)  # raw root bytes are the caller's to build
    kv.check_integrity()


def test_a_failed_block_write_to_disk_drops_the_blocks_as_failed_and_leaks_nothing(tmp_path, monkeypatch,
                                                                                  caplog):
    """The host -> disk write of cached blocks fails: the blocks are dropped (their host
    pages and the disk extent are freed, the index forgets them), counted under their own
    reason rather than as evictions (each block once: the drop of a chain's first block
    takes the blocks after it, and no further drop of them is tried), and a later attach
    recomputes instead of reading them."""
    gen = torch.Generator().manual_seed(17)
    with make(tmp_path, device_pages=8, host_pages=4) as kv:
        ids, data = published_off_device(kv, gen)  # device -> host
        kv.remove_request("big")
        assert kv.cached_prefix(ids).host == 16
        used = kv.disk.stats()["used_bytes"], kv.disk.stats()["extents"]

        def broken(*a, **kw):
            raise OSError("injected: disk write failed")

        monkeypatch.setattr(kv.disk, "write", broken)
        kv.ingest_request("h")
        write_random(kv, "h", gen, 2)
        assert kv.offload("h") > 0  # host room wanted: the blocks' write fails
        kv.synchronize(10)
        kv.check_integrity()
        assert not [r for r in caplog.records if "could not drop" in r.getMessage()]
        st = kv.prefix_stats()
        assert st.get("blocks_host_to_disk", 0) == 0 and st["blocks_on_disk"] == 0
        assert st["blocks_cached"] == 0 and st.get("dropped_evicted", 0) == 0
        assert st.get("dropped_demote_failed", 0) >= 1
        assert kv.host_pool.free_pages + len(kv._prefix.pages_on(Tier.HOST)) <= kv.host_pool.num_pages
        assert kv._prefix.extents == {}
        assert (kv.disk.stats()["used_bytes"], kv.disk.stats()["extents"]) == used  # extent freed
        monkeypatch.undo()
        kv.ingest_request("b")
        assert kv.attach_prefix("b", ids) == 0  # a miss: recomputed, never read
        kv.check_integrity()


def _write_on(kv, rid, gen, n, device):
    from conftest import random_kv

    assert kv.allocate(rid, n)
    data = random_kv(gen, kv.geometry, n)
    for layer, (k, v) in enumerate(data):
        kv.write(rid, layer, 0, k.to(device), v.to(device))
    kv.check_integrity()
    return data


def _leading_on_cpu(kv, rid, want, ntok):
    for layer, (k, v) in enumerate(want):
        gk, gv = kv.read(rid, layer)
        assert torch.equal(gk[:ntok].cpu(), k[:ntok]) and torch.equal(gv[:ntok].cpu(), v[:ntok]), layer


@pytest.mark.cuda
def test_on_cuda_a_device_hit_shares_pages_and_a_host_hit_loads_bitwise(closing):
    """The prefix cache on a CUDA device: the publish's crc copy, the device -> host move of
    unmapped blocks and the host -> device load through the streams (their CPU paths are
    what the other tests run). Skipped without a CUDA device."""
    gen = torch.Generator().manual_seed(23)
    kv = closing(PagedKVCache(GEOM, "cuda:0", 8, 8))
    assert kv.enable_prefix_cache(root())
    ids = tokens(gen, 18)
    kv.ingest_request("a")
    data = _write_on(kv, "a", gen, 18, "cuda:0")
    assert kv.publish_prefix("a", ids) == 16
    kv.check_integrity()
    kv.ingest_request("d")
    assert kv.attach_prefix("d", ids) == 16 and not kv.is_offloaded("d")
    assert kv.page_table("d")[:4] == kv.page_table("a")[:4]  # shared, not copied
    _leading_on_cpu(kv, "d", data, 16)
    kv.remove_request("d")
    kv.remove_request("a")
    kv.ingest_request("big")  # fill the device: the unmapped blocks move to the host
    _write_on(kv, "big", gen, (kv.device_pool.free_pages + kv._prefix.unmapped(Tier.DEVICE)) * T,
              "cuda:0")
    assert kv.prefix_stats()["blocks_device_to_host"] == 4
    kv.remove_request("big")
    kv.ingest_request("b")
    assert kv.attach_prefix("b", ids) == 16 and kv.is_offloaded("b")
    assert kv.reload("b")
    kv.synchronize(30)
    kv.check_integrity()
    assert kv.state_of("b") is S.RESIDENT and kv.num_tokens("b") == 16
    _leading_on_cpu(kv, "b", data, 16)
    assert kv.prefix_stats()["blocks_host_to_device"] == 4


@pytest.mark.parametrize("seed", range(3))
def test_a_refused_allocation_moves_no_cached_block(seed):
    """An allocation that cached blocks could not make room for moved the blocks that could
    leave down a tier (or dropped them) and then answered False anyway; now a shortage is
    refused before anything moves. The control: one page less is served by moving them."""
    gen = torch.Generator().manual_seed(seed)
    with make(device_pages=16, host_pages=8) as kv:
        ids, _ = published(kv, gen, "a", 18)  # 4 blocks and a partial page
        kv.remove_request("a")
        kv.ingest_request("b")
        assert kv.attach_prefix("b", ids[:9]) == 8  # blocks 0 and 1 mapped: they stay
        p = kv._prefix
        keys = p.keys(ids)

        def snapshot():
            return ([p.index.location(k) for k in keys], kv.device_pool.free_pages,
                    kv.host_pool.free_pages, dict(kv.prefix_stats()))

        before = snapshot()
        room = kv.device_pool.free_pages + 2  # blocks 2 and 3 may leave
        kv.ingest_request("c")
        assert kv.allocate("c", (room + 1) * T) is False
        assert snapshot() == before
        kv.check_integrity()
        assert kv.allocate("c", room * T) is True
        assert [p.index.location(k).tier for k in keys[2:]] == [Tier.HOST, Tier.HOST]
        kv.check_integrity()


class Judging(LRUBlocks):
    """LRU that records what it is asked to admit and told of, refusing ``refuse`` (all when
    None); its own ``admit`` and ``on_request`` make the store use the per-event hooks."""

    def __init__(self, capacity: int, refuse=()) -> None:
        super().__init__(capacity)
        self.refuse = refuse
        self.asked: list[tuple[bytes, int]] = []
        self.told: list[tuple[bytes, ...]] = []

    def admit(self, key, depth, now) -> bool:
        self.asked.append((key, depth))
        return self.refuse is not None and key not in self.refuse

    def on_request(self, keys, now) -> None:
        self.told.append(tuple(keys))


def judged(kv, tier, refuse=()) -> Judging:
    """Put a fresh ``Judging`` policy on ``tier`` of an empty block store."""
    p = kv._prefix
    assert len(p.index) == 0
    pol = Judging(64, refuse)
    p.policies[tier] = pol  # the rules' own table (one dict)
    assert p.rules.policies[tier] is pol
    return pol


def test_published_pages_are_admitted_by_the_device_policy_and_a_refusal_stops_there():
    gen = torch.Generator().manual_seed(11)
    with make() as kv:
        ids = tokens(gen, 18)
        keys = kv._prefix.keys(ids)
        dev = judged(kv, Tier.DEVICE, refuse={keys[2]})
        kv.ingest_request("a")
        data = write_random(kv, "a", gen, 18)
        assert kv.publish_prefix("a", ids) == 2 * T  # pages 2 and 3 stay the request's own
        assert dev.asked == [(keys[0], 0), (keys[1], 1), (keys[2], 2)]
        stats = kv.prefix_stats()
        assert stats["blocks_published"] == 2 and stats["publish_refused"] == 1
        assert keys[2] not in kv._prefix.index and len(kv._prefix.index) == 2
        assert_leading(kv, "a", data, 18)
        kv.check_integrity()
        kv.remove_request("a")
        assert kv.cached_prefix(ids).tokens == 2 * T
        kv.check_integrity()


def test_a_victim_the_host_policy_does_not_admit_is_dropped_not_moved():
    gen = torch.Generator().manual_seed(12)
    with make() as kv:
        host = judged(kv, Tier.HOST, refuse=None)  # refuses every block
        ids, _ = published(kv, gen)
        keys = kv._prefix.keys(ids)
        kv.remove_request("a")
        squeeze_device(kv, gen)
        stats = kv.prefix_stats()
        assert stats.get("blocks_device_to_host", 0) == 0 and stats["dropped_evicted"] >= 1
        assert kv._prefix.index.count(Tier.HOST) == 0 and kv.cached_prefix(ids).tokens == 0
        assert {k for k, _ in host.asked} <= set(keys) and host.asked
        kv.check_integrity()


def test_a_block_the_host_admits_moves_down():
    """The control of the test above: a host policy that admits takes the victims."""
    gen = torch.Generator().manual_seed(12)
    with make() as kv:
        host = judged(kv, Tier.HOST)
        ids, _ = published(kv, gen)
        kv.remove_request("a")
        squeeze_device(kv, gen)
        assert kv.prefix_stats()["blocks_device_to_host"] == len(host.asked) >= 1
        assert kv._prefix.index.count(Tier.HOST) >= 1
        kv.check_integrity()


def test_every_tier_is_told_a_request_once_not_once_per_published_page():
    gen = torch.Generator().manual_seed(13)
    with make() as kv:
        pols = {t: judged(kv, t) for t in Tier}
        ids = tokens(gen, 18)
        keys = tuple(kv._prefix.keys(ids))
        kv.ingest_request("a")
        assert kv.attach_prefix("a", ids) == 0  # nothing cached: told, with no hits
        write_random(kv, "a", gen, 18)
        assert kv.publish_prefix("a", ids[:9]) == 8
        assert kv.publish_prefix("a", ids) == 16
        assert all(p.told == [keys] for p in pols.values())
        # a request that never attached is told at its first publish, once
        kv.ingest_request("b")
        other = tokens(gen, 12)
        write_random(kv, "b", gen, 12)
        kv.publish_prefix("b", other[:4])
        kv.publish_prefix("b", other)
        assert all(p.told == [keys, tuple(kv._prefix.keys(other[:4]))] for p in pols.values())
        kv.check_integrity()


def test_each_tier_policy_is_sized_by_its_tier(tmp_path):
    disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=32 * GEOM.page_bytes,
                      chunk_bytes=2 * GEOM.page_bytes)
    with PagedKVCache(GEOM, "cpu", 16, 8, disk=disk) as kv:
        assert kv.enable_prefix_cache(root(), policy="arc")
        caps = {t: kv._prefix.policies[t].capacity for t in Tier}
        assert caps == {Tier.DEVICE: 16, Tier.HOST: 8, Tier.DISK: 32}


class _Refusing(LRUBlocks):
    """LRU that admits no block (a tier whose policy would rather keep what it holds)."""

    def admit(self, key, depth, now):
        return False


@pytest.mark.parametrize("disk_admits", [True, False], ids=["to-disk", "no-tier-admits"])
def test_a_device_victim_the_host_refuses_goes_to_disk_when_the_disk_admits_it(
        tmp_path, disk_admits):
    """A device victim the host's policy refused was dropped even with a disk tier that had
    room (a default policy refusing on a full host lost every block the host would not
    take). It now goes straight to disk when the disk's policy admits it, and a later
    attach is served from there bitwise; refused by the disk too (the control), it is
    dropped as before."""
    gen = torch.Generator().manual_seed(31)
    with make(tmp_path, device_pages=8, host_pages=4) as kv:
        rules = kv._prefix.rules
        rules.policies[Tier.HOST] = _Refusing(4)  # the store is empty: nothing to hand over
        if not disk_admits:
            rules.policies[Tier.DISK] = _Refusing(32)
        ids, data = published_off_device(kv, gen)  # the device's victims leave it
        kv.remove_request("big")
        kv.check_integrity()
        st = kv.prefix_stats()
        assert st.get("blocks_device_to_host", 0) == 0
        if not disk_admits:
            assert st.get("blocks_device_to_disk", 0) == 0 and kv.cached_prefix(ids).tokens == 0
            return
        assert st.get("blocks_device_to_disk") == 4 and st.get("disk_block_writes") == 4
        assert kv.cached_prefix(ids).disk == 16
        assert attach_and_load(kv, "b", ids) == 16
        assert_leading(kv, "b", data, 16)  # the bytes published, back from disk
        assert kv.prefix_stats()["hit_tokens_disk"] == 16
        kv.remove_request("b")
        kv.check_integrity()


def test_a_device_victim_the_host_has_no_room_for_goes_to_disk(tmp_path):
    """The host admits every block (lru) but an offloaded request holds all of it and no
    cached block there may leave: the device's victims were dropped; they now go
    straight to disk and come back from there bitwise."""
    gen = torch.Generator().manual_seed(32)
    with make(tmp_path, device_pages=8, host_pages=4) as kv:
        ids, data = published(kv, gen)
        kv.remove_request("a")
        kv.ingest_request("h")
        write_random(kv, "h", gen, 4 * T)
        assert kv.offload("h") > 0
        kv.synchronize(10)
        assert kv.state_of("h") is S.ON_HOST and kv.host_pool.free_pages == 0
        squeeze_device(kv, gen)
        kv.remove_request("big")
        st = kv.prefix_stats()
        assert st.get("blocks_device_to_host", 0) == 0 and st.get("blocks_device_to_disk") == 4
        assert kv.cached_prefix(ids).disk == 16
        assert attach_and_load(kv, "b", ids) == 16
        assert_leading(kv, "b", data, 16)
        kv.check_integrity()
