"""End to end on a real vLLM (CPU build): our offload backend must never change a byte.

Runs only where vLLM imports (the separate environment that ``scripts/vllm_env.sh``
builds; ``.ci/run`` runs this file there with ``-m vllm``); elsewhere it is skipped
with the reason. Four engine starts, each in its own process (tests/vllm_helpers.py):

- reference: plenty of KV blocks, no connector;
- recompute: few KV blocks, no connector (what vLLM's own prefix cache achieves);
- offload: few KV blocks, our host tier (24 blocks, twice vLLM's 12) and disk tier; three rounds of the
  same prompts (forward, reversed, forward), and between rounds 2 and 3 every block
  that is on disk only is damaged in the slot file;
- negative control: as offload, with the test-only hook that corrupts every load;
- small host: a 4-block host tier in front of the disk tier, smaller than one
  prompt's store batch (9 blocks) and than its shared prefix (8 blocks): two rounds;
- shared: two engines in turn, each with its own host and disk tiers, on one
  bucket of a SeaweedFS server the test starts, with one deployment secret: the
  second engine's first round must load the first engine's prefixes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here: the end-to-end test runs in the environment "
    "scripts/vllm_env.sh builds (.ci/run does it)",
)

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from seaweed_fixture import _seaweed_shared  # noqa: E402,F401  (the server fixture)
from vllm_helpers import shared_prefix_prompts, write_tiny_llama  # noqa: E402

BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # layers * (K,V) * tokens * heads * dim * fp32
N_PROMPTS = 8
FORWARD = list(range(N_PROMPTS))
ORDERS = [FORWARD, FORWARD[::-1], FORWARD]


def _run(spec: dict, workdir: Path, name: str, timeout: float = 900,
         env_extra: dict | None = None) -> dict:
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1", **(env_extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_helpers.py"), str(spec_path), str(out_path)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    if proc.returncode != 0 or not out_path.exists():
        raise AssertionError(f"engine run {name} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}"
                             f"\n{proc.stderr[-8000:]}")
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = tmp_path_factory.mktemp("vllm")
    write_tiny_llama(w / "model", seed=1234)
    return w


def _base(work: Path) -> dict:
    prompts = shared_prefix_prompts(seed=7, n_prefixes=4, prefix_tokens=256, per_prefix=2,
                                    suffix_tokens=40)
    return dict(model=str(work / "model"), prompts=prompts, orders=ORDERS, max_tokens=8,
                max_model_len=352)


@pytest.fixture(scope="module")
def runs(work):
    base = _base(work)
    host_dirs = []

    def offload(name: str, **extra) -> dict:
        hd = tempfile.mkdtemp(prefix="tiering-vllm-test-",
                              dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        host_dirs.append(hd)
        return dict(dict(host_bytes=24 * BLOCK_BYTES, disk_path=str(work / f"{name}-disk"),
                         disk_bytes=128 * BLOCK_BYTES, host_dir=hd, demote_headroom=24,
                         state_path=str(work / f"{name}-state.json")), **extra)

    try:
        out = {
            "reference": _run(dict(base, blocks=512), work, "reference"),
            "recompute": _run(dict(base, blocks=12), work, "recompute"),
            "offload": _run(dict(base, blocks=12, offload=offload("offload"),
                                 corrupt_after_round=1), work, "offload"),
            "negative": _run(dict(base, blocks=12, orders=ORDERS[:2],
                                  offload=offload("negative", test_corrupt_loads=True)),
                             work, "negative"),
            # the engine's default demote_headroom; a wait past 5 s is reported as a miss;
            # lru admits every block arriving on the 4-slot host (the default policy's
            # admission refuses most of them there, as the cache's host would)
            "small_host": _run(dict(base, blocks=12, orders=ORDERS[:2],
                                    offload=offload("small_host", host_bytes=4 * BLOCK_BYTES,
                                                    demote_headroom=None, load_wait_s=5.0,
                                                    policy="lru")),
                               work, "small_host", timeout=420),
        }
        staging = work / "small_host-disk.staging"  # removed at shutdown
        out["small_host_staging_left"] = sorted(os.listdir(staging)) if staging.exists() else []
        out["leftover_slabs"] = sorted(f for hd in host_dirs for f in os.listdir(hd))
    finally:
        for hd in host_dirs:
            shutil.rmtree(hd, ignore_errors=True)
    summary_path = os.environ.get("TIERING_VLLM_E2E_SUMMARY")
    if summary_path:  # figures for people reading a CI log or a report
        Path(summary_path).write_text(json.dumps({
            name: {"start_s": r["start_s"],
                   "cached_tokens_per_round": [sum(x["cached"] for x in rd) for rd in r["rounds"]],
                   "counters_per_round": [st["counters"] for st in r.get("states", [])],
                   "corrupted_blocks": len(r.get("corrupted") or [])}
            for name, r in out.items() if isinstance(r, dict)
        }, indent=1))
    return out


def mismatches(a: dict, b: dict, rounds: int) -> list[str]:
    """Where two runs differ in greedy tokens or (bitwise) log-probabilities."""
    bad = []
    for r in range(rounds):
        for x, y in zip(a["rounds"][r], b["rounds"][r], strict=True):
            assert x["prompt"] == y["prompt"]
            if x["tokens"] != y["tokens"]:
                bad.append(f"round {r} prompt {x['prompt']}: tokens {x['tokens']} != {y['tokens']}")
            elif x["logprobs"] != y["logprobs"]:
                bad.append(f"round {r} prompt {x['prompt']}: log-probabilities differ")
    return bad


def cached(run: dict, r: int) -> int:
    return sum(x["cached"] for x in run["rounds"][r])


def test_offload_outputs_bitwise_identical_to_reference(runs):
    assert mismatches(runs["offload"], runs["reference"], 3) == []


def test_second_round_loads_from_host_and_disk(runs):
    off, rec = runs["offload"], runs["recompute"]
    # our tiers made vLLM skip prefill that its own prefix cache could not
    assert cached(off, 1) > cached(rec, 1), (cached(off, 1), cached(rec, 1))
    assert cached(off, 1) >= cached(rec, 1) + 8 * 32
    c = runs["offload"]["states"][1]["counters"]
    assert c["loads_from_host"] > 0, c
    assert c["loads_from_disk"] > 0, c
    assert c["promotions_ok"] > 0 and c["demotions_ok"] > 0, c
    assert c["promotions_failed"] == 0, c


def test_the_manager_runs_on_the_block_index_with_the_default_policy(runs):
    st = runs["offload"]["states"][1]
    assert st["policy"] == "adaptive", st["policy"]  # the default: ours
    ix = st["index"]
    # vLLM's blocks were inserted after the previous block of their request
    assert ix["blocks"] > 0 and ix["chained"] > 0, ix
    assert ix["on_host"] + ix["on_disk"] == ix["blocks"], ix


def test_block_damaged_on_disk_is_detected_and_recomputed(runs):
    off = runs["offload"]
    assert off["corrupted"], "no block was damaged"
    before, after = off["states"][1]["counters"], off["states"][2]["counters"]
    assert after["promotions_failed"] - before["promotions_failed"] >= 1, (before, after)
    # recomputed, not served: the third round is still identical to the reference
    assert mismatches(off, runs["reference"], 3) == []


def test_negative_control_a_wrong_load_fails_the_comparison(runs):
    neg = runs["negative"]
    c = neg["states"][1]["counters"]
    assert c["loads_from_host"] + c["loads_from_disk"] > 0, c
    bad = mismatches(neg, runs["reference"], 2)
    assert bad, "a deliberately wrong load went unnoticed by the comparison"


def test_a_host_tier_smaller_than_a_prompt_stores_everything_and_round_2_hits_disk(runs):
    """4 host blocks, 9-block store batches: nothing was stored at all (every
    prepare_store answered None), so round 2 got only vLLM's own cache."""
    small, rec = runs["small_host"], runs["recompute"]
    assert mismatches(small, runs["reference"], 2) == []
    c1, c2 = (st["counters"] for st in small["states"])
    assert c1["stores_staged"] > 0 and c1["stores_refused"] == 0, c1
    assert c1["stores_staged_failed"] == 0 and c2["dropped"] == 0, c2
    # round 2: blocks promoted from disk and loaded, beyond what vLLM alone kept
    assert c2["loads_from_disk"] > c1["loads_from_disk"], (c1, c2)
    assert cached(small, 1) >= cached(rec, 1) + 4 * 32, (cached(small, 1), cached(rec, 1))
    assert runs["small_host_staging_left"] == []


def test_a_prefix_longer_than_the_host_tier_is_served_never_hangs(runs):
    """A shared prefix of 8 blocks on disk behind 4 host slots: the request that
    shared it waited for ever (every pending answer needed a slot held by its own
    promotions). Now the blocks past the host tier are read (checked) into load
    staging rows and loaded from there (and the run ended)."""
    small, rec = runs["small_host"], runs["recompute"]
    c2 = small["states"][1]["counters"]
    assert c2["direct_reads_started"] > 0 and c2["direct_reads_failed"] == 0, c2
    assert c2["promotions_failed"] == 0, c2
    # whole prefixes came back: beyond vLLM's own cache by more than the host tier holds
    assert cached(small, 1) >= cached(rec, 1) + 2 * 8 * 32, (cached(small, 1), cached(rec, 1))


@pytest.fixture(scope="module")
def shared_runs(work, _seaweed_shared):  # noqa: F811  (the fixture imported above)
    """Two engines in turn on one bucket prefix, one deployment secret."""
    base = dict(_base(work), orders=[FORWARD])
    url = _seaweed_shared.url()
    secret = {"TIERING_COLDTIER_SECRET": "e2e-" + os.urandom(16).hex()}
    out = {}
    for name in ("shared_a", "shared_b"):
        hd = tempfile.mkdtemp(prefix="tiering-vllm-test-",
                              dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            off = dict(host_bytes=24 * BLOCK_BYTES, disk_path=str(work / f"{name}-disk"),
                       disk_bytes=128 * BLOCK_BYTES, host_dir=hd, load_wait_s=60.0,
                       state_path=str(work / f"{name}-state.json"),
                       shared={"url": url, "storage_options": _seaweed_shared.options()})
            out[name] = _run(dict(base, blocks=12, offload=off), work, name, timeout=420,
                             env_extra=secret)
        finally:
            shutil.rmtree(hd, ignore_errors=True)
    return out


def test_a_second_engine_gets_the_first_engines_prefixes_from_the_shared_tier(shared_runs, runs):
    """Each engine's tiers were its own: a second engine recomputed every prefix
    the first had computed."""
    a, b = shared_runs["shared_a"], shared_runs["shared_b"]
    ca, cb = a["states"][0]["counters"], b["states"][0]["counters"]
    assert ca["shared_published"] > 0 and ca["shared_publish_failed"] == 0, ca
    # B's first round: blocks fetched (MAC and frame checked), written to its disk,
    # promoted (crc checked) and loaded; more prompt tokens cached than A's first round
    assert cb["shared_hits"] > 0 and cb["loads_from_disk"] > 0, cb
    assert cb["promotions_failed"] == 0 and cb["shared_unavailable"] == 0, cb
    assert cached(b, 0) >= cached(a, 0) + 4 * 32, (cached(a, 0), cached(b, 0))
    assert cached(a, 0) == cached(runs["recompute"], 0)  # A had nothing to share from
    for run in (a, b):
        assert mismatches(run, runs["reference"], 1) == []


def test_no_host_slab_file_is_left_behind(runs):
    # the side that maps a slab second removes its name; nothing leaks into /dev/shm
    assert runs["leftover_slabs"] == []


# ----------------------------------------------------------------------------- adapter, no engine


def _offloading_config(extra: dict, engine_id: str = "unit"):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=2 * 256,
        enable_kv_cache_events=True,
        extra_config={"spec_name": "TieredOffloadingSpec",
                      "spec_module_path": "tiering.integrations.vllm", **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


def test_spec_is_loaded_from_outside_vllm_under_its_own_name():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    assert "TieredOffloadingSpec" not in OffloadingSpecFactory._registry
    cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}
    )
    assert cls.__module__ == "tiering.integrations.vllm._spec"


def test_a_misspelt_key_of_ours_stops_the_spec_and_lists_ours():
    """`demote_headrom` was accepted silently and changed what round 2 hit."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    with pytest.raises(ValueError, match="'demote_headrom'.*demote_headroom"):
        OffloadingSpecFactory.create_spec(
            _offloading_config({"host_bytes": 4096, "demote_headrom": 4}))
    spec = OffloadingSpecFactory.create_spec(  # vLLM's own keys are vLLM's
        _offloading_config({"host_bytes": 4096, "offload_prompt_only": True}))
    assert spec.cfg.host_bytes == 4096


def test_spec_rejects_bad_extra_config_naming_the_field():
    from tiering.integrations.vllm import TieredOffloadingSpec

    with pytest.raises(ValueError, match="host_bytes"):
        TieredOffloadingSpec(_offloading_config({"host_bytes": -5}))
    with pytest.raises(ValueError, match="disk_bytes"):
        TieredOffloadingSpec(_offloading_config({"host_bytes": 4096, "disk_path": "/tmp/x"}))


def test_manager_and_worker_through_vllm_types_round_trip(tmp_path):
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        LookupResult,
        ReqContext,
        make_offload_key,
    )

    from tiering.integrations.vllm import TieredOffloadingSpec

    gen = torch.Generator().manual_seed(21)
    cfg = _offloading_config({"host_bytes": 8 * 512, "host_dir": str(tmp_path)}, "unit-rt")
    spec = TieredOffloadingSpec(cfg)
    layers = [torch.randint(-128, 128, (16, 256), generator=gen, dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, 256) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    worker = spec.get_worker(caches)
    manager = spec.get_manager()
    ctx = ReqContext(req_id="r1")
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]
    assert manager.lookup(keys[0], ctx) is LookupResult.MISS
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    want = [t[[4, 5, 9]].clone() for t in layers]
    assert worker.submit_store(1, GPULoadStoreSpec([4, 5, 9], [3], [0]), out.store_spec)
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_store(keys, ctx)
    assert all(manager.lookup(k, ctx) is LookupResult.HIT for k in keys)
    # the request's blocks form one chain in the block index, in vLLM's order
    assert [manager.core.block(bytes(k)).parent for k in keys] == [None, *map(bytes, keys[:2])]
    more = [make_offload_key(bytes([9]) * 16, 0)]
    out2 = manager.prepare_store(more, ctx)  # a later store of the same request
    assert out2 is not None and out2.keys_to_store == more
    manager.complete_store(more, ctx)
    assert manager.core.block(bytes(more[0])).parent == bytes(keys[2])
    other = ReqContext(req_id="r2")  # another request knows no parent for its first block
    lone = [make_offload_key(bytes([7]) * 16, 0)]
    manager.complete_store(manager.prepare_store(lone, other).keys_to_store, other)
    assert manager.core.block(bytes(lone[0])).parent is None
    for t in layers:  # other random bytes where the blocks were
        t.copy_(torch.randint(-128, 128, t.shape, generator=gen, dtype=torch.int8))
    src = manager.prepare_load(keys, ctx)
    assert worker.submit_load(2, src, GPULoadStoreSpec([0, 1, 2], [3], [0]))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_load(keys, ctx)
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t[[0, 1, 2]], w)
    stats = manager.get_stats()
    assert stats is not None and not stats.is_empty()
    assert any(not e.removed for e in manager.take_events())
    manager.core.check_integrity()
    worker.shutdown()
    manager.shutdown()
    assert os.listdir(tmp_path) == []


def test_a_manager_that_fails_to_start_leaves_no_slab_file(tmp_path):
    """A disk tier that cannot open (disk_bytes below one block) failed get_manager
    after its slab file was created: the file stayed in host_dir."""
    from tiering.integrations.vllm import TieredOffloadingSpec

    (tmp_path / "shm").mkdir()
    spec = TieredOffloadingSpec(_offloading_config(
        {"host_bytes": 8 * 512, "host_dir": str(tmp_path / "shm"), "disk_bytes": 100,
         "disk_path": str(tmp_path / "disk")}, "unit-fail"))
    with pytest.raises(ValueError, match="disk_bytes"):
        spec.get_manager()
    assert os.listdir(tmp_path / "shm") == []


def test_two_engines_in_one_host_dir_never_share_a_slot(tmp_path):
    import torch

    gen = torch.Generator().manual_seed(30)
    from tiering.integrations.vllm import TieredOffloadingSpec

    extra = {"host_bytes": 4 * 512, "host_dir": str(tmp_path)}
    a = TieredOffloadingSpec(_offloading_config(extra, "engine/a")).get_manager()
    b = TieredOffloadingSpec(_offloading_config(extra, "engine_a")).get_manager()  # once one name
    pa, pb = (m.core.slabs[0] for m in (a, b))
    assert pa.path != pb.path
    page = torch.randint(0, 256, (512,), generator=gen, dtype=torch.uint8)
    pa.tensor[0].copy_(page)
    pb.tensor[0].copy_(torch.randint(0, 256, (512,), generator=gen, dtype=torch.uint8))
    assert torch.equal(pa.tensor[0], page)  # b's bytes did not land in a's slot
    a.shutdown()
    b.shutdown()
    assert os.listdir(tmp_path) == []


def test_vllm_offloading_connector_has_no_per_layer_step():
    """docs/vllm.md, "Why a load is whole-request": what vLLM's OffloadingConnector
    does with a load, run on its own code (only construction is bypassed). If a vLLM
    release forwards the layer hooks or loads synchronously, this fails."""
    import dataclasses
    from types import SimpleNamespace

    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        OffloadingWorkerMetadata,
        TransferJob,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult

    # a spec's worker has job calls only; a result names a job, never a layer
    assert OffloadingWorker.__abstractmethods__ == {
        "submit_load", "submit_store", "get_finished", "wait"}
    assert [f.name for f in dataclasses.fields(TransferResult)] == [
        "job_id", "success", "transfer_size", "transfer_time"]
    assert (OffloadingConnector.get_block_ids_with_load_errors
            is KVConnectorBase_V1.get_block_ids_with_load_errors)

    class Recorder(OffloadingWorker):  # every call the connector makes on a spec's worker
        def __init__(self):
            self.calls: list[tuple] = []
            self.results: list[TransferResult] = []

        def submit_store(self, job_id, src_spec, dst_spec):
            self.calls.append(("submit_store", job_id))
            return True

        def submit_load(self, job_id, src_spec, dst_spec):
            self.calls.append(("submit_load", job_id, tuple(dst_spec.block_ids.tolist())))
            return True

        def get_finished(self):
            self.calls.append(("get_finished",))
            out, self.results = self.results, []
            return out

        def wait(self, job_ids):
            self.calls.append(("wait", tuple(job_ids)))

        def __getattr__(self, name):  # a per-layer call a later vLLM might add
            raise AssertionError(f"the connector asked the worker for {name!r}")

    rec = Recorder()
    cw = object.__new__(OffloadingConnectorWorker)
    cw.worker, cw._load_jobs, cw._unsubmitted_store_jobs = rec, {}, []
    cw._connector_worker_meta = OffloadingWorkerMetadata()
    conn = object.__new__(OffloadingConnector)
    conn.connector_worker = cw
    conn._connector_metadata = OffloadingConnectorMetadata(
        load_jobs={7: TransferJob("req-a", object(), GPULoadStoreSpec([3, 4, 5], [3], [0]))},
        store_jobs={})

    conn.start_load_kv(None)  # one job for all of the request's blocks and layers
    assert rec.calls == [("submit_load", 7, (3, 4, 5))]
    kv = torch.randn(2, 6, 32)
    for layer in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
        conn.wait_for_layer_load(layer)
        conn.save_kv_layer(layer, kv, None)
    assert rec.calls == [("submit_load", 7, (3, 4, 5))]  # the layer hooks reach no one
    assert conn.get_finished(set()) == (set(), set())  # nothing landed: not received
    rec.results = [TransferResult(7, True)]
    assert conn.get_finished(set()) == (set(), {"req-a"})  # received only as a whole
    # negative control: the Recorder does see a call the connector makes
    conn._connector_metadata = OffloadingConnectorMetadata(
        load_jobs={8: TransferJob("req-b", object(), GPULoadStoreSpec([1], [1], [0]))},
        store_jobs={})
    conn.start_load_kv(None)
    rec.results = [TransferResult(8, False)]
    with pytest.raises(AssertionError):  # no failure path for a load
        conn.get_finished(set())

    # the scheduler side answers every hit as an asynchronous load
    status = SimpleNamespace(
        group_states=[], transfer_jobs={}, update_offload_keys=lambda: None,
        num_locally_computed_tokens=0, deferred_lookup_start_time=None,
        update_num_hit_chunks=lambda n: None)

    def answer(hits: int):
        sched = SimpleNamespace(
            _req_status={"req-c": status}, _lookup=lambda st, cap: hits,
            _connector_stats=SimpleNamespace(observe_histogram=lambda *a: None),
            _maybe_observe_lookup_async_delay=lambda st: None)
        req = SimpleNamespace(request_id="req-c", skip_reading_prefix_cache=False)
        return OffloadingConnectorScheduler.get_num_new_matched_tokens(sched, req, 0)

    assert answer(96) == (96, True)
    assert answer(0) == (0, False)
