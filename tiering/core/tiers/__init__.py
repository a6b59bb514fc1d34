"""Tiers as objects: where pages live (``Tier``), how bytes get between two tiers
(``Link``), and the ordered chain of both (``TierChain``).

- A ``Tier`` owns its ledger: pages reserved and released per owner, used and free pages
  and bytes, ``check_integrity``. Its ``role`` (DEVICE, HOST or DISK) is what the request
  lifecycle calls a request at rest there; several tiers may share the HOST or DISK role.
- A ``Link`` copies bytes one way between two named tiers and returns a ``Copy`` (when
  the bytes started moving and when they landed).
- A ``TierChain`` orders the tiers fastest first and holds the links; a move is a
  (source, destination) pair of the chain, copied over its route.

Built in: ``PageTier`` (a counted ledger, no bytes), ``ModelledLink`` (time from bandwidth
and latency), ``InstantLink`` (lands at once), and ``PageMover``, the mover of the backends
that count pages. ``tiering.testing.tiers`` holds the contracts every implementation passes.
"""

from tiering.core.tiers.base import Copy, Link, Role, Tier, check_name, check_pages
from tiering.core.tiers.chain import TierChain
from tiering.core.tiers.counted import PageTier
from tiering.core.tiers.links import InstantLink, ModelledLink
from tiering.core.tiers.mover import BLOCKS, ChainRecord, PageMover

__all__ = ["BLOCKS", "ChainRecord", "Copy", "InstantLink", "Link", "ModelledLink",
           "PageMover", "PageTier", "Role", "Tier", "TierChain", "check_name", "check_pages"]
