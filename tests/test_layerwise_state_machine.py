"""A hypothesis state machine over layer-wise reloads and streamed requests.

Each reload is held at a drawn layer by the copy fault hook, so the machine acts
while later layers are still copying: it reads what landed, grows the request,
removes it, lets the copy finish or fail at a drawn layer. A streamed request
(longer than the device) grows and is read in between. After every step the
cache's integrity holds and every read is the bytes written.
"""

from __future__ import annotations

import threading

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiering.resources.base import ResourceStep, StepContext
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.types import RequestState

S = RequestState
L = 3
GEOM = KVGeometry(num_layers=L, num_kv_heads=1, head_dim=4, page_tokens=2, dtype=torch.float32)


class Gate:
    """Holds the copy of layer ``hold`` of the armed reload; fails the copy of layer ``fail``.

    A layer of a reload may be several copies (one per run of adjacent pages), so the
    layer is read from the reload's progress: when layer L copies, L layers have landed."""

    def __init__(self) -> None:
        self.arm(None, None, None)

    def arm(self, progress, hold, fail) -> None:
        self.progress, self.hold, self.fail = progress, hold, fail
        self.release, self.reached = threading.Event(), threading.Event()

    def __call__(self, kind: str) -> None:
        p = self.progress
        if kind != "h2d" or p is None or self.hold is None:
            return
        layer = p() if callable(p) else None
        if layer == self.hold and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(10)
        if layer == self.fail:
            raise OSError(5, f"injected fault on layer {layer}")


class LayerwiseMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.kv = PagedKVCache(GEOM, device_pages=14, host_pages=40, layerwise_reload=True,
                               copy_fault_hook=self.gate, stream_window_pages=3,
                               stream_buffer_pages=2)
        self.data: dict[str, list[list[torch.Tensor]]] = {}  # rid -> per layer [k, v] rows
        self.gen = torch.Generator().manual_seed(0)
        self.n = 0
        self.partial: str | None = None  # the request whose reload is held
        self.pending: list[tuple[int, int, int]] = []  # (layer, start, n) an early step owes

    def teardown(self):
        self.gate.release.set()
        self.kv.close()

    def _rand(self, n):
        return torch.randn(n, 1, 4, generator=self.gen)

    def _write(self, rid, start, n):
        for layer in range(L):
            k, v = self._rand(n), self._rand(n)
            self.kv.write(rid, layer, start, k, v)
            old = self.data[rid][layer]
            self.data[rid][layer] = [torch.cat([old[0], k]), torch.cat([old[1], v])]

    def _check(self, rid, layers=range(L)):
        for layer in layers:
            k, v = self.kv.read(rid, layer)
            want = self.data[rid][layer]
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), (rid, layer)

    @precondition(lambda self: self.partial is None)
    @rule(tokens=st.integers(1, 8))
    def add(self, tokens):
        rid = f"r{self.n}"
        self.n += 1
        self.kv.ingest_request(rid)
        if not self.kv.allocate(rid, tokens):
            self.kv.remove_request(rid)
            return
        self.data[rid] = [[torch.empty(0, 1, 4), torch.empty(0, 1, 4)] for _ in range(L)]
        self._write(rid, 0, tokens)

    @precondition(lambda self: self.partial is None and self.data)
    @rule(i=st.integers(0, 99), grow=st.integers(1, 4))
    def grow(self, i, grow):
        """Grows a resident request; one that outgrows the device streams."""
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is not S.RESIDENT:
            return
        n = self.kv.num_tokens(rid)
        if self.kv.allocate(rid, n + grow):
            self._write(rid, n, grow)

    @precondition(lambda self: self.partial is None and self.data)
    @rule(i=st.integers(0, 99), steps=st.integers(1, 8))
    def grow_long(self, i, steps):
        """Grows a resident request by a window's worth at a time, past the device."""
        rid = sorted(self.data)[i % len(self.data)]
        for _ in range(steps):
            if self.kv.state_of(rid) is not S.RESIDENT:
                return
            n = self.kv.num_tokens(rid)
            if not self.kv.allocate(rid, n + 4):  # a 3-page window takes 2 new pages at once
                return
            self._write(rid, n, 4)
        if self.kv.is_streamed(rid):
            assert self.kv.reclaimable(rid) == 0 and self.kv.offload(rid) == 0

    @precondition(lambda self: self.partial is None and self.data)
    @rule(i=st.integers(0, 99))
    def offload(self, i):
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is S.RESIDENT and self.kv.offload(rid):
            self.kv.synchronize()

    @precondition(lambda self: self.partial is None and self.data)
    @rule(i=st.integers(0, 99), hold=st.integers(0, L - 1), fail=st.none() | st.integers(0, L))
    def reload_held(self, i, hold, fail):
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is not S.ON_HOST:
            return
        rec = self.kv._reqs[rid]
        if fail is not None and not hold <= fail < L:
            fail = None  # only a layer at or after the held one, of the L there are
        # before the cache puts the progress on the record, nothing has landed
        self.gate.arm(lambda: rec.layers.ready if rec.layers is not None else 0, hold, fail)
        if not self.kv.reload(rid):
            self.gate.arm(None, None, None)
            return
        assert self.gate.reached.wait(10)
        self.partial = rid
        ok = self.kv.admit(ResourceStep(rid), StepContext(0)).ok
        assert ok == (hold >= 1)  # ready from layer 0 exactly when layer 0 has landed
        if ok:
            self._check(rid, range(hold))

    @precondition(lambda self: self.partial is not None)
    @rule()
    def finish(self):
        rid, self.partial = self.partial, None
        fail = self.gate.fail
        self.gate.release.set()
        self.kv.synchronize()
        if fail is None:
            assert self.kv.state_of(rid) is S.RESIDENT
            for layer, start, n in self.pending:  # the early step's rows of the later layers
                k, v = self._rand(n), self._rand(n)
                self.kv.write(rid, layer, start, k, v)
                old = self.data[rid][layer]
                self.data[rid][layer] = [torch.cat([old[0], k]), torch.cat([old[1], v])]
            self._check(rid)
        else:  # back on the host with what was reloaded: the early step's tokens are gone
            assert self.kv.state_of(rid) is S.ON_HOST
            n = self.kv.num_tokens(rid)
            self.data[rid] = [[k[:n], v[:n]] for k, v in self.data[rid]]
        self.pending = []
        self.gate.arm(None, None, None)

    @precondition(lambda self: self.partial is not None)
    @rule(grow=st.integers(1, 3))
    def grow_early(self, grow):
        rid = self.partial
        if not self.kv.admit(ResourceStep(rid), StepContext(0)).ok:
            return
        n = self.kv.num_tokens(rid)
        if self.kv.allocate(rid, n + grow):  # the early step's new tokens, layer 0 only landed
            k, v = self._rand(grow), self._rand(grow)
            self.kv.write(rid, 0, n, k, v)
            # the other layers' rows now if they have landed, else once they do
            old = self.data[rid][0]
            self.data[rid][0] = [torch.cat([old[0], k]), torch.cat([old[1], v])]
            for layer in range(1, L):
                if self.kv.wait_layer(rid, layer, timeout=0):
                    k, v = self._rand(grow), self._rand(grow)
                    self.kv.write(rid, layer, n, k, v)
                    old = self.data[rid][layer]
                    self.data[rid][layer] = [torch.cat([old[0], k]), torch.cat([old[1], v])]
                else:  # written once the layer has landed (finish)
                    self.pending.append((layer, n, grow))

    @precondition(lambda self: self.partial is not None)
    @rule()
    def remove_partial(self):
        rid, self.partial = self.partial, None
        self.kv.remove_request(rid)
        del self.data[rid]
        self.pending = []
        self.gate.release.set()
        self.kv.synchronize()
        self.gate.arm(None, None, None)

    @precondition(lambda self: self.partial is None and self.data)
    @rule(i=st.integers(0, 99), layer=st.integers(0, L - 1))
    def read(self, i, layer):
        rid = sorted(self.data)[i % len(self.data)]
        if self.kv.state_of(rid) is S.RESIDENT:
            self._check(rid, [layer])

    @invariant()
    def integrity(self):
        self.kv.check_integrity()


LayerwiseMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestLayerwise = LayerwiseMachine.TestCase
