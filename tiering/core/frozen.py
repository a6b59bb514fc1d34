"""``FrozenMap``: the read-only copy of a mapping that a checked config keeps.

A config copies a dict its caller may change later and keeps it read-only, so what was
checked is what is used. ``types.MappingProxyType`` does that but cannot be pickled or
deep-copied, so a config holding one could not be sent to a worker process or copied;
``FrozenMap`` can.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class FrozenMap(Mapping):
    """A read-only mapping over a private copy of ``data``; equal to any mapping with the
    same items, pickled and copied as one."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[Any, Any] | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a {type(self).__name__} never changes")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a {type(self).__name__} never changes")

    def __reduce__(self) -> tuple[type, tuple[dict[Any, Any]]]:
        return type(self), (self._data,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._data!r})"


def frozen_nested(data: Mapping[Any, Any] | None) -> FrozenMap:
    """``data`` as a ``FrozenMap`` whose mapping values are ``FrozenMap`` too, all the way
    down (a store's options nest one: ``client_kwargs``)."""
    return FrozenMap({k: frozen_nested(v) if isinstance(v, Mapping) else v
                      for k, v in (data or {}).items()})
