"""The shared tier's ``BlockQueue`` (the step path's side of the cold tier), driven by a
hypothesis state machine over obstore's in-memory store against a plain model.

Rules queue publishes, fetches, deletes and refreshes (a batch of them runs on the
queue's threads at once; within a batch a key is used by one request, and a refresh runs
alone), another worker
publishes into the same root, an object is damaged in place, and a ``settle`` waits
(bounded) for the batch and checks every result: a publish is WRITTEN the first time and
DUPLICATE after, a fetch is a HIT with exactly the bytes first published or LOST (missing,
or refused when damaged, never the wrong bytes), a delete removes the block. A submit
answers False without queueing when the model says it must (a block known to exist is not
published again; an unknown one is not fetched). ``check_integrity`` after every step.
"""

from __future__ import annotations

import random

import obstore
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from obstore.store import MemoryStore

from tiering.coldtier import BlockQueue, BlockStatus, SharedBlockStore
from tiering.coldtier.blocks import block_path
from tiering.coldtier.trust import TrustConfig

GEOM = b"geometry"
TRUST = TrustConfig(secret=random.Random(22).randbytes(32))


class QueueMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed):
        self.rng = random.Random(seed)
        self.mem = MemoryStore()
        self.root = self.rng.randbytes(16)
        self.q = BlockQueue(SharedBlockStore(self.mem, self.root, GEOM, trust=TRUST))
        self.other = SharedBlockStore(self.mem, self.root, GEOM, trust=TRUST)  # another worker
        self.keys = [self.rng.randbytes(16) for _ in range(4)]
        self.stored: dict[bytes, bytes] = {}  # what the object store holds, intact
        self.damaged: set[bytes] = set()
        self.batch: dict[bytes, tuple[str, bytes | None]] = {}  # key -> (op, payload)
        self.refreshing = False
        self.results = 0

    def _free_key(self, data):
        if self.refreshing:
            return None  # a listing runs alone: what it sees (and adds to known) is then exact
        free = [k for k in self.keys if k not in self.batch]
        return data.draw(st.sampled_from(free)) if free else None

    @rule(data=st.data(), size=st.integers(1, 300))
    def publish(self, data, size):
        key = self._free_key(data)
        if key is None:
            return
        payload = self.rng.randbytes(size)
        known = self.q.blocks.known.peek(key)
        queued = self.q.submit_publish(key, payload)
        assert queued == (not known), (queued, known)
        if queued:
            self.batch[key] = ("publish", payload)

    @rule(data=st.data(), known_one=st.booleans())
    def fetch(self, data, known_one):
        key = self._free_key(data)
        if key is None:
            return
        known_free = [k for k in self.keys if k not in self.batch and self.q.blocks.known.peek(k)]
        if known_one and known_free:  # mostly a block known to exist: the store is asked
            key = data.draw(st.sampled_from(known_free))
        known = self.q.blocks.known.peek(key)
        queued = self.q.submit_fetch(key)
        assert queued == known, (queued, known)  # a local miss asks nothing of the store
        if queued:
            self.batch[key] = ("fetch", None)

    @rule(data=st.data())
    def delete(self, data):
        key = self._free_key(data)
        if key is None:
            return
        assert self.q.submit_delete(key)
        self.batch[key] = ("delete", None)

    @rule()
    def refresh(self):
        if self.batch or self.refreshing:
            return  # a listing races the batch's writes: run it alone
        assert self.q.submit_refresh()
        self.refreshing = True

    @rule(data=st.data(), size=st.integers(1, 300))
    def other_worker_publishes(self, data, size):
        key = self._free_key(data)
        if key is None or self.batch:
            return
        payload = self.rng.randbytes(size)
        res = self.other.publish(key, payload)
        if key in self.stored or key in self.damaged:
            assert res.status is BlockStatus.DUPLICATE
        else:
            assert res.status is BlockStatus.WRITTEN
            self.stored[key] = payload

    @rule(data=st.data())
    def damage(self, data):
        intact = [k for k in sorted(self.stored) if k not in self.batch]
        if not intact or self.refreshing or self.batch:
            return
        key = data.draw(st.sampled_from(intact))
        raw = bytearray(obstore.get(self.mem, block_path(self.root, GEOM, key)).bytes())
        # any byte but the frame version: an object of another version is refused and kept
        # (a worker of another release may read it), never deleted
        pos = self.rng.choice([i for i in range(len(raw)) if i != 4])
        raw[pos] ^= 0x5A
        obstore.put(self.mem, block_path(self.root, GEOM, key), bytes(raw))
        del self.stored[key]
        self.damaged.add(key)
        if self.q.submit_fetch(key):  # read it back at once: it must be refused, not served
            self.batch[key] = ("fetch", None)

    @rule()
    def settle(self):
        assert self.q.wait_idle(30), "the queue did not finish its batch"
        results = self.q.poll()
        want = len(self.batch) + (1 if self.refreshing else 0)
        assert len(results) == want, (results, self.batch)
        for res in results:
            self.results += 1
            event(f"{res.op} {res.status.value}")
            if res.op == "refresh":
                assert res.status is BlockStatus.LISTED
                assert res.nbytes == len(self.stored) + len(self.damaged)
                continue
            op, payload = self.batch.pop(res.key)
            assert res.op == op, (res, op)
            if op == "publish":
                if res.key in self.stored or res.key in self.damaged:
                    assert res.status is BlockStatus.DUPLICATE, res
                else:
                    assert res.status is BlockStatus.WRITTEN, res
                    self.stored[res.key] = payload
            elif op == "fetch":
                if res.key in self.stored:
                    assert res.status is BlockStatus.HIT and res.payload == self.stored[res.key]
                else:
                    assert res.status is BlockStatus.LOST and res.payload is None, res
                    assert ("refused" if res.key in self.damaged else "missing") in res.reason
                    self.damaged.discard(res.key)  # a refused object is removed
                    assert not self.q.blocks.known.peek(res.key)
            else:
                assert res.status is BlockStatus.DELETED, res
                self.stored.pop(res.key, None)
                self.damaged.discard(res.key)
                assert not self.q.blocks.known.peek(res.key)
        assert not self.batch
        self.refreshing = False

    @invariant()
    def integrity(self):
        if not hasattr(self, "q"):
            return
        self.q.check_integrity()
        assert self.q.in_flight <= len(self.batch) + (1 if self.refreshing else 0)

    def teardown(self):
        if hasattr(self, "q"):
            self.q.close(30)


QueueMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestQueueMachine = QueueMachine.TestCase
