"""A cold tier on an object store, shared by many workers.

- :func:`open_s3_store` opens ``s3://bucket/prefix`` with ``storage_options`` (obstore client);
  an unreachable store raises :class:`ColdTierUnavailable` at start-up.
- :class:`SharedBlockStore` / :class:`BlockQueue`: published, content-addressed, write-once
  blocks, checked on read; the step path enqueues and polls, worker threads do the I/O.
- :class:`PrivatePrefix`: a worker's own offloads under a prefix it holds by a lease object.
- :func:`hold_zarr_prefix`: a zarr store on a held prefix (what ``DiskConfig(path="s3://...")``
  opens): writes checked against the lease, requests behind a breaker.
- :class:`Sweeper`: the cap on shared bytes, enforced by one elected worker (LRU).
- :class:`CircuitBreaker`: a store that stops answering is skipped until it answers again.
- :class:`TrustConfig` / :class:`MacKeys`: the deployment secret every object's MAC is keyed
  with (``TIERING_COLDTIER_SECRET``); without one the tier refuses to open unless
  ``trust="unauthenticated"`` is given.
"""

from .blocks import (
    BlockQueue,
    BlockResult,
    BlockStatus,
    ColdTierConfig,
    KnownBlocks,
    SharedBlockStore,
    SharedTierConfig,
    block_path,
    geometry_tag,
)
from .breaker import BreakerConfig, BreakerState, CircuitBreaker
from .errors import ColdTierError, ColdTierUnavailable, LeaseHeld, LeaseLost
from .frame import FrameRefused, frame, unframe
from .held import HeldPrefix, LeasedZarrStore, PrefixLeaseLost, StoreNotAnswering, hold_zarr_prefix
from .lease import Lease, LeaseConfig, LeaseInfo, LeaseKeeper
from .private import PrivatePrefix
from .s3 import S3Location, open_s3_store, open_zarr_store, parse_s3_url, probe
from .sweeper import HitLog, Sweeper, SweeperConfig, SweepResult
from .trust import PREVIOUS_SECRET_ENV, SECRET_ENV, MacKeys, TrustConfig

__all__ = [
    "BlockQueue", "BlockResult", "BlockStatus", "BreakerConfig", "BreakerState", "CircuitBreaker",
    "ColdTierConfig", "ColdTierError", "ColdTierUnavailable", "FrameRefused", "HitLog",
    "KnownBlocks", "Lease", "MacKeys", "PREVIOUS_SECRET_ENV", "SECRET_ENV", "TrustConfig", "LeaseConfig", "LeaseHeld", "LeaseInfo", "LeaseKeeper", "LeaseLost",
    "HeldPrefix", "LeasedZarrStore", "PrefixLeaseLost", "PrivatePrefix", "S3Location", "SharedBlockStore", "SharedTierConfig",
    "StoreNotAnswering", "SweepResult", "Sweeper", "SweeperConfig", "hold_zarr_prefix",
    "block_path", "frame", "geometry_tag", "open_s3_store", "open_zarr_store", "parse_s3_url", "probe", "unframe",
]
