"""Integrity checks keep checking under ``python -O``.

``check_integrity`` (and the block-policy contract ``check_block_policy`` that users run
on their own policies) must raise on a broken record however Python runs: an ``assert``
statement is removed by ``-O``, so a check written with one passes everything there (the
stress tool and the caches' own checks would then report a broken index as sound). A
child interpreter started with ``-O`` breaks each checked component on purpose and
expects the error; the same script without ``-O`` is the control. A scan of the source
keeps ``assert`` statements out of every ``check_integrity`` of the product.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tiering", "resources", "policies")

SCRIPT = r'''
import random
import torch
from tiering.policies.blocks.generic import LRUBlocks
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry
from tiering.blocks import BlockIndex, KeyRoot
from tiering.coldtier import KnownBlocks
from tiering.coldtier.breaker import CircuitBreaker
from tiering.core.pools import PoolIntegrityError
from tiering.testing.blocks import check_block_policy
from tiering.types import Tier

print("optimized", not __debug__)
rng = random.Random(5)


def expect(name, call, error, text):
    try:
        call()
    except error as exc:
        print("RAISED" if text in str(exc) else f"WRONG {exc}", name)
        return
    print("PASSED", name)


index = BlockIndex()
parent = None
for i in range(4):
    key = rng.randbytes(8)
    if not index.insert(key, parent, Tier.HOST, i, float(i)):
        raise SystemExit("the chain was not inserted")
    parent = key
index.check_integrity()
index._counts[Tier.DEVICE] += 1
expect("block_index", index.check_integrity, AssertionError, "tier counts")

kb = KnownBlocks(4)
kb.add(rng.randbytes(16), 10)
kb.check_integrity()
kb._d[rng.randbytes(16)] = 0
expect("known_blocks", kb.check_integrity, AssertionError, "has size 0")

breaker = CircuitBreaker(clock=lambda: 0.0)
breaker.check_integrity()
breaker._trial_out = True
expect("breaker", breaker.check_integrity, AssertionError, "closed breaker has a trial out")

geom = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4)
kv = PagedKVCache(geom, "cpu", 8, 4)
kv.enable_prefix_cache(KeyRoot(geom.fingerprint(), "m", page_tokens=4))
kv.ingest_request("a")
kv.allocate("a", 8)
gen = torch.Generator().manual_seed(3)
k = torch.randn((8, 1, 8), generator=gen).to(geom.dtype)
kv.write("a", 0, 0, k, k)
kv.publish_prefix("a", torch.randint(0, 1000, (8,), generator=gen))
kv.check_integrity()
kv._prefix.index._counts[Tier.DISK] += 1
expect("kv_cache_block_index", kv.check_integrity, PoolIntegrityError, "block index: tier counts")
kv._prefix.index._counts[Tier.DISK] -= 1
kv.close()


class ForgetsRemovals(LRUBlocks):
    name = "forgets"

    def on_remove(self, key):
        pass  # keeps tracking what the index evicted


expect("check_block_policy", lambda: check_block_policy(ForgetsRemovals), AssertionError,
       "policy and index disagree")
'''

CHECKS = ["block_index", "known_blocks", "breaker", "kv_cache_block_index", "check_block_policy"]


@pytest.mark.parametrize("optimize", [True, False], ids=["python -O", "control"])
def test_integrity_checks_raise_with_and_without_optimization(optimize):
    flags = ["-O"] if optimize else []
    out = subprocess.run([sys.executable, *flags, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"optimized {optimize}", lines  # the child really ran as asked
    assert sorted(lines[1:]) == sorted(f"RAISED {name}" for name in CHECKS), out.stdout


def _asserts_in_checks():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "check_integrity":
                    found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(fn)
                              if isinstance(n, ast.Assert)]
    return found


def test_no_check_integrity_of_the_product_uses_an_assert_statement():
    checked = sum(1 for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                  if "def check_integrity" in p.read_text())
    assert checked >= 15, f"the scan found only {checked} files with a check_integrity"
    assert _asserts_in_checks() == [], "assert statements vanish under python -O"


def test_the_scan_finds_an_assert_in_a_check(tmp_path, monkeypatch):
    """The scan's negative control: a check written with an assert is found."""
    pkg = tmp_path / "tiering"
    pkg.mkdir()
    (pkg / "x.py").write_text("class A:\n    def check_integrity(self):\n        assert self.ok\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("tiering",))
    assert _asserts_in_checks() == ["tiering/x.py:3"]
