"""One tensor-free request state machine, shared by every KV backend.

``PagedKVCache`` (threads, CUDA and zarr copies), the replay's
``ModeledKVCache`` (simulated link time) and ``tiering.testing``'s
``FakeTieredResource`` (instant, or completed when a test says) keep their
requests in a ``Lifecycle``. It owns what they must agree on:

- the request records (state, pages held per tier, the move in flight);
- the legal transitions (``tiering.types.check_transition``) and the one table
  of which tiers each state holds (``HOLDS``);
- the guard messages (``UnknownRequest``, ``CacheClosed``, ``IllegalTransition``);
- the counters (``Counters``: one set of names);
- the move choice (``offload_move``: host, or disk when the host is full and
  that is allowed);
- begin / land / survive / cancel / lose of a move, each returning a
  ``TransferResult``;
- ``check`` of the records against the per-tier page ledger.

What differs between the backends is the mover behind the machine: what a
tier's pages *are* (slot lists and disk extents, or plain counts) and how a
copy runs. A backend gives the machine one release function per tier (a typed
``Tier -> handler`` table) and its records say what they hold (``held``).
Nothing here imports torch or touches bytes.
"""

from tiering.core.lifecycle.machine import Lifecycle, LifecycleAnswers
from tiering.core.lifecycle.tables import (
    AT_REST,
    FAILURE_COUNTERS,
    GUARDS,
    HOLDS,
    IN_FLIGHT,
    MOVE_COUNTERS,
    RELOAD_FROM,
    TIER_INDEX,
    TIERS,
    Counters,
    Job,
    Op,
    PageLedger,
    PageRecord,
    Record,
    guard,
    holds,
    ledger_maps,
    offload_move,
    page_release_all,
    page_releasers,
)

__all__ = [
    "AT_REST", "FAILURE_COUNTERS", "GUARDS", "HOLDS", "IN_FLIGHT", "MOVE_COUNTERS", "RELOAD_FROM",
    "TIER_INDEX", "TIERS", "Counters", "Job", "Lifecycle", "LifecycleAnswers", "Op", "PageLedger",
    "PageRecord", "Record", "guard", "holds", "ledger_maps", "offload_move", "page_release_all",
    "page_releasers",
]
