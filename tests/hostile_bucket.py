"""A hostile client of the shared bucket: it has write access but not the deployment secret.

``Adversary(store, rng)`` works on any obstore store (a real SeaweedFS in the trust tests).
Each method does one thing to the objects workers publish under ``blocks/`` and returns what it
did: ``rewrite`` (random bytes), ``copy`` (one block's object under another block's name),
``truncate``, ``enlarge`` (to ``grow`` bytes, past any frame), ``replay`` (an object saved
earlier put back, possibly under another name), ``forge`` (a correctly framed object holding
other bytes, with a fresh crc: unkeyed, or under a key of its own; also planted under a name in
``targets`` before any worker published it), ``delete``. None when there
is nothing to act on. It never reads the secret and never calls a worker.
"""

from __future__ import annotations

import random

import obstore

from tiering.coldtier.frame import KIND_BLOCK, frame, framed_size
from tiering.coldtier.trust import MacKeys

ACTIONS = ("rewrite", "copy", "truncate", "enlarge", "replay", "forge", "delete")


class Adversary:
    def __init__(self, store, rng: random.Random, *, grow: int = 1 << 20,
                 targets: tuple[str, ...] = (), payload_bytes: int = 1024) -> None:
        self.store = store
        self.rng = rng
        self.grow = grow
        self.targets = targets  # names workers will read, published or not (forge plants them)
        self.payload_bytes = payload_bytes
        self.saved: list[bytes] = []  # objects seen, for replays
        self.own_key = MacKeys(rng.randbytes(32))  # not the deployment secret

    def names(self) -> list[str]:
        return sorted(m["path"] for c in obstore.list(self.store, prefix="blocks/") for m in c)

    def _pick(self, planted: bool = False) -> str | None:
        names = self.names()
        if planted:
            names = sorted(set(names) | set(self.targets))
        return self.rng.choice(names) if names else None

    def _get(self, name: str) -> bytes | None:
        try:
            raw = bytes(obstore.get(self.store, name).bytes())
        except FileNotFoundError:
            return None
        self.saved.append(raw)
        del self.saved[:-16]
        return raw

    def _put(self, name: str, data: bytes) -> None:
        obstore.put(self.store, name, data)

    def act(self, action: str, ids: tuple[bytes, bytes] | None = None) -> str | None:
        """Do ``action`` to a random block object. ``ids`` (root, geometry) is what ``forge``
        frames its object with (what a worker reading that name expects)."""
        name = self._pick(planted=action in ("forge", "replay", "copy"))
        if name is None:
            return None
        if action == "rewrite":
            self._put(name, self.rng.randbytes(self.rng.randrange(1, 4096)))
        elif action == "copy":
            src = self._pick()
            raw = self._get(src) if src else None
            if raw is None or src == name:
                return None
            self._put(name, raw)
        elif action == "truncate":
            raw = self._get(name)
            if raw is None:
                return None
            self._put(name, raw[: self.rng.randrange(0, len(raw))])
        elif action == "enlarge":
            raw = self._get(name) or b""
            self._put(name, raw + self.rng.randbytes(max(1, self.grow - len(raw))))
        elif action == "replay":
            if not self.saved:
                return None
            self._put(name, self.rng.choice(self.saved))
        elif action == "forge":
            if ids is None:
                return None
            key = bytes.fromhex(name.rsplit("/", 1)[1])
            raw = self._get(name)
            size = self.payload_bytes if raw is None else len(raw) - framed_size(key, ids[0], ids[1], 0)
            if size < 1:
                return None
            keys = self.rng.choice([None, self.own_key])
            self._put(name, frame(KIND_BLOCK, key, ids[0], ids[1], self.rng.randbytes(size), keys=keys))
        elif action == "delete":
            obstore.delete(self.store, name)
        else:
            raise ValueError(f"unknown adversary action {action!r}; known: {ACTIONS}")
        return f"{action} {name}"
