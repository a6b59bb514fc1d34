"""Naming the policy a replay runs: a registry name or a ``module:Class`` path, with options.

``PolicySpec(name, options)`` is what a run is configured with; ``build``
turns it into a ``tiering.policies.Policy`` through a registry (the built-ins unless
one is given). A name holding a ``:`` is an import path: ``module:Attr``
names a ``Policy`` subclass, or any callable returning a ``Policy``, that is
importable from the current working directory or ``sys.path``. Options are
passed to the factory as keyword arguments; ``parse_option("k=v")`` reads
one from the command line (ints, floats, ``true``/``false``/``none``, else
the text itself).

The built-in ``priority`` policy needs the name of the resource whose
retention priorities it reads; the replay's only resource is ``kv``, so
``resource="kv"`` is supplied unless the options say otherwise.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.policies import Policy, PolicyRegistry, default_registry

REPLAY_RESOURCE = "kv"  # the one resource of a replay (its KV cache)


def parse_option(text: str) -> tuple[str, object]:
    """``"key=value"`` -> ``(key, value)``; ValueError naming the text if malformed."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"--policy-option: {text!r} is not KEY=VALUE with KEY an identifier")
    return key, _value(raw.strip())


def _value(raw: str) -> object:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        v = float(raw)
    except ValueError:
        return raw
    return v if math.isfinite(v) else raw


@dataclass(frozen=True)
class PolicySpec:
    """A policy by ``name`` (registry name or ``module:Attr``) and its keyword ``options``.

    ``options`` is stored as a sorted tuple of (key, value) pairs so that a spec
    is hashable and compares by value.
    """

    name: str = "lru"
    options: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"PolicySpec.name must name a policy, got {self.name!r}")
        opts = self.options
        if isinstance(opts, Mapping):
            opts = tuple(opts.items())
        try:
            pairs = tuple(sorted(((str(k), v) for k, v in opts), key=lambda kv: kv[0]))
        except (TypeError, ValueError):
            raise ValueError(
                f"PolicySpec.options must be a mapping or (key, value) pairs, got {opts!r}"
            ) from None
        for i, (k, _) in enumerate(pairs):
            if not k.isidentifier():
                raise ValueError(f"PolicySpec.options: {k!r} is not a keyword name")
            if i and pairs[i - 1][0] == k:
                raise ValueError(f"--policy-option: {k!r} is given twice "
                                 f"({pairs[i - 1][1]!r} and {pairs[i][1]!r})")
        object.__setattr__(self, "options", pairs)

    @property
    def is_path(self) -> bool:
        return ":" in self.name

    @property
    def label(self) -> str:
        """The name, with options appended (``cost[aging_s=5]``)."""
        if not self.options:
            return self.name
        return f"{self.name}[{','.join(f'{k}={v}' for k, v in self.options)}]"

    def build(self, registry: PolicyRegistry | None = None) -> Policy:
        """The policy this spec names, from ``registry`` (default: the built-ins).

        ValueError or TypeError naming the policy when it cannot be built (whatever the
        factory raised), or when it reads priorities of a resource other than ``kv``."""
        if registry is not None and not isinstance(registry, PolicyRegistry):
            raise TypeError(f"registry must be a PolicyRegistry or None, got {registry!r}")
        reg = registry if registry is not None else default_registry()
        kwargs = dict(self.options)
        name = self.name
        if self.is_path:
            factory = load_factory(name)
            if name not in reg:
                reg = reg.with_policy(name, factory)
        elif name not in reg:
            raise ValueError(f"--policy: unknown policy {name!r}; known: {', '.join(reg.names)}"
                             " (or give a module:Class path)")
        if name == "priority" and "resource" not in kwargs:
            kwargs["resource"] = REPLAY_RESOURCE
        try:
            policy = reg.make(name, **kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"--policy {self.label}: {err}") from None
        except Exception as err:  # user code: whatever it raises names the policy
            raise ValueError(f"--policy {self.label}: building it raised "
                             f"{type(err).__name__}: {err}") from err
        wants = policy.needs_priority_from
        if wants is not None and wants != REPLAY_RESOURCE:
            raise ValueError(f"--policy {self.label}: it reads retention priorities of resource "
                             f"{wants!r}; the replay's only resource is {REPLAY_RESOURCE!r}")
        return policy


def load_factory(path: str, base: type = Policy, option: str = "--policy",
                 what: str = "tiering.policies.Policy") -> Any:
    """Import ``module:Attr`` and return the attribute: a ``base`` subclass (default
    ``tiering.policies.Policy``, ``what`` in errors) or a factory. ``option`` names the
    argument in errors."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{option}: {path!r} is not module:Class")
    cwd = str(Path.cwd())
    added = cwd not in sys.path  # a user's own module next to where they run the command
    if added:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"{option}: cannot import module {module_name!r} "
                         f"({type(err).__name__}: {err})") from None
    finally:
        if added:
            sys.path.remove(cwd)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{option}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type) and not issubclass(obj, base):
        raise ValueError(f"{option}: {path!r} is a class but not a {what} subclass")
    if not callable(obj):
        raise ValueError(f"{option}: {path!r} is not a {base.__name__} class or factory")
    return obj
