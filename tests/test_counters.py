"""``counter_record``: the one helper behind the plain counter records."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from tiering.apps.stress.records import HarnessCounts
from tiering.core.counters import counter_record
from tiering.integrations.vllm._core import Counters

Sample = counter_record(
    "Sample",
    "alpha beta\n    gamma",
    doc="A sample record.",
    module=__name__,
    extra=[("seen", dict[str, int], dataclasses.field(default_factory=dict))],
)


def test_fields_start_at_zero_count_and_compare():
    a = Sample()
    assert dataclasses.is_dataclass(a) and Sample.__doc__ == "A sample record."
    assert a.as_dict() == {"alpha": 0, "beta": 0, "gamma": 0, "seen": {}}
    a.beta += 3
    a.seen["EIO"] = 2
    assert a.as_dict() == {"alpha": 0, "beta": 3, "gamma": 0, "seen": {"EIO": 2}}
    assert a != Sample() and Sample(beta=3, seen={"EIO": 2}) == a
    assert Sample().seen is not Sample().seen  # the extra default is per instance


def test_records_pickle_and_name_their_module():
    a = Sample(alpha=5)
    assert pickle.loads(pickle.dumps(a)) == a
    assert Sample.__module__ == __name__ and Sample.__qualname__ == "Sample"
    assert repr(a).startswith("Sample(alpha=5,")


@pytest.mark.parametrize(
    "counters,extra,needle",
    [
        ("", (), "no counter names"),
        ("ok 2bad", (), "not identifiers: ['2bad']"),
        ("a b a", (), "repeat: ['a']"),
        ("a b", [("b", int, dataclasses.field(default=1))], "repeat: ['b']"),
    ],
)
def test_bad_names_are_refused_by_name(counters, extra, needle):
    with pytest.raises(ValueError, match="'Bad'") as err:
        counter_record("Bad", counters, doc="", module=__name__, extra=extra)
    assert needle in str(err.value)


def test_the_project_records_keep_their_fields():
    h = HarnessCounts()
    assert h.steps == 0 and h.steps_at_high == 0 and len(h.as_dict()) == 29
    c = Counters(lookups=2)
    names = [f.name for f in dataclasses.fields(c)]
    assert c.lookups == 2 and c.drops_deferred == 0 and len(names) == len(set(names)) == 35
    # the store-to-disk, bounded-lookup and shared-tier counters of the vLLM manager
    for name in ("stores_staged", "lookups_timed_out", "shared_hits", "direct_reads_failed"):
        assert getattr(c, name) == 0, name
    with pytest.raises(TypeError):
        Counters(no_such_counter=1)
