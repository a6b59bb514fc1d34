"""The vLLM backend's engine-independent core, without vLLM: config, the manager on
the block index and block policies, host -> disk cascade, checked promotion, the
worker-side mover and the import rule.

Size: over 700 lines: the manager's behaviours share the ``make`` / ``store`` / ``key``
helpers defined here.
"""

from __future__ import annotations

import ast
import os
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from tiering.policies.blocks import DEFAULT_BLOCK_POLICY, default_block_registry

from tiering.blocks import BlockIndex
from tiering.disk.slotfile import SLOT_FILE_NAME
from tiering.integrations.vllm._core import (
    DiskState,
    GroupLayout,
    HostSlab,
    HostState,
    LayerCopy,
    Lookup,
    TableIntegrityError,
    TieredBlockManager,
    TieredConfig,
    TieredMover,
    open_disk,
    plan_blocks,
)
from tiering.types import Tier

REPO = Path(__file__).resolve().parents[1]
PAGE = 256  # bytes of one host page in these tests


def key(i: int) -> bytes:
    return i.to_bytes(8, "big") + (0).to_bytes(4, "big")


class InlineExecutor:
    """Runs each job at submit (deterministic I/O order for the state machine)."""

    def submit(self, priority, fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # handed to the manager through the future
            fut.set_exception(exc)
        return fut


def make(tmp_path, slots=4, disk_pages=None, executor=None, **cfg) -> TieredBlockManager:
    c = TieredConfig(
        host_bytes=slots * PAGE,
        disk_path=str(tmp_path / "disk") if disk_pages else None,
        disk_bytes=disk_pages * PAGE if disk_pages else None,
        **cfg,
    )
    slab = HostSlab(str(tmp_path / "slab"), slots, PAGE)
    disk = open_disk(c, PAGE, "test")
    return TieredBlockManager(c, [slab], disk, disk_root=c.disk_path, executor=executor)


def land(m: TieredBlockManager, d, slot: int, pages: list[torch.Tensor]) -> None:
    """Write one block's bytes as each rank's worker would: into its host slot, or
    (a slot number past the host slots) into its row of the staging file."""
    if slot < m.num_slots:
        for slab, page in zip(m.slabs, pages, strict=True):
            slab.tensor[slot].copy_(page)
        return
    assert d.staging is not None
    row = slot - m.num_slots
    for r, page in enumerate(pages):
        with open(f"{d.staging}.r{r}", "r+b" if os.path.exists(f"{d.staging}.r{r}") else "wb") as f:
            f.seek(row * page.numel())
            f.write(page.numpy().tobytes())


def loaded(m: TieredBlockManager, slot: int, rank: int = 0) -> torch.Tensor:
    """What a worker's load copies for a block at ``slot`` (from ``prepare_load``): its
    host slot, or its row of the load staging file (a block loaded straight from disk)."""
    if slot < m.num_slots:
        return m.slabs[rank].tensor[slot].clone()
    n = m.slabs[rank].slot_bytes
    with open(f"{m.load_staging}.r{rank}", "rb") as f:
        f.seek((slot - m.num_slots) * n)
        return torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8)


def store(
    m: TieredBlockManager, gen: torch.Generator, keys: list[bytes], chained: bool = False
) -> dict[bytes, torch.Tensor]:
    """Store keys the way a worker would: write random bytes into the given slots
    (``chained``: each key's parent is the key before it)."""
    parents = [None, *keys[:-1]] if chained else None
    d = m.prepare_store(keys, parents)
    assert d is not None
    data = {}
    for k, s in zip(d.keys_to_store, d.slots, strict=True):
        page = torch.randint(0, 256, (PAGE,), generator=gen, dtype=torch.uint8)
        land(m, d, s, [page])
        data[k] = page
    m.complete_store(d.keys_to_store)
    m.check_integrity()
    return data


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "extra, field",
    [
        ({}, "host_bytes"),
        ({"host_bytes": 0}, "host_bytes"),
        ({"host_bytes": "1G"}, "host_bytes"),
        ({"host_bytes": 10, "disk_path": "/x"}, "disk_bytes"),
        ({"host_bytes": 10, "disk_bytes": 100}, "disk_path"),
        ({"host_bytes": 10, "disk_path": "/x", "disk_bytes": -1}, "disk_bytes"),
        ({"host_bytes": 10, "policy": "mru"}, "policy"),
        ({"host_bytes": 10, "policy": "fifo"}, "policy"),  # the old private policy is gone
        ({"host_bytes": 10, "policy": ["lru"]}, "policy"),
        ({"host_bytes": 10, "io_threads": 0}, "io_threads"),
        ({"host_bytes": 10, "demote_headroom": -2}, "demote_headroom"),
        ({"host_bytes": 10, "test_corrupt_loads": 1}, "test_corrupt_loads"),
    ],
)
def test_bad_extra_config_names_the_field(extra, field):
    with pytest.raises(ValueError, match=field):
        TieredConfig.from_extra(extra)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"host_bytes": 10, "io_threads": 10**9}, "io_threads"),  # a billion threads
        ({"host_bytes": 10, "copy_threads": 65}, "copy_threads"),
        ({"host_bytes": 10, "copy_threads": True}, "copy_threads"),
        ({"host_bytes": 10, "host_dir": "/nonexistent/tiering-dir"}, "host_dir"),
        ({"host_bytes": 10, "state_path": "/nonexistent/tiering-dir/s.json"}, "state_path"),
        ({"host_bytes": 10, "state_path": "/"}, "state_path"),  # a directory, not a file
        ({"host_bytes": True}, "host_bytes"),
        ({"host_bytes": 10.0}, "host_bytes"),
        ({"host_bytes": float("nan")}, "host_bytes"),
        ({"host_bytes": 10, "disk_path": "/x", "disk_bytes": True}, "disk_bytes"),
        ({"host_bytes": 10, "disk_path": "", "disk_bytes": 100}, "disk_path"),
        ({"host_bytes": 10, "demote_headroom": 1.0}, "demote_headroom"),
        ({"host_bytes": 10, "policy": None}, "policy"),
    ],
)
def test_more_bad_extra_config_names_the_field(extra, field):
    """Thread counts had no upper bound (a billion threads were started), and a
    missing host_dir or state_path directory passed (the slab failed later with a
    bare FileNotFoundError; the state file was silently never written)."""
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{field}"):
        TieredConfig.from_extra(extra)


def test_disk_path_that_is_a_file_names_the_field(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="kv_connector_extra_config.disk_path"):
        TieredConfig(host_bytes=4096, disk_path=str(f), disk_bytes=4096)
    assert TieredConfig(host_bytes=4096, host_dir=str(tmp_path),
                        state_path=str(tmp_path / "s.json")).host_dir == str(tmp_path)


def test_a_failed_state_dump_is_logged_and_written_again_later(tmp_path, caplog):
    import json
    import shutil

    gen = torch.Generator().manual_seed(29)
    sdir = tmp_path / "state"
    sdir.mkdir()
    m = make(tmp_path, slots=4, state_path=str(sdir / "s.json"))
    store(m, gen, [key(1)])
    assert m.wait_io(10)
    assert json.loads((sdir / "s.json").read_text())["counters"]["stores_completed"] == 1
    shutil.rmtree(sdir)  # the directory goes away under the running manager
    store(m, gen, [key(2)])
    assert m.wait_io(10)
    with caplog.at_level("WARNING"):
        store(m, gen, [key(3)])  # the next dump finds the last one failed
    assert "writing the state file" in caplog.text and str(sdir) in caplog.text
    sdir.mkdir()  # back: the next change writes the file again
    store(m, gen, [key(4)])
    assert m.wait_io(10)  # a dump still running at the store leaves it to the next step
    m.maintain()
    assert m.wait_io(10)
    assert json.loads((sdir / "s.json").read_text())["counters"]["stores_completed"] == 4
    m.check_integrity()
    m.shutdown()


def test_extra_config_keeps_ours_and_ignores_vllms():
    c = TieredConfig.from_extra(
        {"spec_name": "TieredOffloadingSpec", "host_bytes": 4096, "policy": "s3fifo",
         "offload_prompt_only": True}
    )
    assert (c.host_bytes, c.policy, c.disk_path) == (4096, "s3fifo", None)
    assert TieredConfig(host_bytes=4096).policy == DEFAULT_BLOCK_POLICY == "adaptive"  # ours by default


def test_bad_policy_error_lists_the_registered_names():
    with pytest.raises(ValueError) as err:
        TieredConfig(host_bytes=4096, policy="fifo")
    msg = str(err.value)
    assert "kv_connector_extra_config.policy" in msg
    for name in default_block_registry().names:
        assert name in msg


@pytest.mark.parametrize("name", default_block_registry().names)
def test_every_registered_block_policy_runs_the_manager(tmp_path, name):
    """Each registered policy drives both tiers; the manager's own table is gone."""
    gen = torch.Generator().manual_seed(20)
    m = make(tmp_path, slots=3, disk_pages=6, demote_headroom=2, policy=name)
    assert isinstance(m.index, BlockIndex) and not hasattr(m, "table")
    assert m.host_policy.name == name and m.disk_policy.name == name
    data = {}
    for i in range(0, 8, 2):
        data |= store(m, gen, [key(i), key(i + 1)], chained=True)
        assert m.wait_io(10)
        m.check_integrity()
    assert m.counters.demotions_ok > 0
    # every block still held returns the bytes stored, from host or via a promotion
    served = 0
    for k, page in data.items():
        r = m.lookup(k)
        if r is Lookup.PENDING:
            assert m.wait_io(10)
            r = m.lookup(k)
        if r is Lookup.HIT:
            (slot,) = m.prepare_load([k])
            assert torch.equal(loaded(m, slot), page)
            m.complete_load([k])
            served += 1
        m.check_integrity()
    assert served >= 3
    m.shutdown()


# ----------------------------------------------------------------------------- manager


def test_store_then_host_hit_and_load_pins(tmp_path):
    gen = torch.Generator().manual_seed(1)
    m = make(tmp_path, slots=4, policy="lru")  # admits every block
    assert m.lookup(key(1)) is Lookup.MISS
    d = m.prepare_store([key(1), key(2)])
    assert d is not None and d.keys_to_store == [key(1), key(2)]
    assert m.lookup(key(1)) is Lookup.PENDING  # being stored: not loadable yet
    with pytest.raises(ValueError, match="not loadable"):
        m.prepare_load([key(1)])
    m.complete_store(d.keys_to_store)
    m.check_integrity()
    assert m.lookup(key(1)) is Lookup.HIT
    slots = m.prepare_load([key(1)])
    assert slots == [d.slots[0]]
    m.check_integrity()
    # a pinned block is never evicted: fill the host and ask for more
    store(m, gen, [key(3), key(4)])
    assert m.prepare_store([key(5), key(6), key(7), key(8)]) is None  # only 3 are evictable
    m.check_integrity()
    assert m.block(key(1)).host is HostState.READY
    m.complete_load([key(1)])
    with pytest.raises(ValueError, match="no load in flight"):
        m.complete_load([key(1)])
    m.check_integrity()
    m.shutdown()


def test_cascade_to_disk_and_checked_promotion_returns_the_same_bytes(tmp_path):
    gen = torch.Generator().manual_seed(2)
    m = make(tmp_path, slots=4, disk_pages=16, demote_headroom=4, policy="lru")  # admits all
    data = {}
    for i in range(0, 12, 2):
        data |= store(m, gen, [key(i), key(i + 1)])
        m.maintain()
        assert m.wait_io(10)
        m.check_integrity()
    assert m.counters.demotions_ok >= 8
    disk_only = [k for k in m.keys() if m.block(k).host is HostState.NONE]
    assert disk_only, "nothing was pushed down to disk"
    k = disk_only[0]
    assert m.lookup(k) is Lookup.PENDING
    m.check_integrity()
    assert m.wait_io(10)
    assert m.lookup(k) is Lookup.HIT
    (slot,) = m.prepare_load([k])
    assert torch.equal(loaded(m, slot), data[k])  # the bytes stored, from disk
    assert m.counters.loads_from_disk == 1 and m.counters.loads_from_host == 0
    m.complete_load([k])
    m.check_integrity()
    m.shutdown()


def test_two_ranks_share_one_disk_page_and_each_gets_its_own_bytes_back(tmp_path):
    """Tensor parallelism: one slab per rank, one disk page per block holding every
    rank's part; a promotion hands each rank exactly its own bytes."""
    ranks, slot_bytes = 2, 128
    cfg = TieredConfig(host_bytes=2 * slot_bytes, disk_path=str(tmp_path / "d"),
                       disk_bytes=8 * slot_bytes * ranks, demote_headroom=2, policy="lru")
    slabs = [HostSlab(str(tmp_path / f"s{r}"), 2, slot_bytes) for r in range(ranks)]
    m = TieredBlockManager(cfg, slabs, open_disk(cfg, slot_bytes * ranks, "t"))
    assert m.page_bytes == slot_bytes * ranks
    gen = torch.Generator().manual_seed(33)
    data = {}
    for i in range(0, 6, 2):
        d = m.prepare_store([key(i), key(i + 1)])
        for k, slot in zip(d.keys_to_store, d.slots, strict=True):
            data[k] = [torch.randint(0, 256, (slot_bytes,), generator=gen, dtype=torch.uint8)
                       for _ in range(ranks)]
            land(m, d, slot, data[k])
        m.complete_store(d.keys_to_store)
        assert m.wait_io(10)
        m.check_integrity()
    for k, pages in data.items():
        r = m.lookup(k)
        if r is Lookup.PENDING:
            assert m.wait_io(10)
            r = m.lookup(k)
        assert r is Lookup.HIT
        (slot,) = m.prepare_load([k])
        for rank in range(ranks):
            assert torch.equal(slabs[rank].tensor[slot], pages[rank])
        m.complete_load([k])
        m.check_integrity()
    assert m.counters.loads_from_disk >= 4
    m.shutdown()


def test_block_damaged_on_disk_becomes_a_miss_and_is_never_served(tmp_path):
    gen = torch.Generator().manual_seed(3)
    m = make(tmp_path, slots=2, disk_pages=8, demote_headroom=2, policy="lru")  # admits all
    store(m, gen, [key(1), key(2)])
    m.maintain()
    assert m.wait_io(10)
    store(m, gen, [key(3), key(4)])  # evicts the clean copies of 1 and 2 from host
    assert m.wait_io(10)  # 3 and 4 are being written down: no slot is free until then
    assert m.block(key(1)).host is HostState.NONE and m.block(key(1)).disk is DiskState.READY
    state = m.state()
    entry = next(b for b in state["disk_blocks"] if b["key"] == key(1).hex())
    with open(os.path.join(state["disk_root"], SLOT_FILE_NAME), "r+b") as f:
        f.seek(entry["payload_offset"] + 7)
        b = f.read(1)
        f.seek(entry["payload_offset"] + 7)
        f.write(bytes([b[0] ^ 0x01]))
    assert m.lookup(key(1)) is Lookup.PENDING
    assert m.wait_io(10)
    assert m.lookup(key(1)) is Lookup.MISS  # detected: recompute, never a damaged load
    assert m.block(key(1)) is None and m.counters.promotions_failed == 1
    assert m.index.dropped["corrupt"] == 1
    m.check_integrity()
    # the undamaged neighbour still promotes fine (negative control for the check)
    assert m.lookup(key(2)) is Lookup.PENDING
    assert m.wait_io(10)
    assert m.lookup(key(2)) is Lookup.HIT
    m.check_integrity()
    m.shutdown()


def _damage(m: TieredBlockManager, k: bytes, at: int = 7) -> None:
    state = m.state()
    entry = next(b for b in state["disk_blocks"] if b["key"] == k.hex())
    with open(os.path.join(state["disk_root"], SLOT_FILE_NAME), "r+b") as f:
        f.seek(entry["payload_offset"] + at)
        b = f.read(1)
        f.seek(entry["payload_offset"] + at)
        f.write(bytes([b[0] ^ 0x01]))


def test_blocks_are_chained_after_the_parent_given_when_it_is_held(tmp_path):
    gen = torch.Generator().manual_seed(15)
    m = make(tmp_path, slots=6)
    store(m, gen, [key(1), key(2), key(3)], chained=True)
    assert [m.block(key(i)).parent for i in (1, 2, 3)] == [None, key(1), key(2)]
    assert [m.block(key(i)).depth for i in (1, 2, 3)] == [0, 1, 2]
    assert list(m.index.chain_keys(key(3))) == [key(1), key(2), key(3)]
    # a parent the index does not hold (on vLLM's GPU only, say) starts a new chain
    d = m.prepare_store([key(5)], [key(4)])
    m.complete_store(d.keys_to_store)
    assert m.block(key(5)).parent is None
    # the parent given is still storing when its child completes first: a root too
    d1 = m.prepare_store([key(6)])
    d2 = m.prepare_store([key(7)], [key(6)])
    m.complete_store(d2.keys_to_store)
    m.complete_store(d1.keys_to_store)
    assert m.block(key(7)).parent is None and m.block(key(6)).parent is None
    m.check_integrity()
    assert m.state()["index"]["chained"] == 2
    with pytest.raises(ValueError, match="parents"):
        m.prepare_store([key(8), key(9)], [None])
    assert m.block(key(8)) is None  # refused input changes nothing
    m.shutdown()


def test_evicting_a_host_only_block_drops_its_chain_deepest_first(tmp_path):
    gen = torch.Generator().manual_seed(16)
    m = make(tmp_path, slots=3, policy="lru")
    store(m, gen, [key(1), key(2)], chained=True)
    store(m, gen, [key(3)])
    d = m.prepare_store([key(4), key(5)])  # 1 free, 2 needed: the LRU block is key 1
    assert d is not None
    assert d.evicted == [key(2), key(1)]  # its child cannot be reached without it
    assert m.index.dropped["evicted"] == 1 and m.index.dropped["orphaned"] == 1
    assert m.counters.host_evictions == 1 and m.counters.dropped == 2
    m.complete_store(d.keys_to_store)
    assert m.lookup(key(2)) is Lookup.MISS and m.lookup(key(3)) is Lookup.HIT
    removed = [k for e in m.take_events() if e.removed for k in e.keys]
    assert set(removed) == {key(1), key(2)}
    m.check_integrity()
    m.shutdown()


@pytest.mark.parametrize("damaged", [(1,), (1, 2)])  # (1, 2): a lost block below a lost block
def test_a_damaged_block_with_a_busy_descendant_is_a_miss_then_dropped(tmp_path, damaged):
    gen = torch.Generator().manual_seed(17)
    m = make(tmp_path, slots=4, disk_pages=8, demote_headroom=4, policy="lru")
    data = store(m, gen, [key(1), key(2), key(3)], chained=True)
    assert m.wait_io(10)  # write-through: all three have a disk copy
    data |= store(m, gen, [key(4), key(5), key(6)])  # 1 free: the clean 1 and 2 leave host
    assert m.wait_io(10)
    assert [m.block(key(i)).host for i in (1, 2, 3)] == [
        HostState.NONE, HostState.NONE, HostState.READY]
    assert m.lookup(key(3)) is Lookup.HIT
    m.prepare_load([key(3)])  # a load of the chain's tail is in flight
    for i in damaged:
        _damage(m, key(i))
    for i in damaged:
        assert m.lookup(key(i)) is Lookup.PENDING
    assert m.wait_io(10)
    n = len(damaged)
    assert m.counters.promotions_failed == n and m.counters.drops_deferred == n
    for i in damaged:
        assert m.lookup(key(i)) is Lookup.MISS  # never served, though its drop must wait
    assert m.block(key(1)) is not None and m.block(key(3)).load_pins == 1
    with pytest.raises(ValueError, match="not loadable"):
        m.prepare_load([key(1)])
    m.check_integrity()
    m.complete_load([key(3)])
    m.maintain()  # the drop is retried now that nothing below it is busy
    assert [m.block(key(i)) for i in (1, 2, 3)] == [None, None, None]
    assert m.index.dropped["corrupt"] == 1 and m.index.dropped["orphaned"] == 2
    assert m.counters.dropped == 3 and not m._book.lost
    if m.lookup(key(4)) is Lookup.PENDING:  # it left host for the failed promotion's slot
        assert m.wait_io(10)
    assert m.lookup(key(4)) is Lookup.HIT  # a block outside the chain is untouched
    (slot,) = m.prepare_load([key(4)])
    assert torch.equal(loaded(m, slot), data[key(4)])
    m.complete_load([key(4)])
    m.check_integrity()
    m.shutdown()


def test_a_promoted_block_is_held_for_its_load_so_promotions_do_not_undo_each_other(tmp_path):
    from tiering.integrations.vllm._core import PROMOTED_HOLD_STEPS

    gen = torch.Generator().manual_seed(18)
    m = make(tmp_path, slots=2, disk_pages=8, demote_headroom=2, policy="lru")
    data = {}
    for pair in ((1, 2), (3, 4), (5, 6)):  # write-through; each pair pushes the last to disk
        data |= store(m, gen, [key(i) for i in pair])
        assert m.wait_io(10)
    assert [m.block(key(i)).host for i in (1, 2, 3)] == [HostState.NONE] * 3
    assert m.lookup(key(1)) is Lookup.PENDING and m.lookup(key(2)) is Lookup.PENDING
    assert m.wait_io(10)  # 1 and 2 are on host now, waiting for vLLM to ask again
    # a third request: no host slot, and the held promotions are not evicted; its block
    # is read (checked) into a row of the load staging file instead
    assert m.lookup(key(3)) is Lookup.PENDING
    assert m.counters.promotions_started == 2 and m.counters.direct_reads_started == 1
    assert m.lookup(key(1)) is Lookup.HIT and m.lookup(key(2)) is Lookup.HIT
    (slot,) = m.prepare_load([key(1)])
    assert torch.equal(loaded(m, slot), data[key(1)])
    m.complete_load([key(1)])  # loaded: an ordinary block again
    assert m.wait_io(10)
    assert m.lookup(key(3)) is Lookup.HIT  # from its row
    (row,) = m.prepare_load([key(3)])
    assert row >= m.num_slots and m.block(key(3)).host is HostState.NONE
    with open(f"{m.load_staging}.r0", "rb") as f:
        f.seek((row - m.num_slots) * PAGE)
        assert f.read(PAGE) == data[key(3)].numpy().tobytes()
    m.complete_load([key(3)])  # the row is free again
    assert not m.disk_reads.row_of and m.rows.free_pages == m.rows.num_pages
    assert m.block(key(2)).host is HostState.READY
    m.check_integrity()
    # the hold ends after PROMOTED_HOLD_STEPS steps even if nobody loads the block
    for _ in range(PROMOTED_HOLD_STEPS):
        m.maintain()
    assert m.lookup(key(4)) is Lookup.PENDING and m.counters.promotions_started == 3
    assert m.counters.promotions_unused == 1  # key 2: promoted, never loaded
    m.check_integrity()
    m.shutdown()


def test_the_promotion_hold_counts_scheduler_steps_not_store_completions(tmp_path):
    """complete_store counted as a scheduler step, so with many stores completing in
    one step a promoted block lost its hold after fewer than PROMOTED_HOLD_STEPS
    steps, and promotions for requests scheduled together undid each other again."""
    from tiering.integrations.vllm._core import PROMOTED_HOLD_STEPS

    gen = torch.Generator().manual_seed(31)
    m = make(tmp_path, slots=2, disk_pages=8, demote_headroom=2, policy="lru")
    for pair in ((1, 2), (3, 4), (5, 6)):
        store(m, gen, [key(i) for i in pair])
        assert m.wait_io(10)
    assert m.lookup(key(1)) is Lookup.PENDING and m.lookup(key(2)) is Lookup.PENDING
    assert m.wait_io(10)
    for _ in range(2 * PROMOTED_HOLD_STEPS):  # completions within one scheduler step
        m.complete_store([key(99)])  # (keys repeat across jobs: nothing in flight)
    assert m.lookup(key(3)) is Lookup.PENDING  # still held: no host slot, no eviction
    assert m.counters.promotions_started == 2 and m.counters.direct_reads_started == 1
    assert m.wait_io(10)  # key 3 waits in its staging row, held as long as a promotion
    assert m.lookup(key(1)) is Lookup.HIT and m.lookup(key(2)) is Lookup.HIT
    for _ in range(PROMOTED_HOLD_STEPS):  # real steps end the hold
        m.maintain()
    assert m.lookup(key(3)) is Lookup.PENDING and m.counters.promotions_started == 3
    m.check_integrity()
    m.shutdown()


def test_host_only_evicts_and_reports_evicted_keys(tmp_path):
    gen = torch.Generator().manual_seed(4)
    m = make(tmp_path, slots=2, policy="lru")
    store(m, gen, [key(1), key(2)])
    d = m.prepare_store([key(3)])
    assert d is not None and d.evicted == [key(1)]  # LRU
    m.complete_store(d.keys_to_store)
    assert m.lookup(key(1)) is Lookup.MISS
    ev = m.take_events()
    assert any(e.removed and key(1) in e.keys for e in ev)
    m.check_integrity()
    m.shutdown()


def test_full_disk_evicts_its_coldest_block_and_host_prefers_clean_victims(tmp_path):
    gen = torch.Generator().manual_seed(13)
    m = make(tmp_path, slots=2, disk_pages=2, demote_headroom=2, policy="lru")
    store(m, gen, [key(1)])
    assert m.wait_io(10)
    store(m, gen, [key(2)])
    assert m.wait_io(10)
    assert {k for k in m.keys() if m.block(k).disk is DiskState.READY} == {key(1), key(2)}
    d = m.prepare_store([key(3)])  # both host blocks are clean: the LRU one goes
    assert d is not None and d.evicted == []  # still on disk, so not gone
    m.complete_store(d.keys_to_store)
    assert m.wait_io(10)  # writing 3 down needs a disk slot: the disk's LRU (1) is dropped
    assert m.block(key(1)) is None and m.counters.disk_evictions == 1
    assert m.block(key(3)).disk is DiskState.READY
    assert m.lookup(key(1)) is Lookup.MISS
    m.check_integrity()
    m.shutdown()


def test_reset_forgets_idle_blocks_but_keeps_pinned_ones(tmp_path):
    gen = torch.Generator().manual_seed(14)
    m = make(tmp_path, slots=3, disk_pages=4, demote_headroom=3)
    store(m, gen, [key(1), key(2)])
    assert m.wait_io(10)
    m.prepare_load([key(1)])
    m.reset()
    m.check_integrity()
    assert set(m.keys()) == {key(1)} and m.block(key(1)).host is HostState.READY
    assert m.block(key(1)).disk is DiskState.NONE and m.disk.used_bytes() == 0
    m.complete_load([key(1)])
    m.check_integrity()
    m.shutdown()


class ManualExecutor:
    """Queues each job; ``run_all`` runs them (I/O held in flight as long as a test wants)."""

    def __init__(self):
        self.jobs: list[tuple[Future, object, tuple]] = []

    def submit(self, priority, fn, *args) -> Future:
        fut: Future = Future()
        self.jobs.append((fut, fn, args))
        return fut

    def run_all(self):
        jobs, self.jobs = self.jobs, []
        for fut, fn, args in jobs:
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # handed to the manager through the future
                fut.set_exception(exc)


def test_after_reset_no_block_from_before_is_loadable(tmp_path):
    """reset() kept a block with a load in flight (and one being promoted) loadable:
    after vLLM's reset_cache (a weight update, say) those stale bytes could be
    loaded. Now they answer miss at once and are dropped when their job ends."""
    from tiering.integrations.vllm._core import RESET_HOLD_STEPS

    gen = torch.Generator().manual_seed(27)
    ex = ManualExecutor()
    m = make(tmp_path, slots=3, disk_pages=8, demote_headroom=3, policy="lru", executor=ex)
    store(m, gen, [key(1), key(2)])
    ex.run_all()  # written down: both clean
    store(m, gen, [key(3), key(4)])  # 1 leaves host (it is on disk)
    ex.run_all()
    m.reap()
    assert m.block(key(1)).host is HostState.NONE
    assert m.lookup(key(1)) is Lookup.PENDING  # a promotion in flight (2 made room)
    assert m.block(key(1)).host is HostState.PROMOTING
    assert m.lookup(key(3)) is Lookup.HIT
    m.prepare_load([key(3)])  # a load in flight
    m.reset()
    m.check_integrity()
    assert m.lookup(key(3)) is Lookup.MISS and m.lookup(key(1)) is Lookup.MISS
    with pytest.raises(ValueError, match="not loadable"):
        m.prepare_load([key(3)])
    ex.run_all()  # the promotion lands
    m.maintain()
    assert m.lookup(key(1)) is Lookup.MISS and m.block(key(1)) is None
    m.check_integrity()
    m.complete_load([key(3)])  # the load ends: the block goes
    m.maintain()
    assert m.block(key(3)) is None and m.keys() == []
    assert m.index.dropped["reset"] == 4 and m.pool.free_pages == 3
    for _ in range(RESET_HOLD_STEPS):
        m.maintain()
    m.check_integrity()
    m.shutdown()


def test_stores_and_loads_in_flight_at_a_reset_are_taken_back_later(tmp_path):
    """vLLM never completes the jobs in flight at its reset_cache. A store in flight
    then stayed 'pending' for ever (a request using its block waited for ever) and
    its slot leaked; a load's pin leaked too. Now such a store answers miss, and
    RESET_HOLD_STEPS steps later every slot is free again."""
    from tiering.integrations.vllm._core import RESET_HOLD_STEPS

    gen = torch.Generator().manual_seed(28)
    m = make(tmp_path, slots=4, policy="lru")
    store(m, gen, [key(1)])
    m.prepare_load([key(1)])  # never completed
    d = m.prepare_store([key(2), key(3)])  # never completed
    assert d is not None and m.pool.free_pages == 1
    m.reset()
    m.check_integrity()
    for k in (key(1), key(2), key(3)):
        assert m.lookup(k) is Lookup.MISS  # not pending for ever
    m.complete_store([key(2)])  # a late completion inserts nothing
    assert m.block(key(2)) is None
    for step in range(RESET_HOLD_STEPS):
        assert m.pool.free_pages == 1, step  # the worker may still write these slots
        m.maintain()
        m.check_integrity()
    assert m.pool.free_pages == 4 and m.keys() == []
    again = store(m, gen, [key(2), key(3), key(4), key(5)])  # every slot is usable
    for k, page in again.items():
        assert m.lookup(k) is Lookup.HIT
        (slot,) = m.prepare_load([k])
        assert torch.equal(loaded(m, slot), page)
        m.complete_load([k])
    m.check_integrity()
    m.shutdown()


@pytest.mark.parametrize("breakage", ["pool", "policy", "pin", "disk copy"])
def test_check_integrity_catches_a_broken_manager(tmp_path, breakage):
    gen = torch.Generator().manual_seed(5)
    m = make(tmp_path, slots=3, disk_pages=4, demote_headroom=3)
    store(m, gen, [key(1), key(2)])
    assert m.wait_io(10)
    m.check_integrity()  # sound before the breakage
    slot = m.block(key(1)).slot
    if breakage == "pool":
        m.pool.release(key(1), [slot])  # the index still says key 1 holds it
        match = "host pool"
    elif breakage == "policy":
        m.host_policy.on_remove(key(2))
        match = "host policy"
    elif breakage == "pin":
        m.index.acquire(key(1))  # a pin no load or demotion accounts for
        match = "refs"
    else:
        m.disk_tier.copies[key(1)] = m.disk_tier.copies[key(2)]  # two blocks on one disk extent
        match = "held twice"
    with pytest.raises(TableIntegrityError, match=match):
        m.check_integrity()


def test_stats_delta_reports_increases_once(tmp_path):
    gen = torch.Generator().manual_seed(6)
    m = make(tmp_path, slots=2)
    store(m, gen, [key(1)])
    m.lookup(key(1))
    d = m.stats_delta()
    assert d["stores_completed"] == 1 and d["host_hits"] == 1
    assert m.stats_delta() == {}
    m.shutdown()


def _snapshot(m: TieredBlockManager):
    return ({k: m.block(k) for k in m.keys()}, m.pool.free_pages, dict(m.counters.__dict__),
            None if m.disk is None else m.disk.used_bytes())


def test_calls_after_shutdown_raise_and_the_disk_path_is_free_again(tmp_path):
    """After shutdown the manager took stores, loads and lookups as if open (and its
    disk tier stayed locked, so a new manager on the same path failed); now every
    changing call raises CacheClosed and changes nothing, and the path is free."""
    import threading

    from tiering.errors import CacheClosed

    gen = torch.Generator().manual_seed(23)
    before = set(threading.enumerate())
    m = make(tmp_path, slots=4, disk_pages=8, demote_headroom=4)
    store(m, gen, [key(1), key(2)])
    assert m.wait_io(10)
    with pytest.raises(ValueError, match="timeout"):
        m.shutdown(float("nan"))  # refused: nothing is shut down
    assert m.lookup(key(1)) is Lookup.HIT
    m.shutdown()
    snap = _snapshot(m)
    calls = {
        "lookup": lambda: m.lookup(key(1)),
        "prepare_store": lambda: m.prepare_store([key(9)]),
        "complete_store": lambda: m.complete_store([key(9)]),
        "prepare_load": lambda: m.prepare_load([key(1)]),
        "complete_load": lambda: m.complete_load([key(1)]),
        "touch": lambda: m.touch([key(1)]),
        "maintain": m.maintain,
        "reset": m.reset,
    }
    for name, call in calls.items():
        with pytest.raises(CacheClosed, match=f"{name}: the manager is shut down"):
            call()
    assert _snapshot(m) == snap
    m.check_integrity()
    m.shutdown()  # a second shutdown does nothing
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("tiering")]
    again = make(tmp_path, slots=4, disk_pages=8)  # the disk path is free again
    assert again.lookup(key(1)) is Lookup.MISS
    again.shutdown()


@pytest.mark.parametrize(
    "call, why",
    [
        (lambda m: m.lookup("abc"), "every key must be non-empty bytes"),
        (lambda m: m.lookup(5), "every key must be non-empty bytes"),
        (lambda m: m.lookup(b""), "every key must be non-empty bytes"),
        (lambda m: m.prepare_store(["abc"]), "every key must be non-empty bytes"),
        (lambda m: m.prepare_store("abc"), "keys must be a sequence"),
        (lambda m: m.prepare_store([key(3), bytearray(key(4))]), "every key"),
        (lambda m: m.prepare_load([key(1), "x"]), "every key"),
        (lambda m: m.complete_load([key(1), 7]), "every key"),
        (lambda m: m.complete_store([key(3)], success=None), "success must be a bool"),
        (lambda m: m.touch([None]), "every key"),
        (lambda m: m.wait_io(float("nan")), "timeout"),
    ],
)
def test_bad_keys_are_refused_and_change_nothing(tmp_path, call, why):
    """A str key was stored (and a str taken as a list of one-letter keys); now
    every call names the bad key and changes nothing."""
    gen = torch.Generator().manual_seed(24)
    m = make(tmp_path, slots=4, disk_pages=8, demote_headroom=4)
    store(m, gen, [key(1), key(2)])
    assert m.wait_io(10)
    (slot,) = m.prepare_load([key(1)])
    snap = _snapshot(m)
    with pytest.raises(ValueError, match=why):
        call(m)
    assert _snapshot(m) == snap
    m.check_integrity()
    m.complete_load([key(1)])
    m.check_integrity()
    m.shutdown()


def test_a_bad_parent_is_refused_before_finished_io_is_reaped(tmp_path):
    """prepare_store reaped finished I/O (here: demotions written down) before it found
    a parent that is not bytes; now the refusal comes first and changes nothing."""
    gen = torch.Generator().manual_seed(25)
    m = make(tmp_path, slots=4, disk_pages=8, demote_headroom=4)
    store(m, gen, [key(1), key(2)])  # their write-ahead to disk starts
    jobs = list(m.disk_tier.demoting.values())
    assert jobs
    for fut in jobs:
        fut.result(timeout=10)  # written, not reaped yet
    snap = _snapshot(m)
    assert m.block(key(1)).disk is DiskState.WRITING
    with pytest.raises(ValueError, match="parent of .* must be bytes or None"):
        m.prepare_store([key(3), key(4)], [None, "not a key"])
    assert _snapshot(m) == snap
    m.reap()  # the control: there was finished I/O to apply
    assert _snapshot(m) != snap and m.block(key(1)).disk is DiskState.READY
    m.check_integrity()
    m.shutdown()


@pytest.mark.parametrize("breakage", ["abandoned slot", "reset load", "reset load count"])
def test_check_integrity_catches_broken_reset_book_keeping(tmp_path, breakage):
    gen = torch.Generator().manual_seed(32)
    m = make(tmp_path, slots=4, policy="lru")
    store(m, gen, [key(1)])
    m.prepare_load([key(1)])
    d = m.prepare_store([key(2)])
    m.reset()
    m.check_integrity()  # sound before the breakage
    if breakage == "abandoned slot":
        m.pool.release(("reset", d.slots[0]), d.slots)  # freed while a worker may write it
        match = "host pool"
    elif breakage == "reset load":
        m.loads.reset_loads[key(7)] = (1, 0)  # a reset load nobody pins
        match = "before a reset"
    else:
        n, at = m.loads.reset_loads[key(1)]
        m.loads.reset_loads[key(1)] = (n + 1, at)  # more reset loads than the key has pins
        match = "2 load\\(s\\) from before a reset, 1 load pin"
    with pytest.raises(TableIntegrityError, match=match):
        m.check_integrity()


class ManagerMachine(RuleBasedStateMachine):
    """Random chained stores, lookups, loads, maintenance, resets and blocks damaged on
    disk, under every registered block policy; integrity after each step, and every
    load hands back exactly the bytes stored."""

    @initialize(policy=st.sampled_from(default_block_registry().names))
    def setup(self, policy):
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="tiering-vllm-sm-"))
        self.m = make(self.dir, slots=3, disk_pages=5, demote_headroom=2,
                      executor=InlineExecutor(), policy=policy)
        self.gen = torch.Generator().manual_seed(7)
        self.data: dict[bytes, torch.Tensor] = {}
        self.pending: list[list[bytes]] = []
        self.loads: list[list[bytes]] = []
        self.damaged: set[bytes] = set()
        self.flipped: set[tuple[bytes, int]] = set()  # (block, byte) flipped on disk

    @rule(ks=st.lists(st.integers(0, 9), min_size=1, max_size=3, unique=True),
          first_parent=st.none() | st.integers(0, 9), chained=st.booleans())
    def prepare_store(self, ks, first_parent, chained):
        keys = [key(i) for i in ks]
        parents = ([None if first_parent is None else key(first_parent), *keys[:-1]]
                   if chained else None)
        d = self.m.prepare_store(keys, parents)
        if d is not None:
            for k, s in zip(d.keys_to_store, d.slots, strict=True):
                page = torch.randint(0, 256, (PAGE,), generator=self.gen, dtype=torch.uint8)
                land(self.m, d, s, [page])
                self.data[k] = page
                self.damaged.discard(k)
                self.flipped = {f for f in self.flipped if f[0] != k}
            self.pending.append(d.keys_to_store)

    @precondition(lambda self: self.pending)
    @rule(ok=st.booleans())
    def complete_store(self, ok):
        self.m.complete_store(self.pending.pop(0), ok)

    @rule(pick=st.integers(0, 63), held=st.booleans(), again=st.booleans())
    def lookup_and_load(self, pick, held, again):
        keys = sorted(self.m.keys())
        k = keys[pick % len(keys)] if held and keys else key(pick % 10)
        r = self.m.lookup(k)
        if r is Lookup.PENDING and again:  # vLLM asks again on a later step
            self.m.reap()
            r = self.m.lookup(k)
        if r is Lookup.HIT:
            assert k not in self.damaged, "a block damaged on disk was reported loadable"
            (slot,) = self.m.prepare_load([k])
            # never a wrong byte: what a load would copy is what was stored
            assert torch.equal(loaded(self.m, slot), self.data[k])
            self.loads.append([k])

    @precondition(lambda self: self.loads)
    @rule()
    def complete_load(self):
        self.m.complete_load(self.loads.pop(0))

    @rule(pick=st.integers(0, 63), at=st.integers(0, PAGE - 1))
    def damage_on_disk(self, pick, at):
        """Flip a byte of a disk-only block's chunk in the slot file (not one being read:
        promoted, or read into a load staging row, whose checked bytes are kept)."""
        m = self.m
        cands = [x for x in m.state()["disk_blocks"] if not x["on_host"]
                 and m.block(k := bytes.fromhex(x["key"])).host is HostState.NONE
                 and k not in m.disk_reads.row_of and k not in m.disk_reads.row_jobs]
        if not cands:
            return
        entry = cands[pick % len(cands)]
        k = bytes.fromhex(entry["key"])
        if (k, at) in self.flipped:
            return  # flipping the same byte again would undo the damage
        self.flipped.add((k, at))
        path = os.path.join(self.m.disk_root, SLOT_FILE_NAME)
        with open(path, "r+b") as f:
            f.seek(entry["payload_offset"] + at)
            old = f.read(1)
            f.seek(entry["payload_offset"] + at)
            f.write(bytes([old[0] ^ 0xA5]))
        self.damaged.add(k)

    @rule()
    def maintain(self):
        self.m.maintain()

    @rule()
    def settle(self):
        assert self.m.wait_io(10)

    @rule()
    def reset(self):
        """Also with stores in flight (vLLM never completes those: a later completion
        must insert nothing); afterwards no block from before is loadable."""
        self.m.reset()
        assert set(self.m.keys()) <= {k for ks in self.loads for k in self.m.index.chain_keys(ks[0])}
        for k in self.m.keys():
            assert self.m.lookup(k) is Lookup.MISS

    @invariant()
    def integrity(self):
        self.m.check_integrity()
        d = self.m.index.dropped
        for name in ("corrupt", "orphaned", "evicted", "reset"):
            if d[name]:
                event(f"dropped {name}")
        if self.m._book.lost:
            event("drop deferred (a descendant busy)")
        if self.m.counters.loads_from_disk:
            event("loaded from disk")

    def teardown(self):
        self.m.shutdown()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def test_machine_rules_reach_the_disk_and_corruption_paths():
    """The machine's rules, driven by seeded random walks, reach every path the
    hypothesis run may only sample: loads from disk, damaged blocks dropped (with
    their descendants), deferred drops, disk evictions, stores straight to disk
    (completed and failed); integrity after each step."""
    import random

    rules = ManagerMachine
    seen: dict[str, int] = {}
    for seed in range(40):
        r = random.Random(seed)
        mm = ManagerMachine()
        rules.setup(mm, default_block_registry().names[seed % 4])
        for _ in range(50):
            c = r.randrange(8)
            if c == 0:
                rules.prepare_store(mm, r.sample(range(10), r.randint(1, 3)),
                                    r.choice([None, r.randrange(10)]), r.random() < 0.5)
            elif c == 1 and mm.pending:
                rules.complete_store(mm, r.random() < 0.85)
            elif c == 2:
                rules.lookup_and_load(mm, r.randrange(64), r.random() < 0.5, r.random() < 0.5)
            elif c == 3 and mm.loads:
                rules.complete_load(mm)
            elif c == 4:
                rules.damage_on_disk(mm, r.randrange(64), r.randrange(256))
            elif c == 5:
                rules.maintain(mm)
            elif c == 6:
                rules.settle(mm)
            elif c == 7 and r.random() < 0.2:
                rules.reset(mm)
            mm.m.check_integrity()
        for name, v in [*mm.m.counters.__dict__.items(), *mm.m.index.dropped.items()]:
            seen[name] = seen.get(name, 0) + (v > 0)
        mm.teardown()
    for name in ("loads_from_disk", "promotions_failed", "corrupt", "orphaned",
                 "disk_evictions", "demotions_ok", "host_evictions", "stores_staged",
                 "stores_staged_failed"):
        assert seen.get(name, 0) > 0, (name, seen)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("seed", range(6))
def test_disk_faults_never_hand_back_a_wrong_byte(tmp_path, seed):
    """Injected write failures (EIO, ENOSPC), read failures and rotted chunks under a
    random walk (I/O inline for even seeds, on threads for odd): every load hands
    back exactly the bytes stored, integrity holds after each step, and the faults
    surface as failed demotions and promotions."""
    import random

    from tiering.disk import DiskConfig, DiskPageStore
    from tiering.disk.faults import FaultPlan, FaultyStore

    plan = FaultPlan(seed)
    for kind, p in (("eio_write", 0.2), ("enospc_write", 0.1), ("eio_read", 0.15),
                    ("corrupt", 0.15)):
        plan.arm(kind, probability=p)
    cfg = TieredConfig(host_bytes=3 * PAGE, disk_path=str(tmp_path / "d"), disk_bytes=6 * PAGE,
                       demote_headroom=2, policy=default_block_registry().names[seed % 4])
    disk = DiskPageStore(
        DiskConfig(path=cfg.disk_path, capacity_bytes=cfg.disk_bytes, chunk_bytes=PAGE,
                   io_threads=1, io_timeout_s=10.0),
        (PAGE,), torch.uint8, fingerprint="t", wrap_store=lambda st: FaultyStore(st, plan))
    m = TieredBlockManager(cfg, [HostSlab(str(tmp_path / "slab"), 3, PAGE)], disk,
                           executor=InlineExecutor() if seed % 2 == 0 else None)
    r = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    data: dict[bytes, torch.Tensor] = {}
    pending: list[list[bytes]] = []
    loads: list[bytes] = []
    for _ in range(300):
        c = r.randrange(6)
        if c == 0:
            ks = [key(i) for i in r.sample(range(12), r.randint(1, 2))]
            d = m.prepare_store(ks, [None, *ks[:-1]])
            if d is not None:
                for k, slot in zip(d.keys_to_store, d.slots, strict=True):
                    page = torch.randint(0, 256, (PAGE,), generator=gen, dtype=torch.uint8)
                    land(m, d, slot, [page])
                    data[k] = page
                pending.append(d.keys_to_store)
        elif c == 1 and pending:
            m.complete_store(pending.pop(0), r.random() < 0.9)
        elif c == 2:
            k = key(r.randrange(12))
            if m.lookup(k) is Lookup.HIT:
                (slot,) = m.prepare_load([k])
                assert torch.equal(loaded(m, slot), data[k])
                loads.append(k)
        elif c == 3 and loads:
            m.complete_load([loads.pop(0)])
        elif c == 4:
            m.maintain()
        else:
            assert m.wait_io(10)
        m.check_integrity()
    injected = plan.injected
    assert sum(injected[k] for k in ("eio_write", "enospc_write")) > 0
    assert m.counters.demotions_failed > 0 and m.counters.loads_from_disk + m.counters.loads_from_host > 0
    if injected["eio_read"] + injected["corrupt"]:  # a promotion's or a direct load's read
        assert m.counters.promotions_failed + m.counters.direct_reads_failed > 0
    m.shutdown()


def test_slab_is_shared_and_its_name_goes_once_both_sides_mapped(tmp_path):
    gen = torch.Generator().manual_seed(12)
    path = str(tmp_path / "shared.slab")
    first = HostSlab(path, 4, 64)
    second = HostSlab(path, 4, 64)
    assert first.created and not second.created
    first.unlink_if_second()
    assert os.path.exists(path)  # the creator never removes it
    second.unlink_if_second()
    assert not os.path.exists(path)
    page = torch.randint(0, 256, (64,), generator=gen, dtype=torch.uint8)
    first.tensor[2].copy_(page)
    assert torch.equal(second.tensor[2], page)  # still one memory after the unlink
    live = HostSlab(str(tmp_path / "x.slab"), 2, 64)  # a live engine with this name
    with pytest.raises(ValueError, match="expected"):
        HostSlab(str(tmp_path / "x.slab"), 3, 64)
    live.close()
    for s in (first, second):
        s.close()
    assert os.listdir(tmp_path) == []


def test_a_leftover_slab_file_is_replaced_not_paired_with(tmp_path):
    """A slab file left by a process that died (same engine id) made the next manager
    take itself for the second side and remove the name, so its worker created a new
    file: two memories, and loads served bytes the manager never saw. A file that no
    live process holds is now replaced, and both sides share one memory."""
    gen = torch.Generator().manual_seed(25)
    path = str(tmp_path / "e.slab")
    with open(path, "wb") as f:  # the leftover: right size, nobody holds it
        f.write(torch.randint(0, 256, (4 * 64,), generator=gen, dtype=torch.uint8).numpy()
                .tobytes())
    manager = HostSlab(path, 4, 64)
    manager.unlink_if_second()
    worker = HostSlab(path, 4, 64)
    worker.unlink_if_second()
    assert manager.created and not worker.created
    page = torch.randint(0, 256, (64,), generator=gen, dtype=torch.uint8)
    worker.tensor[1].copy_(page)  # a worker's store ...
    assert torch.equal(manager.tensor[1], page)  # ... is what the manager demotes
    assert not os.path.exists(path)
    worker.close()
    manager.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("first_closes", ["creator", "second"])
def test_no_slab_file_is_left_after_shutdown(tmp_path, first_closes):
    """A creator whose partner never came (vLLM's worker, say, when the scheduler
    failed to start) left its file in /dev/shm; now close removes a name that still
    names the slab, and never a name that another slab has taken since."""
    path = str(tmp_path / "w.slab")
    alone = HostSlab(path, 2, 64)
    alone.close()
    assert not os.path.exists(path)
    a = HostSlab(path, 2, 64)
    b = HostSlab(path, 2, 64)
    (a if first_closes == "creator" else b).close()
    (b if first_closes == "creator" else a).close()
    assert os.listdir(tmp_path) == []
    old = HostSlab(path, 2, 64)
    os.unlink(path)
    newer = HostSlab(path, 2, 64)  # another engine took the name meanwhile
    old.close()
    assert os.path.exists(path)  # not ours any more: kept
    newer.close()
    assert os.listdir(tmp_path) == []


def test_slab_across_processes_pairs_with_a_live_side_and_not_a_dead_one(tmp_path):
    """Another process creates the slab and writes random bytes: while it lives we pair
    with it (one memory); once it has died without closing, its file is replaced."""
    import subprocess
    import sys

    path = str(tmp_path / "p.slab")
    code = (
        "import sys, torch\n"
        "from tiering.integrations.vllm._config import HostSlab\n"
        "s = HostSlab(sys.argv[1], 4, 64)\n"
        "g = torch.Generator().manual_seed(26)\n"
        "s.tensor.copy_(torch.randint(0, 256, (4, 64), generator=g, dtype=torch.uint8))\n"
        "print(s.created, flush=True)\n"
        "sys.stdin.readline()\n"  # stay alive until told
        "import os; os._exit(0)\n"  # die without closing: the file stays behind
    )
    def other_process():
        proc = subprocess.Popen([sys.executable, "-c", code, path], cwd=REPO, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == "True"  # it created the slab
        return proc

    def end(proc):
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0

    want = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(26),
                         dtype=torch.uint8)
    proc = other_process()
    try:
        peer = HostSlab(path, 4, 64)  # the other side is alive: one memory
        assert not peer.created and torch.equal(peer.tensor, want)
        peer.close()
        end(proc)
        proc = other_process()
        end(proc)  # died without closing: its file stays behind, nobody holds it
        assert os.path.exists(path)
        fresh = HostSlab(path, 4, 64)
        assert fresh.created  # replaced, not paired with the dead process's file
        assert not torch.equal(fresh.tensor, want)
        fresh.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert os.listdir(tmp_path) == []


def test_leftover_slab_files_of_dead_processes_are_swept(tmp_path):
    """Slab files of processes that died (nobody holds them) stayed in /dev/shm for
    ever; the sweep removes exactly those, never a live slab or another file."""
    from tiering.integrations.vllm._core import remove_leftover_slabs, slab_path

    dead = [slab_path(str(tmp_path), f"gone-{i}", 0) for i in range(3)]
    for p in dead:
        with open(p, "wb") as f:
            f.write(os.urandom(128))
    live = HostSlab(slab_path(str(tmp_path), "alive", 0), 2, 64)  # its partner is still to come
    other = tmp_path / "tiering-vllm-notes.txt"
    other.write_text("not a slab")
    assert sorted(remove_leftover_slabs(str(tmp_path))) == sorted(dead)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live.path), other.name])
    partner = HostSlab(live.path, 2, 64)  # still pairs with the live one
    assert not partner.created
    partner.close()
    live.close()
    assert os.listdir(tmp_path) == [other.name]
    assert remove_leftover_slabs(str(tmp_path / "missing")) == []


def test_slab_names_are_distinct_per_engine_and_rank():
    from tiering.integrations.vllm._core import slab_path

    ids = ["a/b", "a_b", "a b", "a\\b", "x" * 300, "x" * 301, "engine-1"]
    names = {slab_path("/d", e, r) for e in ids for r in (0, 1)}
    assert len(names) == 2 * len(ids)  # sanitising once mapped the first three to one file
    assert all(len(os.path.basename(n)) <= 255 for n in names)
    for bad in (-1, True, 1.0, "0"):
        with pytest.raises(ValueError, match="rank"):
            slab_path("/d", "e", bad)


def test_slab_bad_arguments_name_what_was_wrong(tmp_path):
    with pytest.raises(ValueError, match="num_slots must be an int"):
        HostSlab(str(tmp_path / "a"), True, 64)
    with pytest.raises(ValueError, match="slot_bytes must be an int"):
        HostSlab(str(tmp_path / "a"), 2, 0)
    with pytest.raises(ValueError, match="host_dir"):
        HostSlab(str(tmp_path / "missing" / "a"), 2, 64)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- worker side


def test_plan_blocks_maps_chunks_and_groups():
    # two groups; 2 blocks per offloaded chunk; group 0 starts mid-chunk
    plan = plan_blocks([10, 11, 12, 20, 21], [3, 2], [1, 0], [7, 3, 5], 2)
    assert plan == [(0, [10, 11, 12], [7 * 2 + 1, 3 * 2 + 0, 3 * 2 + 1]),
                    (1, [20, 21], [5 * 2 + 0, 5 * 2 + 1])]
    with pytest.raises(ValueError, match="host slots"):
        plan_blocks([1, 2], [2], [0], [4], 1)
    with pytest.raises(ValueError, match="host slots but"):
        plan_blocks([1, 2], [2], [0], [4, 5, 6], 1)


def _layers(gen, n_blocks, sizes):
    return [torch.randint(-128, 128, (n_blocks, s), generator=gen, dtype=torch.int8).view(torch.uint8)
            for s in sizes]


def _mover(tmp_path, gen, corrupt=False):
    sizes = [96, 160]
    layers = _layers(gen, 16, sizes)
    copies = (LayerCopy(layers[0], 0, 96), LayerCopy(layers[1], 96, 160))
    slab = HostSlab(str(tmp_path / "wslab"), 8, 256)
    return TieredMover([GroupLayout(copies, 256)], slab, 1, corrupt_loads=corrupt), layers


def _finish(mv, job):
    mv.wait({job}, timeout=10)
    res = mv.get_finished()
    assert [r.job_id for r in res] == [job] and res[0].success
    return res[0]


def test_mover_round_trip_store_then_load_is_exact(tmp_path):
    gen = torch.Generator().manual_seed(8)
    mv, layers = _mover(tmp_path, gen)
    src_blocks, slots = [3, 4, 5, 9], [2, 3, 4, 0]
    want = [t[src_blocks].clone() for t in layers]
    assert mv.submit(1, True, src_blocks, [4], [0], slots)
    r = _finish(mv, 1)
    assert r.nbytes == 4 * 256
    # the host page is the block across all layers, page-first
    assert torch.equal(mv.slab.tensor[2, :96], layers[0][3])
    assert torch.equal(mv.slab.tensor[2, 96:], layers[1][3])
    for t in layers:  # overwrite the device blocks, then load them back elsewhere
        t[:] = torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8)
    dst = [12, 13, 14, 1]
    assert mv.submit(2, False, dst, [4], [0], slots)
    _finish(mv, 2)
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t[dst], w)
    mv.shutdown()


def test_mover_negative_control_corrupt_loads_differ(tmp_path):
    gen = torch.Generator().manual_seed(9)
    mv, layers = _mover(tmp_path, gen, corrupt=True)
    want = [t[[0, 1]].clone() for t in layers]
    assert mv.submit(1, True, [0, 1], [2], [0], [0, 1])
    _finish(mv, 1)
    assert mv.submit(2, False, [5, 6], [2], [0], [0, 1])
    _finish(mv, 2)
    assert not torch.equal(layers[0][[5, 6]], want[0])
    mv.shutdown()


def test_mover_refuses_a_spec_that_does_not_add_up(tmp_path):
    gen = torch.Generator().manual_seed(10)
    mv, _ = _mover(tmp_path, gen)
    assert mv.submit(1, True, [0, 1], [2], [0], [0]) is False
    assert mv.get_finished() == []
    mv.shutdown()


@pytest.mark.parametrize(
    "spec, why",
    [
        ((1, True, [0], [1], [0], [8]), "host slot 8 is out of range"),  # past the slab
        ((1, True, [0], [1], [0], [-1]), "host slot must be an int >= 0"),  # wraps in torch
        ((1, False, [-1], [1], [0], [0]), "block id must be an int >= 0"),
        ((1, False, [16], [1], [0], [0]), "block id 16 of group 0 is out of range"),
        ((1, True, [0, 1], [1, 1], [0, 0], [0, 1]), "KV group 1 does not exist"),
        ((1, True, [0], [1], [0], [1.7]), "host slot must be an int"),
        ((1, True, [0], [-1, 2], [0, 0], [0]), "group size must be an int >= 0"),
        ((True, True, [0], [1], [0], [0]), "job id must be an int"),
    ],
)
def test_mover_refuses_a_spec_outside_the_slab_or_the_tensors(tmp_path, caplog, spec, why):
    """A spec pointing outside the slab or vLLM's tensors was copied (sliced away or
    wrapped to another row) and reported as a success; now it is refused, and not
    a byte of the slab or of vLLM's tensors changes."""
    gen = torch.Generator().manual_seed(21)
    mv, layers = _mover(tmp_path, gen)
    mv.slab.tensor.copy_(torch.randint(0, 256, mv.slab.tensor.shape, generator=gen,
                                       dtype=torch.uint8))
    before = [t.clone() for t in (mv.slab.tensor, *layers)]
    with caplog.at_level("ERROR"):
        assert mv.submit(*spec) is False
    assert why in caplog.text
    mv.wait({1}, timeout=10)
    assert mv.get_finished() == [] and mv.counters["refused"] == 1
    for t, b in zip((mv.slab.tensor, *layers), before, strict=True):
        assert torch.equal(t, b)
    assert mv.submit(2, True, [0], [1], [0], [0])  # a good spec still runs (control)
    _finish(mv, 2)
    assert torch.equal(mv.slab.tensor[0, :96], layers[0][0])
    mv.shutdown()


def test_mover_refuses_a_job_id_in_flight_and_jobs_after_shutdown(tmp_path):
    gen = torch.Generator().manual_seed(22)
    mv, layers = _mover(tmp_path, gen)
    assert mv.submit(5, True, [0], [1], [0], [0])
    # the same id before job 5 is reaped: its result would be lost (one result for two jobs)
    assert mv.submit(5, True, [1], [1], [0], [1]) is False
    mv.wait({5}, timeout=10)
    res = mv.get_finished()
    assert [r.job_id for r in res] == [5] and res[0].success
    assert torch.equal(mv.slab.tensor[0, :96], layers[0][0])
    with pytest.raises(ValueError, match="timeout"):
        mv.wait({5}, timeout=float("nan"))
    mv.shutdown()
    assert mv.submit(6, True, [0], [1], [0], [0]) is False  # refused, not an exception
    mv.shutdown()  # twice is fine
    with pytest.raises(ValueError, match="at least one KV group"):
        TieredMover([], mv.slab, 1)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        TieredMover(mv.groups, mv.slab, 0)
    with pytest.raises(ValueError, match="blocks_per_chunk"):
        plan_blocks([1], [1], [0], [0], 0)


# ----------------------------------------------------------------------------- layering


def test_nothing_outside_the_integration_imports_vllm():
    offenders = []
    for base in ("tiering", "resources", "policies", "benchmarks"):
        for p in (REPO / base).rglob("*.py"):
            rel = p.relative_to(REPO).as_posix()
            if rel.startswith("tiering/integrations/vllm/"):
                continue
            if base == "benchmarks" and p.name == "vllm_offload.py":
                continue  # the benchmark drives vLLM in child processes only
            tree = ast.parse(p.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n == "vllm" or n.startswith("vllm.") for n in names):
                    offenders.append(rel)
    assert offenders == []
    core = ast.parse((REPO / "tiering/integrations/vllm/_core.py").read_text())
    mods = {n.module for n in ast.walk(core) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m.startswith("vllm") for m in mods)


@pytest.mark.cuda
def test_mover_cuda_round_trip_on_copy_streams(tmp_path):
    gen = torch.Generator().manual_seed(11)
    host_layers = _layers(gen, 16, [96, 160])
    layers = [t.cuda() for t in host_layers]
    copies = (LayerCopy(layers[0], 0, 96), LayerCopy(layers[1], 96, 160))
    slab = HostSlab(str(tmp_path / "cslab"), 8, 256)
    mv = TieredMover([GroupLayout(copies, 256)], slab, 1)
    assert mv.streams.cuda
    want = [t[[2, 3, 7]].clone() for t in layers]
    assert mv.submit(1, True, [2, 3, 7], [3], [0], [5, 6, 1])
    _finish(mv, 1)
    for t in layers:  # overwrite with other random bytes before loading back
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    assert mv.submit(2, False, [9, 10, 11], [3], [0], [5, 6, 1])
    _finish(mv, 2)
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t[[9, 10, 11]], w)
    mv.shutdown()


# ----------------------------------------------------------------------------- small host, big disk


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make_clocked(tmp_path, slots, disk_pages, clock, executor=None, **cfg) -> TieredBlockManager:
    c = TieredConfig(host_bytes=slots * PAGE, disk_path=str(tmp_path / "disk"),
                     disk_bytes=disk_pages * PAGE, **cfg)
    slab = HostSlab(str(tmp_path / "slab"), slots, PAGE)
    return TieredBlockManager(c, [slab], open_disk(c, PAGE, "test"), disk_root=c.disk_path,
                              clock=clock, executor=executor)


def serve(m: TieredBlockManager, k: bytes) -> torch.Tensor | None:
    """A block's bytes as a load would see them (promoting it first), or None."""
    r = m.lookup(k)
    for _ in range(4):  # vLLM's next steps: demotions free a slot, the promotion lands
        if r is not Lookup.PENDING:
            break
        m.maintain()
        assert m.wait_io(10)
        r = m.lookup(k)
    if r is not Lookup.HIT:
        return None
    (slot,) = m.prepare_load([k])
    page = loaded(m, slot)
    m.complete_load([k])
    return page


def test_a_store_batch_larger_than_the_host_tier_goes_to_disk_and_is_served(tmp_path):
    """A 4-slot host tier and a 9-block batch: prepare_store was all or nothing
    over the host slots and answered None, so nothing was ever stored."""
    gen = torch.Generator().manual_seed(40)
    m = make(tmp_path, slots=4, disk_pages=64)
    keys = [key(i) for i in range(9)]
    data = store(m, gen, keys, chained=True)
    assert sorted(data) == sorted(keys)
    assert m.counters.stores_staged == 5 and m.counters.stores_refused == 0
    assert m.wait_io(10)
    m.check_integrity()
    assert [f for f in os.listdir(m.staging) if f.startswith("store-")] == [], "left behind"
    assert all(m.block(k) is not None for k in keys)
    buf = torch.empty((1, PAGE), dtype=torch.uint8)
    for k in keys[4:]:  # straight to disk: the bytes the worker staged, checked on read
        b = m.block(k)
        assert b.host is HostState.NONE and b.disk is DiskState.READY
        m.disk.read(b.extent, buf)
        assert torch.equal(buf[0], data[k]), k.hex()
    for k in keys[:4]:
        assert torch.equal(serve(m, k), data[k])
    # the chain is kept for the blocks that went straight to disk
    assert m.block(keys[8]).parent == keys[7]
    m.shutdown()
    assert not os.path.exists(m.staging)


def test_no_block_is_dropped_while_the_disk_tier_has_room(tmp_path):
    """With the default demote_headroom (a quarter of the host slots) a store batch
    evicted host blocks that had no disk copy yet: of 30 stores, 12 reached disk."""
    gen = torch.Generator().manual_seed(41)
    m = make(tmp_path, slots=9, disk_pages=64, policy="lru")  # the host admits every block
    data = {}
    for i in range(0, 30, 3):
        data |= store(m, gen, [key(i), key(i + 1), key(i + 2)], chained=True)
        m.maintain()  # one scheduler step per batch; the I/O may still be running
    assert m.wait_io(10)
    m.check_integrity()
    # how many host blocks had their disk copy by the next batch depends on the I/O
    # threads; once every copy has landed, the next batch must evict host blocks
    evicted = m.counters.host_evictions
    data |= store(m, gen, [key(30), key(31), key(32)], chained=True)
    m.maintain()
    assert m.wait_io(10)
    m.check_integrity()
    assert m.counters.dropped == 0 and m.counters.host_evictions > evicted
    assert len(m.index) == 33
    for k, page in data.items():
        assert torch.equal(serve(m, k), page)
    m.shutdown()


def test_a_refused_store_is_counted_logged_once_and_marks_the_state_changed(tmp_path, caplog):
    """A refusal did not mark the state changed: the state file kept its first
    all-zero counters, and nothing was logged."""
    import json

    gen = torch.Generator().manual_seed(42)
    sp = tmp_path / "state.json"
    m = make(tmp_path, slots=2, state_path=str(sp), policy="lru")
    store(m, gen, [key(1), key(2)])
    m.prepare_load([key(1), key(2)])  # every slot pinned by a load in flight
    m.maintain()
    assert m.wait_io(10)
    with caplog.at_level("WARNING", logger="tiering.integrations.vllm._core"):
        assert m.prepare_store([key(3)]) is None
        m.maintain()
        assert m.wait_io(10)
        assert json.loads(sp.read_text())["counters"]["stores_refused"] == 1
        assert m.prepare_store([key(4)]) is None
        m.maintain()
        assert m.wait_io(10)
    assert json.loads(sp.read_text())["counters"]["stores_refused"] == 2
    assert caplog.text.count("was refused") == 1
    m.complete_load([key(1), key(2)])
    assert m.prepare_store([key(3)]) is not None  # room again: accepted, the log re-armed
    m.check_integrity()
    m.shutdown()


def test_a_prefix_longer_than_the_host_tier_is_served_whole_the_rest_straight_from_disk(
        tmp_path):
    """A prefix on disk longer than the host tier: each pending key promoted one
    block, the promotions held every slot, and the request waited for ever. Now the
    blocks that find no host slot are read (checked) into load staging rows."""
    from tiering.integrations.vllm._core import LoadWindow

    gen = torch.Generator().manual_seed(43)
    clock = Clock()
    m = make_clocked(tmp_path, 4, 64, clock)
    keys = [key(i) for i in range(9)]
    data = store(m, gen, keys, chained=True)
    assert m.wait_io(10)
    for k in keys:  # push every block down to disk only
        if m.block(k).host is HostState.READY:
            m.cascade.evict_clean_host_copy(k)
    m.check_integrity()
    w = LoadWindow()
    answers = []
    for _ in range(5):  # vLLM's passes: from the first key until a miss
        answers = []
        for k in keys:
            r = m.lookup(k, w)
            answers.append(r)
            if r is Lookup.MISS:
                break
        if Lookup.PENDING not in answers:
            break
        assert m.wait_io(10)
        m.maintain()
    assert answers == [Lookup.HIT] * 9, answers
    assert m.counters.promotions_ok == 4 and m.counters.direct_reads_started == 5
    slots = m.prepare_load(keys)  # the load vLLM then makes: 4 host slots, 5 staging rows
    assert sum(s >= m.num_slots for s in slots) == 5
    m.check_integrity()
    for k, s in zip(keys, slots, strict=True):
        assert torch.equal(loaded(m, s), data[k])
    m.complete_load(keys)
    assert m.rows.free_pages == m.rows.num_pages and m.counters.loads_from_disk == 9
    m.check_integrity()
    m.shutdown()


def test_a_request_that_waits_past_load_wait_s_gets_a_miss(tmp_path):
    """Without a bound, a request whose blocks could not be promoted answered
    pending at every step for as long as that lasted. Here every host slot is
    pinned and the disk read of the block does not finish (a slow disk)."""
    from tiering.integrations.vllm._core import LoadWindow

    gen = torch.Generator().manual_seed(44)
    clock = Clock()
    ex = ManualExecutor()
    m = make_clocked(tmp_path, 2, 16, clock, executor=ex, load_wait_s=3.0, policy="lru")
    store(m, gen, [key(1), key(2), key(3)])  # two on host, one straight to disk
    for _ in range(2):
        m.maintain()
        ex.run_all()
    m.reap()
    on_host = [k for k in (key(1), key(2), key(3)) if m.block(k).host is HostState.READY]
    (on_disk,) = [k for k in (key(1), key(2), key(3)) if k not in on_host]
    assert m.block(on_disk).disk is DiskState.READY
    m.prepare_load(on_host)  # both slots pinned: nothing can be promoted
    w = LoadWindow()
    assert m.lookup(on_disk, w) is Lookup.PENDING
    clock.t += 2.9
    assert m.lookup(on_disk, w) is Lookup.PENDING  # a new pass, still within the bound
    clock.t += 0.2
    assert m.lookup(on_disk, w) is Lookup.MISS  # past it: vLLM recomputes
    assert m.counters.lookups_timed_out == 1 and m.counters.direct_reads_started == 1
    assert m.lookup(on_disk) is Lookup.PENDING  # another request's wait starts afresh
    ex.run_all()  # the read ends at last
    m.complete_load(on_host)
    assert m.lookup(on_disk) is Lookup.HIT
    m.check_integrity()
    m.shutdown()


def test_a_misspelt_key_of_ours_raises_listing_the_known_keys(caplog):
    """`demote_headrom` was accepted silently (and changed what was kept)."""
    from tiering.integrations.vllm._core import OUR_KEYS

    with pytest.raises(ValueError) as err:
        TieredConfig.from_extra({"host_bytes": 4096, "demote_headrom": 4})
    msg = str(err.value)
    assert "'demote_headrom'" in msg
    for k in OUR_KEYS:
        assert k in msg
    with pytest.raises(ValueError, match="'host_byte'"):
        TieredConfig.from_extra({"host_byte": 4096})
    # vLLM's keys, and keys far from ours, are vLLM's business
    with caplog.at_level("WARNING"):
        c = TieredConfig.from_extra({"host_bytes": 4096, "spec_name": "TieredOffloadingSpec",
                                     "blocks_per_chunk": 2, "some_future_vllm_flag": 1})
    assert c.host_bytes == 4096 and "some_future_vllm_flag" in caplog.text


def test_mover_stages_blocks_past_the_slab_into_a_file_laid_out_as_slots(tmp_path):
    gen = torch.Generator().manual_seed(45)
    mv, layers = _mover(tmp_path, gen)
    n = mv.slab.num_slots
    blocks = [3, 4, 5, 9]
    slots = [1, n, n + 1, n + 20]  # one host slot, three staged rows (one past a piece)
    staging = str(tmp_path / "store-1")
    assert not mv.submit(1, True, blocks, [4], [0], slots)  # past the slab without staging
    assert mv.submit(1, True, blocks, [4], [0], slots, staging)
    _finish(mv, 1)
    raw = torch.frombuffer(bytearray(open(staging + ".r0", "rb").read()), dtype=torch.uint8)
    rows = raw.view(-1, 256)
    for b, row in ((4, 0), (5, 1), (9, 20)):
        assert torch.equal(rows[row, :96], layers[0][b])
        assert torch.equal(rows[row, 96:], layers[1][b])
    assert torch.equal(mv.slab.tensor[1, :96], layers[0][3])
    want = [t[blocks].clone() for t in layers]
    for t in layers:  # other bytes in vLLM's blocks, then load the same slots back elsewhere
        t[:] = torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8)
    dst = [0, 7, 8, 15]
    assert mv.submit(2, False, dst, [4], [0], slots, staging)
    _finish(mv, 2)
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t[dst], w)
    # the worker keeps a load staging file open and removes its name: nothing is left
    # behind even if the engine's processes are killed rather than shut down
    assert not os.path.exists(staging + ".r0")
    assert mv.submit(3, False, dst, [4], [0], slots, staging)  # still readable
    _finish(mv, 3)
    mv.shutdown()


# ----------------------------------------------------------------------------- shared tier


class FakeShared:
    """An in-memory stand-in for ``tiering.coldtier.SharedBlockStore`` (publish/fetch)."""

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}
        self.down = False
        self.fetched: list[bytes] = []

    def publish(self, key, payload):
        from tiering.coldtier import BlockResult, BlockStatus

        if self.down:
            return BlockResult("publish", key, BlockStatus.UNAVAILABLE, reason="down")
        dup = key in self.objects
        self.objects.setdefault(key, bytes(payload))
        return BlockResult("publish", key, BlockStatus.DUPLICATE if dup else BlockStatus.WRITTEN)

    def fetch(self, key):
        from tiering.coldtier import BlockResult, BlockStatus

        self.fetched.append(key)
        if self.down:
            return BlockResult("fetch", key, BlockStatus.UNAVAILABLE, reason="down")
        if key not in self.objects:
            return BlockResult("fetch", key, BlockStatus.LOST, reason="missing")
        return BlockResult("fetch", key, BlockStatus.HIT, payload=self.objects[key])


def make_shared(path, shared, slots=4, disk_pages=32) -> TieredBlockManager:
    path.mkdir()
    c = TieredConfig(host_bytes=slots * PAGE, disk_path=str(path / "disk"),
                     disk_bytes=disk_pages * PAGE)
    slab = HostSlab(str(path / "slab"), slots, PAGE)
    return TieredBlockManager(c, [slab], open_disk(c, PAGE, "test"), disk_root=c.disk_path,
                              shared=shared)


def test_a_second_engine_loads_what_the_first_published_to_the_shared_tier(tmp_path):
    from tiering.integrations.vllm._core import LoadWindow

    gen = torch.Generator().manual_seed(50)
    shared = FakeShared()
    a = make_shared(tmp_path / "a", shared)
    keys = [key(i) for i in range(6)]
    data = store(a, gen, keys, chained=True)  # 4 on host (written through), 2 straight to disk
    a.maintain()
    assert a.wait_io(10)
    assert a.counters.shared_published == 6 and set(shared.objects) == set(keys)
    a.shutdown()
    b = make_shared(tmp_path / "b", shared)
    w = LoadWindow()
    for _ in range(6):  # vLLM's passes over the prefix until nothing is pending
        answers = [b.lookup(k, w) for k in keys]
        if Lookup.PENDING not in answers:
            break
        assert b.wait_io(10)
        b.maintain()
        b.check_integrity()
    assert answers == [Lookup.HIT] * 6, answers
    assert b.counters.shared_hits == 6 and b.counters.shared_misses == 0
    slots = b.prepare_load(keys)
    for k, s in zip(keys, slots, strict=True):  # checked on the way: the stored bytes
        assert torch.equal(loaded(b, s), data[k])
    b.complete_load(keys)
    assert b.counters.loads_from_disk == 6
    b.check_integrity()
    # negative control: a block the shared tier refuses (or lacks) is a miss, not served
    lone = key(99)
    assert b.lookup(lone) is Lookup.PENDING
    assert b.wait_io(10)
    assert b.lookup(lone) is Lookup.MISS and b.counters.shared_misses == 1
    n = len(shared.fetched)
    assert b.lookup(lone) is Lookup.MISS and len(shared.fetched) == n  # not asked again soon
    b.shutdown()


def test_a_shared_tier_that_does_not_answer_is_a_miss_and_never_blocks_a_store(tmp_path):
    gen = torch.Generator().manual_seed(51)
    shared = FakeShared()
    shared.down = True
    m = make_shared(tmp_path / "m", shared)
    data = store(m, gen, [key(1), key(2)])
    m.maintain()
    assert m.wait_io(10)
    assert m.counters.shared_publish_failed == 2 and m.counters.demotions_ok == 2
    assert m.lookup(key(7)) is Lookup.PENDING
    assert m.wait_io(10)
    assert m.lookup(key(7)) is Lookup.MISS and m.counters.shared_unavailable == 1
    assert torch.equal(serve(m, key(1)), data[key(1)])  # local blocks unaffected
    m.check_integrity()
    m.shutdown()


def test_shared_option_is_checked_naming_what_is_wrong(tmp_path):
    base = dict(host_bytes=4096, disk_path=str(tmp_path / "d"), disk_bytes=1 << 20)
    for shared, why in [
        ({"url": "s3://b/p", "secert": "x"}, "unknown key"),
        ({"url": "http://b/p", "trust": "unauthenticated"}, "shared.url"),
        ({"url": "s3://bucket", "trust": "unauthenticated"}, "bucket root"),
        ({"url": "s3://b/p", "trust": "nobody"}, "trust"),
        ("s3://b/p", "must be a mapping"),
    ]:
        with pytest.raises(ValueError, match=why):
            TieredConfig.from_extra(dict(base, shared=shared))
    with pytest.raises(ValueError, match="needs the disk tier"):
        TieredConfig.from_extra({"host_bytes": 4096,
                                 "shared": {"url": "s3://b/p", "trust": "unauthenticated"}})
    c = TieredConfig.from_extra(dict(base, shared={"url": "s3://b/p", "secret": "s" * 32}))
    assert c.shared_config().url == "s3://b/p"


# ----------------------------------------------------------------------------- one set of rules


class _Req:
    """A request's object for the manager (``request=``): told once."""


class _Tick:
    """One clock both stores read: each call a little later."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t


def _host_tier_sequence(seed: int, n: int = 48) -> list[tuple[int, int]]:
    """(chain, blocks): a seeded run of requests, each reading ``blocks`` leading blocks
    of chain ``chain``; about a third reread a chain seen before (whole or a prefix)."""
    r = __import__("random").Random(seed)
    out: list[tuple[int, int]] = []
    lengths: list[int] = []
    for _ in range(n):
        if lengths and r.random() < 0.35:
            c = r.randrange(len(lengths))
            out.append((c, r.randint(1, lengths[c])))
        else:
            lengths.append(r.randint(1, 3))
            out.append((len(lengths) - 1, lengths[-1]))
    return out


def _cache_decisions(tmp_path, policy, seq, host, disk, seed):
    """The real cache's ``PrefixCache`` on ``seq``: each request publishes its blocks on
    the device, is removed, and its new blocks move down to the host root first (the
    host tier's arrivals, as vLLM stores them). Returns (the decision log, the keys of
    each request, the final host and disk keys)."""
    from conftest import write_random
    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    from tiering.blocks import KeyRoot
    from tiering.disk import DiskConfig
    from tiering.types import Tier

    geom = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4)
    T = geom.page_tokens
    gen = torch.Generator().manual_seed(seed)
    dcfg = None
    if disk:
        dcfg = DiskConfig(path=str(tmp_path / "cache-disk"), capacity_bytes=disk * geom.page_bytes,
                          chunk_bytes=geom.page_bytes)
    kv = PagedKVCache(geom, "cpu", 32, host, disk=dcfg, clock=_Tick())
    assert kv.enable_prefix_cache(KeyRoot(geom.fingerprint(), "m", page_tokens=T), policy=policy,
                                  disk_batch_pages=1)
    pc = kv._prefix
    log: list[tuple] = []

    on_host: set = set()

    def watch(kind, k, tier):
        if kind == "publish" or (kind in ("drop", "orphan") and tier is Tier.DEVICE):
            return  # the device tier is vLLM's in the manager
        if kind == "move" and tier is Tier.HOST:
            on_host.add(k)
            log.append(("arrive", k))
        elif kind == "move" and tier is Tier.DISK and k not in on_host:
            log.append(("arrive", k, Tier.DISK))  # a device victim straight to disk
        else:
            on_host.discard(k)
            log.append((kind, k, tier))

    pc.rules.watch = watch
    chains: dict[int, torch.Tensor] = {}
    requests = []
    for i, (c, n) in enumerate(seq):
        if c not in chains:
            chains[c] = torch.randint(0, 1000, (3 * T,), generator=gen, dtype=torch.long)
        ids = chains[c][:n * T]
        keys = pc.keys(ids)
        # the cache publishes up to the first block it holds (off the device: all of them)
        new = next((j for j, k in enumerate(keys) if k in pc.index), len(keys))
        requests.append((keys, new))
        rid = f"r{i}"
        kv.ingest_request(rid)
        write_random(kv, rid, gen, n * T)
        kv.publish_prefix(rid, ids[:T])  # told at its first publish: the first block
        kv.publish_prefix(rid, ids)
        kv.remove_request(rid)
        down = pc.moves.room.demote  # the cache's eviction path
        for k in keys[:new]:
            loc = pc.index.location(k)
            if loc is not None and loc.tier is Tier.DEVICE:
                down(k)
        kv.check_integrity()
    final = ({k for k in pc.index.keys() if pc.index.location(k).tier is Tier.HOST},
             {k for k in pc.index.keys() if pc.index.location(k).tier is Tier.DISK})
    caps = {t: getattr(p, "capacity", None) for t, p in pc.policies.items()}
    kv.close()
    return log, requests, final, caps


def _manager_decisions(tmp_path, policy, requests, host, disk, tell_once=True):
    """The manager on the same requests: each one's new blocks stored one batch each,
    root first (a block not stored ends its chain: in one batch the manager skips the
    rest itself)."""
    from tiering.types import Tier

    m = make(tmp_path, slots=host, disk_pages=disk, executor=InlineExecutor(),
             demote_headroom=host if disk else None, policy=policy)
    m.clock = _Tick()
    log: list[tuple] = []
    def watch(kind, k, tier):
        if not (kind == "hit" and tier is Tier.DEVICE):  # vLLM's own hits, above a batch
            log.append((kind, k, tier))

    m.rules.watch = watch
    for keys, new in requests:
        req = _Req() if tell_once else None
        for j in range(max(1, new)):  # a request holding its first block is told all the same
            d = m.prepare_store([keys[j]], [keys[j - 1] if j else None], request=req)
            assert d is not None
            for slot in d.slots:  # the worker writes each block: a host slot or a staged row
                land(m, d, slot, [torch.randint(0, 256, (PAGE,), dtype=torch.uint8)])
            m.complete_store(d.keys_to_store)
            for k in d.keys_to_store:
                if k in m.index:
                    on_disk = m.index.location(k).tier is Tier.DISK
                    log.append(("arrive", k, Tier.DISK) if on_disk else ("arrive", k))
            if keys[j] not in m.index:
                break
        m.check_integrity()
    final = ({k for k in m.index.keys() if m.index.location(k).tier is Tier.HOST},
             {k for k in m.index.keys() if m.index.location(k).tier is Tier.DISK})
    caps = {t: getattr(p, "capacity", None) for t, p in m.rules.policies.items()}
    assert m.counters.disk_evictions == 0  # the disk is roomy (see the test below)
    m.shutdown()
    return log, final, caps


@pytest.mark.parametrize("disk", [0, 256], ids=["host-only", "with-disk"])
@pytest.mark.parametrize("policy", default_block_registry().names)
def test_the_manager_and_the_cache_take_the_same_block_decisions(tmp_path, policy, disk):
    """The same seeded run of host-tier events (requests told, blocks arriving from the
    tier above, room made for them, victims moved down or dropped) through the real
    cache's PrefixCache and through the manager: the same admissions, refusals, victims,
    moves and drops in the same order, and the same blocks left on each tier. The
    sequence has no host hit (a hit in the cache moves the block up to the device, in
    vLLM it stays on the host) and the disk never fills (the manager makes disk room
    when it writes a copy ahead, the cache when a block moves down)."""
    host = 4
    seq = _host_tier_sequence(7)
    clog, requests, cfinal, ccaps = _cache_decisions(tmp_path, policy, seq, host, disk, 7)
    mlog, mfinal, mcaps = _manager_decisions(tmp_path, policy, requests, host, disk)
    assert ccaps[Tier.HOST] == mcaps[Tier.HOST] and (policy == "lru" or mcaps[Tier.HOST] == host)
    assert not disk or ccaps[Tier.DISK] == mcaps[Tier.DISK]  # each policy sized by its tier
    kinds = {e[0] for e in clog}
    assert {"arrive", "move" if disk else "drop"} <= kinds, kinds  # the host was full
    assert mlog == clog
    assert mfinal == cfinal


@pytest.mark.parametrize("disk", [0, 256], ids=["host-only", "with-disk"])
def test_the_same_decisions_need_the_same_calls_negative_control(tmp_path, disk):
    """The comparison above can fail: told at every store batch (as the manager told its
    policies before, not once per request), the policies that learn from requests
    decide otherwise; and a manager under another policy does too."""
    seq = _host_tier_sequence(7)
    # (the default is not: on this short sequence it decides the same either way; LRU,
    # its first leader, learns nothing from requests)
    for policy in ("chain",):
        clog, requests, cfinal, _ = _cache_decisions(tmp_path, policy, seq, 4, disk, 7)
        assert any(e[0] == "refuse" for e in clog)  # its admission was asked and said no
        mlog, mfinal, _ = _manager_decisions(tmp_path, policy, requests, 4, disk,
                                             tell_once=False)
        assert mlog != clog and mlog[:5] == clog[:5]
    clog, requests, _, _ = _cache_decisions(tmp_path, "s3fifo", seq, 4, disk, 7)
    mlog, _, _ = _manager_decisions(tmp_path, "lru", requests, 4, disk)
    assert mlog != clog


class _Judging:
    """An lru policy that records what it is asked and told, refusing ``refuse`` (None:
    every block) at ``admit``."""

    def __new__(cls, capacity, refuse=()):
        from tiering.policies.blocks import LRUBlocks

        class Judging(LRUBlocks):
            def admit(self, key, depth, now):
                self.asked.append((key, depth))
                return refuse is not None and key not in refuse

            def on_request(self, keys, now):
                self.told.append(tuple(keys))

        p = Judging(capacity)
        p.asked, p.told = [], []
        return p


def _judged(m: TieredBlockManager, tier, refuse=()):
    """Put a fresh ``_Judging`` policy on ``tier`` of an empty manager (the rules' table)."""
    assert len(m.index) == 0
    p = _Judging(8, refuse)
    m.rules.policies[tier] = p
    assert (m.host_policy if tier is Tier.HOST else m.disk_policy) is p
    return p


@pytest.mark.parametrize("disk_admits", [True, False], ids=["to-disk", "no-tier-admits"])
def test_a_block_the_host_policy_refuses_goes_to_disk_when_the_disk_policy_admits_it(
        tmp_path, disk_admits):
    """A block the host's policy refused was not stored even with a disk tier that had
    room: a default policy that refuses deep blocks on a full host lost every prefix
    longer than the host to recompute. It now goes straight to disk when the disk's
    policy admits it (and is served from there, bitwise); refused by both, it is not
    stored, nor the rest of its chain in the batch."""
    gen = torch.Generator().manual_seed(50)
    m = make(tmp_path, slots=4, disk_pages=8, executor=InlineExecutor(), policy="lru")
    host = _judged(m, Tier.HOST, refuse={key(2)})
    disk = _judged(m, Tier.DISK, refuse=() if disk_admits else {key(2)})
    data = store(m, gen, [key(1), key(2), key(3)], chained=True)
    assert host.asked[:2] == [(key(1), 0), (key(2), 1)]
    assert disk.asked == [(key(2), 1)]  # asked only for the block the host refused
    if not disk_admits:
        assert list(data) == [key(1)]  # a refusal by every tier stops the rest of its chain
        assert m.counters.stores_not_admitted == 1 and key(2) not in m.index
        assert key(3) not in m.index
        m.shutdown()
        return
    assert list(data) == [key(1), key(3), key(2)]  # host slots first, then the staged one
    assert m.counters.stores_not_admitted == 0 and m.counters.stores_staged == 1
    assert m.wait_io(10)
    assert m.block(key(2)).disk is DiskState.READY and m.block(key(2)).host is HostState.NONE
    assert m.block(key(3)).host is HostState.READY
    r = m.lookup(key(2))
    if r is Lookup.PENDING:
        assert m.wait_io(10)
        r = m.lookup(key(2))
    assert r is Lookup.HIT
    (slot,) = m.prepare_load([key(2)])
    assert torch.equal(loaded(m, slot), data[key(2)])  # the bytes stored, from disk
    assert m.counters.loads_from_disk == 1
    m.complete_load([key(2)])
    m.check_integrity()
    m.shutdown()


@pytest.mark.parametrize("admit", [False, True], ids=["refused", "control"])
def test_a_host_victim_the_disk_policy_refuses_is_dropped_not_moved(tmp_path, admit):
    """The disk's policy was asked when a block was written down, and a refused block
    stayed on the host for ever (never a victim); now it is asked when the block leaves
    the host, as in the cache: refused, it is dropped; admitted (the control), it moves."""
    gen = torch.Generator().manual_seed(51)
    m = make(tmp_path, slots=2, disk_pages=8, executor=InlineExecutor(), demote_headroom=2,
             policy="lru")
    disk = _judged(m, Tier.DISK, refuse=() if admit else None)
    store(m, gen, [key(1), key(2)])
    assert m.wait_io(10) and m.disk_tier.copies.keys() == {key(1), key(2)}  # written ahead
    assert disk.asked == []  # a copy is no decision
    store(m, gen, [key(3)])  # the host is full: its lru victim leaves
    assert disk.asked == [(key(1), 0)]
    if admit:
        assert m.block(key(1)).host is HostState.NONE and m.block(key(1)).disk is DiskState.READY
        assert key(1) in disk and m.counters.demotions_not_admitted == 0
    else:
        assert key(1) not in m.index and m.counters.demotions_not_admitted == 1
        assert m.counters.dropped == 1
    m.check_integrity()
    m.shutdown()


def test_each_tier_policy_is_told_a_request_once_not_once_per_batch(tmp_path):
    """Each store batch and each load batch was a request of its own to the policies."""
    gen = torch.Generator().manual_seed(52)
    m = make(tmp_path, slots=4, disk_pages=8, executor=InlineExecutor())
    pols = {t: _judged(m, t) for t in (Tier.HOST, Tier.DISK)}
    req = _Req()
    for i in range(3):
        d = m.prepare_store([key(i)], [key(i - 1) if i else None], request=req)
        for s in d.slots:
            land(m, d, s, [torch.randint(0, 256, (PAGE,), generator=gen, dtype=torch.uint8)])
        m.complete_store(d.keys_to_store)
    assert all(p.told == [(key(0),)] for p in pols.values())
    # a new request loading the chain's tail: told its chain (the blocks above the load
    # are vLLM's) and its hits, once
    load = _Req()
    assert m.lookup(key(2)) is Lookup.HIT
    m.prepare_load([key(2)], request=load)
    m.complete_load([key(2)])
    m.prepare_load([key(2)], request=load)
    m.complete_load([key(2)])
    chain = (key(0), key(1), key(2))
    assert all(p.told == [(key(0),), chain] for p in pols.values())
    m.prepare_store([key(3)], [key(2)])  # no request object: a request of its own
    assert all(p.told[-1] == (*chain, key(3)) and len(p.told) == 3 for p in pols.values())
    m.check_integrity()
    m.shutdown()


def test_a_block_stored_under_a_block_that_leaves_is_not_stored(tmp_path):
    """Host only, one slot: making room for a block dropped its parent, and the block
    was stored as a chain's first block; in the cache it leaves with its parent."""
    gen = torch.Generator().manual_seed(53)
    m = make(tmp_path, slots=1, policy="lru")
    store(m, gen, [key(1)])
    d = m.prepare_store([key(2)], [key(1)])
    assert d is not None and d.keys_to_store == [] and d.evicted == [key(1)]
    assert len(m.index) == 0 and m.counters.dropped == 2
    # the control: a block whose parent stays is stored under it
    store(m, gen, [key(3)])
    m.check_integrity()
    m.shutdown()
