"""The ``tiering`` command: ``demo``, ``replay`` and ``stress``.

Each subcommand lives in its own package and is imported only when asked
for, so ``tiering --help`` stays fast and a missing optional piece cannot
break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "demo": ("tiering.apps.demo", "a small long-context worker on the tiered KV cache"),
    "replay": ("tiering.apps.replay", "replay a production trace against simulated tiers"),
    "stress": ("tiering.apps.stress", "stress the real cache under pressure with injected faults"),
}


_VERBOSITY = ("-v", "-vv", "-vvv", "--verbose", "-q", "--quiet")


def main(argv: list[str] | None = None) -> int:
    """``tiering [--version] [-v|-q] COMMAND ...``: ``-v``/``-q`` before the command
    reach it as if given after it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    flags: list[str] = []
    while argv and argv[0] in _VERBOSITY:
        flags.append(argv.pop(0))
    if argv and argv[0] in ("-V", "--version"):
        from tiering.apps.console import version

        print(f"tiering {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        p = argparse.ArgumentParser(prog="tiering", description="GPU memory-tiering offload manager")
        p.add_argument("-V", "--version", action="store_true", help="print the version and exit")
        p.add_argument("-v", "--verbose", action="count", default=0,
                       help="more log output (-v info, -vv debug); also after the command")
        p.add_argument("-q", "--quiet", action="store_true",
                       help="no progress, only errors logged; also after the command")
        sub = p.add_subparsers(dest="command", required=True)
        for name, (_, help_) in SUBCOMMANDS.items():
            sub.add_parser(name, help=help_, add_help=False)
        p.parse_args(argv[:1])  # prints help or names the unknown command, then exits
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return int(module.main(argv[1:] + flags) or 0)


if __name__ == "__main__":
    sys.exit(main())
