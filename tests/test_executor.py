"""The priority executor: reloads overtake queued writes; shutdown is bounded."""

from __future__ import annotations

import threading

import pytest

from tiering.core.executor import OFFLOAD, RELOAD, WRITE, PriorityExecutor


def test_reload_runs_before_writes_queued_earlier(closing):
    ex = PriorityExecutor(1, "t")
    gate = threading.Event()
    order: list[str] = []
    closing.call(ex.shutdown, 5)
    closing.call(gate.set)
    blocker = ex.submit(WRITE, gate.wait, 10)
    futs = [ex.submit(WRITE, order.append, f"w{i}") for i in range(3)]
    futs.append(ex.submit(OFFLOAD, order.append, "o"))
    futs.append(ex.submit(RELOAD, order.append, "r"))
    gate.set()
    blocker.result(10)
    for f in futs:
        f.result(10)
    assert order == ["r", "o", "w0", "w1", "w2"]


def test_exceptions_reach_the_future_and_workers_survive(closing):
    ex = PriorityExecutor(2, "t")
    closing.call(ex.shutdown, 5)
    bad = ex.submit(RELOAD, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.result(5)
    assert ex.submit(RELOAD, lambda: 7).result(5) == 7


def test_submit_after_shutdown_is_refused():
    ex = PriorityExecutor(1, "t")
    ex.shutdown(5)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.submit(RELOAD, print)
    with pytest.raises(ValueError, match="workers"):
        PriorityExecutor(0, "t")


def test_shutdown_says_whether_every_worker_joined(closing):
    ex = PriorityExecutor(1, "t")
    gate = threading.Event()
    closing.call(ex.shutdown, 5)
    closing.call(gate.set)
    ex.submit(RELOAD, gate.wait, 10)
    assert ex.shutdown(0.05) is False  # the worker is still in its job
    gate.set()
    assert ex.shutdown(5) is True  # a second call waits again, and reports


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1, True])
def test_shutdown_with_a_bad_timeout_is_refused_and_stops_nothing(timeout, closing):
    ex = PriorityExecutor(1, "t")
    closing.call(ex.shutdown, 5)
    with pytest.raises(ValueError, match="PriorityExecutor.shutdown: timeout"):
        ex.shutdown(timeout)
    assert ex.submit(RELOAD, int, "41").result(timeout=5) == 41  # still taking jobs
    assert ex.shutdown(5) is True


@pytest.mark.parametrize("workers", [0, True, 2.0, "2", None])
def test_workers_must_be_a_positive_int(workers):
    with pytest.raises(ValueError, match=f"workers must be an int >= 1, got {workers!r}"):
        PriorityExecutor(workers, "t")


@pytest.mark.parametrize("priority,fn,match", [
    ("high", int, "priority must be an int"),
    (1.5, int, "priority must be an int"),
    (None, int, "priority must be an int"),
    (RELOAD, "not callable", "fn must be callable"),
])
def test_a_bad_submit_is_refused_and_leaves_the_queue_working(priority, fn, match, closing):
    ex = PriorityExecutor(1, "t")
    closing.call(ex.shutdown, 5)
    gate = threading.Event()
    closing.call(gate.set)
    held = ex.submit(RELOAD, gate.wait, 10)  # the worker is busy: later jobs wait in the queue
    queued = ex.submit(WRITE, int, "7")
    with pytest.raises(ValueError, match=match):
        ex.submit(priority, fn, "8")
    gate.set()
    assert held.result(timeout=5) is True
    assert queued.result(timeout=5) == 7  # the queue's order was not poisoned
    assert ex.submit(OFFLOAD, int, "9").result(timeout=5) == 9
    assert ex.shutdown(5) is True


def test_an_executor_that_cannot_start_all_its_threads_stops_those_it_started(monkeypatch):
    """When the platform refused a thread (its limit reached: a huge copy_workers), the
    threads already started were left blocked on the queue for ever, and the error named
    no count. Now they are stopped and the error says how many started of how many."""
    import threading

    from tiering.core.executor import PriorityExecutor

    before = {t.ident for t in threading.enumerate()}
    real_start, calls = threading.Thread.start, []

    def start(self):
        calls.append(self.name)
        if len(calls) == 4:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match=r"tiering-x: could start only 3 of the 6 worker "
                                           r"threads asked for: can't start new thread"):
        PriorityExecutor(6, "tiering-x")
    monkeypatch.undo()
    left = [t for t in threading.enumerate() if t.ident not in before]
    assert not [t.name for t in left if t.name.startswith("tiering-x")]
    ex = PriorityExecutor(2, "tiering-y")  # the control: a full start runs jobs
    assert ex.submit(0, lambda: 7).result(timeout=5) == 7 and ex.shutdown(5.0)


def test_a_cache_whose_copy_threads_cannot_all_start_leaves_no_thread_running(monkeypatch, tmp_path):
    """The cache's second executor failing to start left the first one's threads running
    (the cache never got the part that would stop them)."""
    import threading

    from tiering.resources.kv_cache import PagedKVCache
    from tiering.resources.kv_geometry import KVGeometry

    before = {t.ident for t in threading.enumerate()}
    real_start = threading.Thread.start

    def start(self):
        if self.name.startswith("tiering-h2d"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="tiering-h2d: could start only 0 of the 2"):
        PagedKVCache(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=4),
                     device_pages=4, host_pages=4)
    monkeypatch.undo()
    left = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not [n for n in left if n.startswith("tiering-")], left
