"""The disk tier: KV pages in a zarr array under a hard byte cap.

``store`` is the public API (``DiskPageStore``, ``DiskConfig`` and the errors);
``faults`` the fault-injection seam; the other modules are its parts (see the
``store`` module docstring).
"""

from tiering.disk.config import DiskConfig
from tiering.disk.faults import FaultPlan, FaultyStore
from tiering.disk.ledger import DiskExtent, DiskIntegrityError
from tiering.disk.lock import DiskPathInUseError, PathLease
from tiering.disk.store import DiskCorruptionError, DiskIOError, DiskPageStore

__all__ = [
    "DiskConfig",
    "DiskCorruptionError",
    "DiskExtent",
    "DiskIOError",
    "DiskIntegrityError",
    "DiskPageStore",
    "DiskPathInUseError",
    "FaultPlan",
    "FaultyStore",
    "PathLease",
]
