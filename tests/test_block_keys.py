"""Block keys: chained, full pages only, bound to their root; and a changed root gives no hit."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tiering.blocks import BlockIndex, KeyRoot, block_key, block_keys, root_key
from tiering.types import Tier

PAGE = 4


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _root(**kw) -> KeyRoot:
    args = dict(geometry_fingerprint="L2-H2-D8-T4-bfloat16", model_id="demo-4l", page_tokens=PAGE)
    args.update(kw)
    return KeyRoot(**args)


def test_one_key_per_full_page_and_the_partial_tail_is_never_keyed(rng):
    toks = rng.integers(0, 50_000, size=3 * PAGE + 2)
    keys = _root().keys(toks)
    assert len(keys) == 3
    assert len(_root().keys(toks[: PAGE - 1])) == 0
    # growing the partial tail changes nothing before it, and keys it once it is full
    longer = np.concatenate([toks, rng.integers(0, 50_000, size=PAGE - 2)])
    k2 = _root().keys(longer)
    assert k2[:3] == keys and len(k2) == 4


def test_keys_are_chained(rng):
    root = _root()
    a = rng.integers(0, 50_000, size=2 * PAGE)
    b = a.copy()
    b[0] += 1  # change one token of the first page only
    ka, kb = root.keys(a), root.keys(b)
    assert ka[0] != kb[0]
    assert ka[1] != kb[1], "the second page's key must depend on the first page"
    # the same second page after the same first page: the same key, from any call
    assert root.keys(a.tolist()) == ka
    assert block_key(ka[0], a[PAGE:]) == ka[1]


def test_key_format_is_a_stable_byte_string(rng):
    root = _root()
    toks = rng.integers(0, 2**31, size=PAGE)
    k = root.keys(toks)[0]
    assert isinstance(k, bytes) and len(k) == 16 and len(k.hex()) == 32
    expected = hashlib.blake2b(root.key, digest_size=16)
    expected.update(np.asarray(toks, dtype="<i8").tobytes())
    assert k == expected.digest()


@pytest.mark.parametrize(
    "change",
    [
        {"geometry_fingerprint": "L2-H2-D8-T4-float16"},
        {"model_id": "demo-4l-v2"},
        {"resource_fingerprints": (("kv", b"\x01"),)},
        {"page_tokens": PAGE + 1},
    ],
)
def test_a_changed_root_gives_no_hit(rng, change):
    toks = rng.integers(0, 50_000, size=5 * PAGE)
    old, new = _root(), _root(**change)
    assert old.key != new.key
    index = BlockIndex()
    parent = None
    for i, k in enumerate(old.keys(toks)):
        assert index.insert(k, parent, Tier.HOST, i, 0.0)
        parent = k
    assert index.match(old.keys(toks)).blocks == 5
    assert index.match(new.keys(toks)).blocks == 0


def test_resource_fingerprints_none_is_left_out_and_order_does_not_matter():
    a = root_key("g", "m", {"kv": b"x", "adapter": None})
    assert a == root_key("g", "m", {"kv": b"x"})
    assert root_key("g", "m", {"a": b"1", "b": b"2"}) == root_key("g", "m", {"b": b"2", "a": b"1"})
    # length-prefixed fields: moving a byte between fields changes the root
    assert root_key("gm", "x") != root_key("g", "mx")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: block_keys(b"short", [1, 2, 3, 4], 4), "root"),
        (lambda: block_keys(bytes(16), [1, -2, 3, 4], 4), ">= 0"),
        (lambda: block_keys(bytes(16), [[1, 2], [3, 4]], 2), "one-dimensional"),
        (lambda: block_keys(bytes(16), [1, 2, 3, 4], 0), "page_tokens"),
        (lambda: block_key(bytes(16), []), "at least one token"),
        (lambda: root_key("", "m"), "geometry_fingerprint"),
        (lambda: root_key("g", ""), "model_id"),
        (lambda: KeyRoot("g", "m", (("kv", b"1"), ("kv", b"2"))), "twice"),
        (lambda: KeyRoot("g", "m", page_tokens=0), "page_tokens"),
    ],
)
def test_bad_input_names_what_was_wrong(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_float_tokens_are_refused():
    with pytest.raises(TypeError, match="integers"):
        block_keys(bytes(16), np.array([1.5, 2.0, 3.0, 4.0]), 4)


@pytest.mark.parametrize(
    "fps, match",
    [
        ({"kvx": b"1"}, None),  # a dict: used to unpack each name's characters ("too many values")
        ([("kv", b"1")], None),  # a list: used to make the frozen root unhashable
        ((("kv", b"1", b"2"),), "each entry must be a \\(name, fingerprint\\) pair"),
        (("kv",), "each entry must be a \\(name, fingerprint\\) pair"),
        ("kv", "must be \\(name, fingerprint\\) pairs, got str"),
        (5, "must be \\(name, fingerprint\\) pairs, got int"),
    ],
)
def test_keyroot_resource_fingerprints_are_pairs_or_a_mapping(fps, match):
    if match is not None:
        with pytest.raises((ValueError, TypeError), match=match):
            _root(resource_fingerprints=fps)
        return
    r = _root(resource_fingerprints=fps)
    want = _root(resource_fingerprints=(("kv" if "kv" in dict(fps) else "kvx", b"1"),))
    assert r == want and r.key == want.key and hash(r) == hash(want)
    assert isinstance(r.resource_fingerprints, tuple)
    assert r.key != _root().key  # the fingerprint is part of the root (the control)


def test_root_key_names_a_bad_resource_name_even_beside_none_or_other_types():
    """Names of mixed types failed to sort with a bare TypeError; an empty name whose
    fingerprint was None was taken silently."""
    with pytest.raises(ValueError, match="a resource name must be a non-empty str, got 1"):
        root_key("g", "m", {1: b"x", "a": b"y"})
    with pytest.raises(ValueError, match="a resource name must be a non-empty str, got ''"):
        root_key("g", "m", {"": None})
    with pytest.raises(TypeError, match="must be a mapping of name to fingerprint, got int"):
        root_key("g", "m", 7)
    assert root_key("g", "m", [("a", b"y")]) == root_key("g", "m", {"a": b"y"})
