"""The process the crash check kills: commits requests to disk until it is stopped.

Run as ``python -m tiering.apps.stress.crash_child --dir DIR --seed N``. Each round
it releases an older committed request now and then, then offloads two fresh
requests (KV regenerable from (seed, rid)) straight to disk and waits for
their commits. Every chunk write first waits a little (a slow disk), so a kill
lands in the middle of writes. It reports on stdout, one line each:

``commit-begin RID TOKENS`` / ``commit-end RID`` / ``commit-abandoned RID``,
``release-begin RID`` / ``release-end RID``, and ``io`` as a chunk write starts.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

from tiering.apps.stress.crash import MAX_PAGES, MIN_PAGES, crash_cache, expected_kv
from tiering.apps.stress.kvdata import derived_seed, write_tokens
from tiering.disk.faults import FaultPlan, FaultyStore
from tiering.types import RequestState

KEEP = 8  # committed requests kept at most (3 chunks each fits the 32-chunk tier)
SLOW_SECONDS = 0.02

_print_lock = threading.Lock()


def _say(*words: object) -> None:
    with _print_lock:
        sys.stdout.write(" ".join(str(w) for w in words) + "\n")
        sys.stdout.flush()


def _slow(seconds: float) -> None:
    _say("io")
    time.sleep(seconds)  # the slow disk itself, in this throwaway process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiering.apps.stress.crash_child")
    p.add_argument("--dir", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--rounds", type=int, default=10_000, help="stop after this many rounds")
    args = p.parse_args(argv)
    rng = random.Random(derived_seed("crash", args.seed))
    plan = FaultPlan(seed=args.seed, sleep=_slow, slow_seconds=SLOW_SECONDS)
    plan.arm("slow", probability=1.0)
    kv = crash_cache(args.dir, io_workers=2, disk_wrap_store=lambda s: FaultyStore(s, plan))
    _say("ready")
    on_disk: list[str] = []
    for n in range(args.rounds):
        while on_disk and (len(on_disk) > KEEP - 2 or rng.random() < 0.3):
            rid = on_disk.pop(rng.randrange(len(on_disk)))
            _say("release-begin", rid)
            kv.remove_request(rid)
            _say("release-end", rid)
        fresh = [f"c{n}.{j}" for j in range(2)]
        for rid in fresh:
            tokens = rng.randint((MIN_PAGES - 1) * 8 + 1, MAX_PAGES * 8)
            _say("commit-begin", rid, tokens)
            kv.ingest_request(rid)
            if not kv.allocate(rid, tokens):
                raise RuntimeError(f"no device room for {rid}")
            write_tokens(kv.write, rid, expected_kv(args.seed, rid), 0, tokens)
            kv.offload(rid)
        kv.synchronize(60)
        for rid in fresh:
            if kv.state_of(rid) is RequestState.ON_DISK:
                on_disk.append(rid)
                _say("commit-end", rid)
            else:
                kv.remove_request(rid)
                _say("commit-abandoned", rid)
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
