"""Block replay: hit counts worked out by hand, a trace slice against an independent count, the CLI."""

from __future__ import annotations

import json
import random

import pytest
from tiering.policies.blocks import LRUBlocks, make_block_policy

from tiering.blocks.belady import belady_hit_rate
from tiering.blocks.replay import load_chains, main, replay_blocks
from tiering.blocks.synth import synthetic_chains

TRACE = "benchmarks/traces/mooncake/conversation_trace.jsonl"

# capacity 4, LRU, each request touching its chain root first:
#  r0 [0,1,2]    hits 0; cache 0,1,2
#  r1 [0,1,3]    hits 2 (0,1); insert 3 -> full; LRU order 2,0,1,3
#  r2 [0,4]      hits 1; touch 0 -> 2,1,3,0; insert 4 evicts 2 -> 1,3,0,4
#  r3 [0,1,2,5]  hits 2 (2 is gone); touch 0,1 -> 3,4,0,1; 2 evicts 3, 5 evicts 4
HAND = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5]]


def test_hand_computed_lru():
    r = replay_blocks(HAND, 4, LRUBlocks(capacity=4), check_every=1)
    assert (r.accesses, r.hits, r.inserted, r.evicted, r.orphaned) == (12, 5, 7, 3, 0)


def test_hand_computed_belady():
    # next uses: 3 and 4 are never read again (bypassed); 0,1,2 stay, so r3 hits 0,1,2
    assert belady_hit_rate(HAND, 4).hits == 0 + 2 + 1 + 3
    # one block: only the shared root is worth keeping
    assert belady_hit_rate(HAND, 1).hits == 0 + 1 + 1 + 1


def test_trace_slice_with_room_for_everything_hits_every_seen_prefix():
    chains = load_chains(TRACE, limit=300)
    seen: set[int] = set()
    expected = 0
    for chain in chains:  # independent count: the longest prefix read before
        for b in chain:
            if b not in seen:
                break
            expected += 1
        seen.update(chain)
    for name in ("lru", "arc", "s3fifo", "chain"):
        cap = len(seen) + 1
        r = replay_blocks(chains, cap, make_block_policy(name, capacity=cap), check_every=25)
        if name != "chain":  # chain may refuse blocks it expects never to be read
            assert r.hits == expected, name
        assert r.hits <= expected
        assert r.evicted == 0
    assert belady_hit_rate(chains, len(seen) + 1).hits == expected


def test_a_small_tier_loses_hits_and_belady_bounds_every_policy():
    chains = load_chains(TRACE, limit=1500)
    opt = belady_hit_rate(chains, 200)
    plain = belady_hit_rate(chains, 200, prefix_ties=False)
    assert plain.hits <= opt.hits
    for name in ("lru", "arc", "s3fifo", "chain"):
        r = replay_blocks(chains, 200, make_block_policy(name, capacity=200))
        assert 0 < r.hits <= opt.hits, name


def test_negative_control_a_shuffled_trace_has_almost_no_reuse():
    chains = synthetic_chains(800, seed=3)
    r = replay_blocks(chains, 500, LRUBlocks(capacity=500))
    rng = random.Random(0)
    ids = sorted({b for c in chains for b in c})
    relabel = dict(zip(ids, rng.sample(range(10**9), len(ids)), strict=True))
    # give every request its own fresh ids: nothing can be a hit
    fresh = [[relabel[b] + 10**9 * (i + 1) for b in c] for i, c in enumerate(chains)]
    assert r.hits > 0
    assert replay_blocks(fresh, 500, LRUBlocks(capacity=500)).hits == 0


def test_cli_writes_summary(tmp_path):
    out = tmp_path / "run"
    assert (
        main(
            [
                TRACE,
                "--capacity-blocks",
                "300",
                "--policy",
                "all",
                "--out",
                str(out),
                "--limit",
                "400",
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert set(s["policies"]) == {"lru", "arc", "s3fifo", "lirs", "chain", "adaptive"}
    for p in s["policies"].values():
        assert 0 < p["block_hit_rate"] <= s["belady_hit_rate"]
        assert p["belady_hit_rate"] == s["belady_hit_rate"]
    # beside each policy: its ratio to the best established policy of the run
    best = s["best_established"]
    assert best in ("lru", "arc", "s3fifo", "lirs")
    top = s["policies"][best]["block_hit_rate"]
    assert all(s["policies"][n]["block_hit_rate"] <= top for n in ("lru", "arc", "s3fifo", "lirs"))
    assert s["policies"][best]["of_best_established"] == 1.0
    for p in s["policies"].values():
        assert p["of_best_established"] == pytest.approx(p["block_hit_rate"] / top)
    assert (
        main(
            [
                TRACE,
                "--capacity-blocks",
                "300",
                "--policy",
                "lru",
                "--out",
                str(out),
                "--limit",
                "400",
            ]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["policy"] == "lru" and s["block_hit_rate"] == s["policies"]["lru"]["block_hit_rate"]


@pytest.mark.parametrize("argv", [["--policy", "nope"], ["--capacity-blocks", "0"],
                                  ["--limit", "0"], ["--limit", "-2"]])
def test_cli_rejects_bad_arguments(tmp_path, argv, capsys):
    base = {"--capacity-blocks": "10", "--policy": "lru"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    args = [TRACE, "--out", str(tmp_path)] + [x for kv in base.items() for x in kv]
    with pytest.raises(SystemExit):
        main(args)
    assert argv[0].lstrip("-").split("-")[0] in capsys.readouterr().err


def test_tiering_replay_blocks_runs_the_block_replay(tmp_path):
    from tiering.apps.cli import main as tiering_main

    out = tmp_path / "via-cli"
    rc = tiering_main(["replay", TRACE, "--blocks", "--capacity-blocks", "200",
                       "--policy", "lru", "--out", str(out), "--limit", "300"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert 0 < s["policies"]["lru"]["block_hit_rate"] <= s["belady_hit_rate"]


def test_a_bool_capacity_is_refused_by_replay_and_belady():
    """``True`` was taken as a capacity of one block."""
    chains = synthetic_chains(20, 0)
    with pytest.raises(ValueError, match="capacity_blocks must be an int >= 1, got True"):
        replay_blocks(chains, True, LRUBlocks())
    with pytest.raises(ValueError, match="capacity_blocks must be an int >= 1, got True"):
        belady_hit_rate(chains, True)
    assert replay_blocks(chains, 1, LRUBlocks()).capacity_blocks == 1  # the control


def test_load_chains_limit_zero_is_no_request_and_bad_ids_are_named(tmp_path):
    """``limit=0`` used to return one request (the count was checked after appending), a
    negative limit one too; a block id that is a list or text was loaded and failed later."""
    assert load_chains(TRACE, limit=0) == []
    assert len(load_chains(TRACE, limit=3)) == 3  # the control
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="limit must be None or an int >= 0"):
            load_chains(TRACE, limit=bad)
    for ids, shown in (([1, [2]], "\\[2\\]"), ([1, "2"], "'2'"), ([True], "True")):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"hash_ids": [5, 6]}) + "\n" + json.dumps({"hash_ids": ids}) + "\n")
        with pytest.raises(ValueError, match=f"t.jsonl:2: hash_ids holds {shown}, not an int"):
            load_chains(path)


@pytest.mark.parametrize(("data", "message"), [
    (None, "No such file"),
    (b'{"hash_ids": [1, 2]}\n{"hash_ids": [1,\n', ":2: not a trace record"),
    (b"\xff\xfe\x00garbage\n", "can't decode byte 0xff"),
])
def test_tiering_replay_blocks_names_an_unreadable_trace(tmp_path, capsys, data, message):
    from tiering.apps.replay import main as replay_main

    trace = tmp_path / "t.jsonl"
    if data is not None:
        trace.write_bytes(data)
    out = tmp_path / "out"
    rc = replay_main([str(trace), "--blocks", "--capacity-blocks", "10", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not out.exists()


def test_block_replay_refuses_a_limit_below_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main([TRACE, "--capacity-blocks", "10", "--out", str(tmp_path / "o"), "--limit", "0"])
    assert stop.value.code == 2 and "--limit" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


class _Snapshots(LRUBlocks):
    """LRU that records every snapshot its per-event hooks are given."""

    name = "snapshots"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.seen: list[tuple] = []

    def on_insert(self, info, now):
        self.seen.append(("insert", now, *info))
        super().on_insert(info, now)

    def on_hit(self, info, now):
        self.seen.append(("hit", now, *info))
        super().on_hit(info, now)


class _PickySnapshots(_Snapshots):
    """The same, refusing every block whose key is a multiple of 7 (its own ``admit``)."""

    def admit(self, key, depth, now):
        return key % 7 != 0


@pytest.mark.parametrize("make", [_Snapshots, _PickySnapshots])
def test_batch_and_per_event_replays_hand_a_policy_the_same_snapshots(make):
    """A policy that reads its snapshots (refs, hits, times, children) gets the same ones
    from the batch hooks as from the per-event loop, so its runs cannot differ."""
    rng = random.Random(23)
    chains = [[rng.randrange(60) for _ in range(rng.randint(1, 9))] for _ in range(400)]
    chains = [list(dict.fromkeys(c)) for c in chains]  # a chain reads a block once
    runs = {}
    for batch in (True, False):
        p = make(25)
        res = replay_blocks(chains, 25, p, check_every=37, batch=batch)
        runs[batch] = (res[1:9], p.seen)
    assert runs[True][1], "the policy saw no event"
    assert any(s[0] == "insert" for s in runs[True][1]) and any(
        s[0] == "hit" for s in runs[True][1])
    assert runs[True] == runs[False]


# -- the slim loop (tiering.blocks.slim) against the index path --------------------------

_GENERIC = ("lru", "arc", "s3fifo", "lirs")


def _spied(policy, log: list):
    """``policy`` with every hook the replay calls recorded in ``log``, with its answers
    and every snapshot it builds with ``get`` (the instance's attributes shadow its
    class's methods; its class, which picks the path, is unchanged)."""
    def recorded_get(get):
        def g(key):
            info = get(key)
            log.append(("get", key, info))
            return info
        return g

    commit, publish, pop, removes, hit = (policy.on_commit, policy.on_publish,
                                          policy.pop_victim, policy.on_removes, policy.on_hit)

    def on_commit(keys, hits, depths, get, now):
        log.append(("commit", list(keys), list(hits), list(depths), now))
        return commit(keys, hits, depths, recorded_get(get), now)

    def on_publish(keys, depth, room, insert, get, now):
        log.append(("publish", list(keys), depth, room(), now))

        def recorded_insert(run):
            got = insert(run)
            log.append(("insert", list(run), got, room()))
            return got
        out = publish(keys, depth, room, recorded_insert, recorded_get(get), now)
        log.append(("published", out))
        return out

    def pop_victim(now, *busy):
        victim = pop(now, *busy)
        log.append(("victim", victim, [victim in c for c in busy]))
        return victim

    def on_removes(keys):
        log.append(("removes", list(keys)))
        return removes(keys)

    def on_hit(info, now):
        log.append(("hit", info, now))
        return hit(info, now)

    policy.on_commit, policy.on_publish, policy.pop_victim = on_commit, on_publish, pop_victim
    policy.on_removes, policy.on_hit = on_removes, on_hit
    return policy


def _both_paths(chains, capacity, name, check_every=0):
    """(result counts, hook log) of the slim loop and of the index path; an exception's
    type and message in place of the counts when the replay raises."""
    out = []
    for slim in (True, False):
        log: list = []
        policy = _spied(make_block_policy(name, capacity=capacity), log)
        try:
            res = replay_blocks(chains, capacity, policy, check_every=check_every, slim=slim)
            out.append((res[:9], log))
        except ValueError as err:
            out.append((("ValueError", str(err)), log))
    return out


def _odd_chains(seed: int, n: int = 400) -> list[list[int]]:
    """Random chains over a small key space, and chains that read what a prefix tree
    never shows the index: a chain starting mid-way down another, a block cached below
    another parent met after a miss, a block read twice (once cached)."""
    rng = random.Random(seed)
    fresh = iter(range(10_000, 100_000))
    space = rng.choice((12, 40, 150))
    chains: list[list[int]] = []
    for _ in range(n):
        prev = rng.choice(chains[-20:]) if chains else []
        shape = rng.random() if len(prev) > 2 else 0.0
        k = rng.randrange(1, len(prev)) if len(prev) > 2 else 0
        if shape < 0.55:
            c = list(dict.fromkeys(rng.randrange(space) for _ in range(rng.randint(0, 10))))
        elif shape < 0.65:  # a cached block read again after a miss: mapped twice
            c = [*prev[:k], next(fresh), prev[rng.randrange(k)]]
        elif shape < 0.8:  # starts below a root, then maps the block above its start
            c = [*prev[k:], next(fresh), prev[k - 1]]
        else:  # a miss, then a block cached below another parent, then a miss
            c = [next(fresh), rng.choice(prev), next(fresh)]
        chains.append(c)
    return chains


@pytest.mark.parametrize("name", _GENERIC)
def test_the_slim_loop_calls_the_policy_as_the_index_path_does_on_the_trace(name):
    """The bundled trace, a tier small enough to evict all the time: the same results,
    and every hook call, answer, snapshot and eviction in the same order."""
    chains = load_chains(TRACE, limit=2000)
    for cap in (250, 1000):
        slim, index = _both_paths(chains, cap, name)
        assert slim[0][7] > 500 and slim[0][8] > 0, "the run must evict, orphans among them"
        assert slim == index, (name, cap)


@pytest.mark.parametrize("name", _GENERIC)
def test_the_slim_loop_calls_the_policy_as_the_index_path_does_on_odd_chains(name):
    """Random chains, and chains a prefix tree would not produce (``_odd_chains``), every
    few requests checked (the index's integrity, the slim tables' rules): identical hook
    logs, the same result or the same ValueError."""
    finished = 0
    for seed in range(12):
        chains = _odd_chains(seed)
        for cap in (1, 3, 20, 90):
            slim, index = _both_paths(chains, cap, name, check_every=7)
            assert slim == index, (name, seed, cap)
            finished += slim[0][0][0] != "ValueError"
    assert finished >= 30  # most runs finish; a repeated missing block is refused by both


def test_the_slim_loop_refuses_a_chain_that_repeats_a_missing_block_as_the_index_does():
    chains = [[1, 2, 3], [4, 5, 4]]
    for name in _GENERIC:
        slim, index = _both_paths(chains, 10, name)
        assert slim[0][0] == "ValueError" and index[0][0] == "ValueError", name
        assert slim[1] == index[1]  # the same calls up to the refusal
    control = [[1, 2, 3], [4, 5, 6]]
    slim, index = _both_paths(control, 10, "lru")
    assert slim == index and slim[0][5] == 6


def test_only_an_exact_built_in_generic_policy_takes_the_slim_loop(monkeypatch):
    """A subclass, a user's policy and chain take the index path; the four built-ins the
    slim loop; ``slim=False`` takes the index path for them too."""
    import tiering.blocks.replay as replay_mod
    from tiering.blocks.slim import takes_slim

    class MyLRU(LRUBlocks):
        pass

    assert [takes_slim(make_block_policy(n, capacity=4)) for n in _GENERIC] == [True] * 4
    assert not takes_slim(MyLRU(capacity=4)) and not takes_slim(_Snapshots(4))
    assert not takes_slim(make_block_policy("chain", capacity=4))
    ran = []
    real = replay_mod.replay_slim
    monkeypatch.setattr(replay_mod, "replay_slim", lambda *a: ran.append(a[2]) or real(*a))
    for p in (MyLRU(capacity=4), _Snapshots(4), make_block_policy("chain", capacity=4)):
        replay_blocks(HAND, 4, p)
    assert ran == []
    r = replay_blocks(HAND, 4, LRUBlocks(capacity=4), slim=False)
    assert ran == [] and r.hits == 5
    r = replay_blocks(HAND, 4, LRUBlocks(capacity=4))
    assert len(ran) == 1 and (r.hits, r.inserted, r.evicted) == (5, 7, 3)
    r = replay_blocks(HAND, 4, LRUBlocks(capacity=4), batch=False)  # the per-event loop
    assert len(ran) == 1 and r.hits == 5


def test_the_slim_loops_check_catches_a_policy_that_lost_count():
    """``check_every`` on the slim loop: a policy whose count disagrees with the tier fails
    the check (a control without the fault passes)."""
    chains = load_chains(TRACE, limit=50)
    replay_blocks(chains, 40, LRUBlocks(capacity=40), check_every=1)
    p = LRUBlocks(capacity=40)
    p._order["not a block"] = None
    with pytest.raises(AssertionError, match="tracks"):
        replay_blocks(chains, 40, p, check_every=1)
