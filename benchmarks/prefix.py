"""Block retention benchmark: every block policy on traces it was and was not tuned on.

Measures, in one run, the block hit rate (hit blocks / block accesses,
``tiering.blocks.replay``) of every registered block policy at each capacity
(default 1,000, 4,000 and 16,000 blocks), beside Belady's optimum for the same
trace and capacity, on:

- the bundled Mooncake conversation trace, split in two: the first half is the
  **tuning** split (the adaptive policy's parameters were chosen on it and on the
  same generators as below at seeds 100 to 102, which no row uses), the second
  half is **held-out**;
- seeded synthetic traces from five generators (``tiering.blocks.synth``) at
  ``--seed`` (0): the conversation generator with its defaults and with every
  knob shifted, interleaved multi-turn sessions, agents sharing long system
  prompts and tool descriptions, and a scan-heavy mix that defeats recency; all
  **held-out**;
- a trace the user passes with ``--trace`` (Mooncake-style JSON lines with
  ``hash_ids``), labelled **user**;
- the per-block cost of computing a block key, and of a lookup plus an insert
  in ``BlockIndex``, against a raw dict lookup and insert of the same keys;
- adversarial cases at one capacity (``--adversarial-capacity``): a scan through
  a working set, a loop slightly larger than the tier, and a sudden shift of
  working set, with the accesses each policy needs to recover.

Each row names its split. Beside every policy: its ratio to Belady and to the
best established policy (LRU, ARC, S3-FIFO, LIRS) in the same row, and the
adaptive policy's leader at the end with the request it took the lead at. The
cost of each policy is its replay time as a ratio to LRU's in the same run.

``--split tuning`` runs, instead, the tuning split alone: the bundled trace's
first half and every generator at seeds 100, 101 and 102 (rows such as
``synth-sessions-s100``), the rows on which parameters may be chosen.

Usage: ``python benchmarks/prefix.py --out prefix.json [--trace T] [--requests N] [--capacities ...] [--only LABELS] [--split tuning]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Hashable, Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from tiering.policies.blocks import (  # noqa: E402
    DEFAULT_BLOCK_POLICY,
    BlockPolicy,
    default_block_registry,
)

from benchmarks._report import table, write_json  # noqa: E402
from tiering.blocks import synth  # noqa: E402
from tiering.blocks.belady import belady_hit_rate  # noqa: E402
from tiering.blocks.index import BlockIndex  # noqa: E402
from tiering.blocks.keys import KeyRoot  # noqa: E402
from tiering.blocks.replay import load_chains, replay_blocks  # noqa: E402
from tiering.types import Tier  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake" / "conversation_trace.jsonl"
ESTABLISHED = ("lru", "arc", "s3fifo", "lirs")
CANDIDATE = "adaptive"
OLD_DEFAULT = "chain"
# a conversation trace unlike the default one in every knob: more system prompts, more
# one-offs, longer turns, likelier first continuations that rise slowly, shorter and
# more spread gaps
SHIFTED = synth.SynthConfig(
    system_prompts=8,
    one_off_fraction=0.5,
    new_blocks_mean=12.0,
    cont_first=0.5,
    cont_step=0.05,
    cont_max=0.7,
    gap_median=200.0,
    gap_sigma=1.2,
)


#: the seeds of the synthetic generators on the tuning split (no reported row uses them)
TUNING_SEEDS = (100, 101, 102)


def tuning_sets(trace: Path, requests: int) -> list[tuple]:
    """(label, split, chains) of the tuning split: the bundled trace's first half and
    every generator at each of ``TUNING_SEEDS``, for choosing parameters on."""
    chains = load_chains(trace)
    sets = [("bundled-1st-half", "tuning", chains[:len(chains) // 2])]
    for s in TUNING_SEEDS:
        sets += _synthetic_sets(requests, s, "tuning", f"-s{s}")
    return sets


def _synthetic_sets(requests: int, seed: int, split: str, suffix: str = "") -> list[tuple]:
    """(label, split, chains) of every synthetic generator at ``seed`` (the shifted one at
    ``seed + 1``), each label ending in ``suffix``."""
    return [
        (f"synth-conversation{suffix}", split, synth.synthetic_chains(requests, seed)),
        (f"synth-shifted{suffix}", split, synth.synthetic_chains(requests, seed + 1, SHIFTED)),
        (f"synth-sessions{suffix}", split, synth.session_chains(requests, seed)),
        (f"synth-agents{suffix}", split, synth.agent_chains(requests, seed)),
        (f"synth-scan-mix{suffix}", split, synth.scan_mix_chains(requests, seed)),
    ]


def trace_sets(trace: Path, user: Path | None, requests: int, seed: int) -> list[tuple]:
    """(label, split, chains) of every trace of the run."""
    chains = load_chains(trace)
    half = len(chains) // 2
    sets = [
        ("bundled-1st-half", "tuning", chains[:half]),
        ("bundled-2nd-half", "held-out", chains[half:]),
        *_synthetic_sets(requests, seed, "held-out"),
    ]
    if user is not None:
        sets.append((f"user:{user.name}", "user", load_chains(user)))
    return sets


def _costs(n_blocks: int, page_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    root = KeyRoot("L32-H8-D128-T16-bfloat16", "bench-model", page_tokens=page_tokens)
    tokens = rng.integers(0, 128_000, size=n_blocks * page_tokens)
    t0, c0 = time.perf_counter(), time.process_time()
    keys = root.keys(tokens)
    t_keys, c_keys = time.perf_counter() - t0, time.process_time() - c0
    index = BlockIndex()
    t0, c0 = time.perf_counter(), time.process_time()
    parent = None
    for i, k in enumerate(keys):
        if index.match_length((k,)) == 0:
            index.insert(k, parent, Tier.HOST, i, 0.0)
        parent = k
    t_index, c_index = time.perf_counter() - t0, time.process_time() - c0
    raw: dict = {}
    t0, c0 = time.perf_counter(), time.process_time()
    for i, k in enumerate(keys):
        if k not in raw:
            raw[k] = i
    t_raw, c_raw = time.perf_counter() - t0, time.process_time() - c0
    index.check_integrity()
    return {
        "blocks": n_blocks,
        "page_tokens": page_tokens,
        "key_us_per_block": 1e6 * t_keys / n_blocks,
        "lookup_insert_us_per_block": 1e6 * t_index / n_blocks,
        "raw_dict_us_per_block": 1e6 * t_raw / n_blocks,
        "index_over_raw": t_index / t_raw,
        "key_plus_lookup_insert_us_per_block": 1e6 * (t_keys + t_index) / n_blocks,
        "cpu_key_us_per_block": 1e6 * c_keys / n_blocks,
        "cpu_lookup_insert_us_per_block": 1e6 * c_index / n_blocks,
        "cpu_raw_dict_us_per_block": 1e6 * c_raw / n_blocks,
    }


def _replay(chains, cap: int, name: str):
    policy = default_block_registry().make(name, capacity=cap)
    c0 = time.process_time()
    r = replay_blocks(chains, cap, policy)
    return r, time.process_time() - c0, policy


def run_row(label: str, split: str, chains, cap: int, names: Sequence[str]) -> dict:
    opt = belady_hit_rate(chains, cap).hit_rate
    rates, cpu, lead = {}, {}, None
    for n in names:
        r, c, p = _replay(chains, cap, n)
        rates[n], cpu[n] = r.hit_rate, c
        if n == CANDIDATE and hasattr(p, "leader_name"):
            lead = {"final": p.leader_name, "switches": p.switches,
                    "last_switch_request": p.last_switch}
    best = max(rates[b] for b in ESTABLISHED)
    print(f"  {label} @ {cap}: done", file=sys.stderr, flush=True)
    return {
        "trace": label,
        "split": split,
        "requests": len(chains),
        "capacity_blocks": cap,
        "belady": opt,
        "hit_rate": rates,
        "of_belady": {n: rates[n] / opt if opt else None for n in names},
        "best_established": best,
        "best_established_name": max(ESTABLISHED, key=rates.__getitem__),
        "of_best_established": {n: rates[n] / best if best else None for n in names},
        "cpu_seconds": cpu,
        "cpu_over_lru": {n: cpu[n] / cpu["lru"] if cpu["lru"] else None for n in names},
        "candidate_lead": lead,
    }


class _Recorder(BlockPolicy):
    """``inner`` unchanged, recording each request's accesses and prefix hits (a cached
    block of a chain is always part of its cached prefix, so hits are the on_hit calls
    of the request)."""

    def __init__(self, inner: BlockPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.accesses: list[int] = []
        self.hits: list[int] = []

    def on_request(self, keys: Sequence[Hashable], now: float) -> None:
        self.accesses.append(len(keys))
        self.hits.append(0)
        self.inner.on_request(keys, now)

    def admit(self, key, depth, now):
        return self.inner.admit(key, depth, now)

    def on_insert(self, info, now):
        self.inner.on_insert(info, now)

    def on_hit(self, info, now):
        self.hits[-1] += 1
        self.inner.on_hit(info, now)

    def on_remove(self, key):
        self.inner.on_remove(key)

    def victims(self, now):
        return self.inner.victims(now)

    def victims_except(self, now, *busy):
        return self.inner.victims_except(now, *busy)

    def __len__(self):
        return len(self.inner)

    def __contains__(self, key):
        return key in self.inner


def recovery(acc: list[int], hits: list[int], event: int, window: int, level: float = 0.9,
             after: int | None = None):
    """Accesses from request ``after`` (the end of the event; ``event`` when None) until
    the hit rate over the last ``window`` accesses is back to ``level`` of its rate over
    the ``window`` accesses before request ``event`` (None if it never is; 0 when there
    was nothing to recover)."""
    a = h = 0
    i = event
    while i > 0 and a < window:
        i -= 1
        a += acc[i]
        h += hits[i]
    before = h / a if a else 0.0
    if before == 0.0:
        return 0
    win_a = win_h = 0
    tail: list[tuple[int, int]] = []
    start = 0
    seen = 0
    for j in range(event if after is None else after, len(acc)):
        tail.append((acc[j], hits[j]))
        win_a += acc[j]
        win_h += hits[j]
        seen += acc[j]
        while win_a - tail[start][0] >= window:
            win_a -= tail[start][0]
            win_h -= tail[start][1]
            start += 1
        if win_a >= window and win_h / win_a >= level * before:
            return seen
    return None


def adversarial(cap: int, names: Sequence[str]) -> list[dict]:
    """Scan, loop and shift cases at ``cap`` blocks: hit rate and accesses to recover."""
    at = 3000
    cases = [
        ("scan", "a scan of 4x capacity through a working set of half the capacity",
         synth.scan_chains(6000, 0, cap // 2, 4 * cap, at), at),
        ("loop", "a loop over 1.1x capacity",
         synth.loop_chains(max(600, 40 * cap // 8), int(1.1 * cap)), None),
        ("shift", "a working set of 0.8x capacity replaced by another",
         synth.shift_chains(6000, 0, int(0.8 * cap), at), at),
    ]
    rows = []
    for label, what, chains, event in cases:
        opt = belady_hit_rate(chains, cap).hit_rate
        rates, recover = {}, {}
        for n in names:
            rec = _Recorder(default_block_registry().make(n, capacity=cap))
            r = replay_blocks(chains, cap, rec)
            rates[n] = r.hit_rate
            if event is not None:
                # the rate before the scan; recovery counted from the end of the scan
                end = event + (-(-4 * cap // 64) if label == "scan" else 0)
                recover[n] = recovery(rec.accesses, rec.hits, event, cap, after=end)
        rows.append({"case": label, "what": what, "capacity_blocks": cap, "belady": opt,
                     "hit_rate": rates, "recover_accesses": recover or None})
        print(f"  adversarial {label} @ {cap}: done", file=sys.stderr, flush=True)
    return rows


def _lead(row: dict) -> str:
    """The candidate's leader at the end, and the request it took the lead at."""
    lead = row.get("candidate_lead")
    if not lead:
        return ""
    at = lead["last_switch_request"]
    return lead["final"] + ("" if at is None else f" ({at:,})")


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--bundled", type=Path, default=DEFAULT_TRACE,
                    help="the trace split into tuning and held-out halves")
    ap.add_argument("--trace", type=Path, default=None,
                    help="a trace of your own (Mooncake-style JSON lines with hash_ids)")
    ap.add_argument("--capacities", default="1000,4000,16000")
    ap.add_argument("--requests", type=int, default=12000, help="requests per synthetic trace")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    ap.add_argument("--adversarial-capacity", type=int, default=1000)
    ap.add_argument("--only", default="", help="comma-separated trace labels to run (default all)")
    ap.add_argument("--split", choices=("report", "tuning"), default="report",
                    help="report: the rows above (default); tuning: the bundled trace's first "
                         "half and every generator at the tuning seeds, for choosing parameters")
    args = ap.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",") if c]
    if not capacities or min(capacities) < 1:
        ap.error(f"--capacities must be ints >= 1, got {args.capacities!r}")
    if args.requests < 1:
        ap.error(f"--requests must be >= 1, got {args.requests}")
    names = default_block_registry().names
    for must in (*ESTABLISHED, CANDIDATE, OLD_DEFAULT):
        if must not in names:
            ap.error(f"block policy {must!r} is not registered")
    if args.split == "tuning":
        if args.trace is not None or args.seed != 0:
            ap.error("--split tuning runs the tuning seeds on the bundled trace; "
                     "it takes neither --trace nor --seed")
        sets = tuning_sets(args.bundled, args.requests)
    else:
        used = {args.seed, args.seed + 1}  # the shifted generator runs at seed + 1
        if used & {*TUNING_SEEDS, TUNING_SEEDS[-1] + 1}:
            ap.error(f"--seed {args.seed}: its generators would run at a tuning seed "
                     f"({', '.join(map(str, TUNING_SEEDS))}, the shifted one at each + 1), "
                     f"so its rows would not be held out (use --split tuning)")
        sets = trace_sets(args.bundled, args.trace, args.requests, args.seed)
    only = {x for x in args.only.split(",") if x}
    rows = [run_row(label, split, ch, cap, names)
            for label, split, ch in sets if not only or label in only
            for cap in capacities]
    adv = adversarial(args.adversarial_capacity, names)
    costs = _costs(200_000, 16, 0)

    print(f"block hit rate per policy; default policy now: {DEFAULT_BLOCK_POLICY}; "
          f"best-est: best of {', '.join(ESTABLISHED)}")
    print(table(
        [(r["trace"], r["split"], r["capacity_blocks"],
          *(_pct(r["hit_rate"][n]) for n in names), _pct(r["belady"]),
          f"{r['of_belady'][CANDIDATE]:.3f}", f"{r['of_best_established'][CANDIDATE]:.4f}",
          f"{r['hit_rate'][CANDIDATE] / r['hit_rate'][OLD_DEFAULT]:.4f}", _lead(r))
         for r in rows],
        ("trace", "split", "blocks", *names, "belady", f"{CANDIDATE}/belady",
         f"{CANDIDATE}/best-est", f"{CANDIDATE}/{OLD_DEFAULT}", "lead (from request)"),
    ))
    print()
    print("policy cost: replay CPU time / LRU's in the same row")
    print(table(
        [(r["trace"], r["capacity_blocks"], *(f"{r['cpu_over_lru'][n]:.2f}" for n in names))
         for r in rows],
        ("trace", "blocks", *names),
    ))
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print(f"adversarial cases at {args.adversarial_capacity} blocks: hit rate "
          f"(accesses after the event until the hit rate over the last "
          f"{args.adversarial_capacity} accesses is back to 0.9 of its rate before)")
    print(table(
        [(a["case"], *(_pct(a["hit_rate"][n]) + (
            "" if a["recover_accesses"] is None else f" ({a['recover_accesses'][n]})")
            for n in names), _pct(a["belady"]))
         for a in adv],
        ("case", *names, "belady"),
    ))
    print()
    print(table(
        [("block key (blake2b, 16 tokens)", round(costs["key_us_per_block"], 3),
          round(costs["cpu_key_us_per_block"], 3)),
         ("index lookup + insert", round(costs["lookup_insert_us_per_block"], 3),
          round(costs["cpu_lookup_insert_us_per_block"], 3)),
         ("raw dict lookup + insert", round(costs["raw_dict_us_per_block"], 3),
          round(costs["cpu_raw_dict_us_per_block"], 3)),
         ("index / raw", round(costs["index_over_raw"], 2), "")],
        ("per block", "us (wall)", "us (cpu)"),
    ))
    losses = [(r["trace"], r["capacity_blocks"],
               round(100 * (r["hit_rate"][CANDIDATE] - r["best_established"]), 3),
               r["best_established_name"])
              for r in rows if r["hit_rate"][CANDIDATE] < r["best_established"]]
    old_losses = [(r["trace"], r["capacity_blocks"],
                   round(100 * (r["hit_rate"][CANDIDATE] - r["hit_rate"][OLD_DEFAULT]), 3))
                  for r in rows if r["hit_rate"][CANDIDATE] < r["hit_rate"][OLD_DEFAULT]]
    held4 = next((r["of_belady"][CANDIDATE] for r in rows
                  if r["trace"] == "bundled-2nd-half" and r["capacity_blocks"] == 4000), None)
    targets = {
        "candidate": CANDIDATE,
        "candidate_at_least_best_established_everywhere": not losses,
        "rows_below_best_established (trace, blocks, points, best)": losses,
        "rows_below_old_default (trace, blocks, points)": old_losses,
        "candidate_min_over_best_established": min(
            r["of_best_established"][CANDIDATE] for r in rows) if rows else None,
        "candidate_of_belady_at_4000_held_out": held4,
        "candidate_max_cpu_over_lru": max(r["cpu_over_lru"][CANDIDATE] for r in rows)
        if rows else None,
    }
    print()
    for k, v in targets.items():
        print(f"{k}: {v}")
    write_json(args.out, {"benchmark": "prefix", "rows": rows, "adversarial": adv,
                          "costs": costs, "targets": targets})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
