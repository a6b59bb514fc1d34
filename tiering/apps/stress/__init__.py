"""``tiering stress``: the real cache under memory pressure and injected faults.

Drives ``PagedKVCache``, ``EvictionController`` and the disk tier with a
random workload whose KV is regenerable from the seed, so every byte read
back is checked; injects disk and copy faults and accounts for each one;
checks integrity continuously and that every tier is empty at the end.
See ``tiering.apps.stress.harness`` for the workload and ``tiering.apps.stress.crash``
for the kill-and-reattach check.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tiering stress`` (see ``tiering.apps.stress.cli``)."""
    from tiering.apps.stress.cli import main as cli_main

    return cli_main(argv)
