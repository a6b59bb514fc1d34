"""An immutable map from names to factories, for any kind of policy.

``PolicyRegistry`` (request policies) is one; a registry of another kind of
policy subclasses ``Registry`` and sets ``kind`` (the word its messages use)
and ``product`` (the class every factory must return an instance of).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar


class Registry:
    """Name -> factory; never changes once made (``with_policy`` returns a new one).

    ``make(name, **kwargs)`` calls the factory with ``kwargs`` and checks that it
    returned a ``product``. Bad names and factories are refused at the door,
    with a message naming them.
    """

    kind: ClassVar[str] = "policy"
    product: ClassVar[type] = object

    __slots__ = ("_factories",)

    def __init__(self, factories: Mapping[str, Callable[..., Any]] | None = None) -> None:
        if factories is not None and not isinstance(factories, Mapping):
            raise TypeError(
                f"{type(self).__name__}: factories must be a mapping of name to factory, got "
                f"{type(factories).__name__}"
            )
        checked: dict[str, Callable[..., Any]] = {}
        for name, factory in (factories or {}).items():
            self._check_entry(name, factory)
            checked[name] = factory
        object.__setattr__(self, "_factories", MappingProxyType(checked))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a {type(self).__name__} never changes; use with_policy")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a {type(self).__name__} never changes")

    def __reduce__(self) -> tuple[type, tuple[dict[str, Callable[..., Any]]]]:
        # pickled (to a worker process) and copied as its entries; a factory pickles by name
        return type(self), (dict(self._factories),)

    @property
    def names(self) -> tuple[str, ...]:
        """The registered names, sorted."""
        return tuple(sorted(self._factories))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._factories

    def with_policy(self, name: str, factory: Callable[..., Any]) -> Registry:
        """A new registry (of this one's class) holding this one's entries plus ``name``;
        ``name`` must be new."""
        self._check_entry(name, factory)
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        return type(self)({**self._factories, name: factory})

    def make(self, name: str, **kwargs: object) -> Any:
        """Build the ``kind`` registered as ``name`` with ``kwargs``."""
        factory = self._factories.get(name) if isinstance(name, str) else None
        if factory is None:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known {self.kind.replace('policy', 'policies')}: "
                f"{', '.join(self.names)}"
            )
        try:
            made = factory(**kwargs)
        except TypeError as err:
            raise TypeError(f"{self.kind} {name!r}: {err}") from err
        if not isinstance(made, self.product):
            raise TypeError(
                f"{self.kind} {name!r}: factory returned {type(made).__name__}, not a "
                f"{self.product.__name__}"
            )
        return made

    def required_options(self, name: str) -> tuple[str, ...]:
        """The keyword options ``make(name)`` cannot do without: the factory's parameters
        that have no default, in order (``("resource",)`` for "priority"). () for an
        unknown name or a factory whose signature cannot be read."""
        factory = self._factories.get(name) if isinstance(name, str) else None
        if factory is None:
            return ()
        try:
            params = inspect.signature(factory).parameters.values()
        except (TypeError, ValueError):
            return ()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(p.name for p in params
                     if p.kind in kinds and p.default is inspect.Parameter.empty)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self.names)})"

    def _check_entry(self, name: object, factory: object) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty str, got {name!r}")
        if not callable(factory):
            raise TypeError(f"{self.kind} {name!r}: factory {factory!r} is not callable")


R = TypeVar("R", bound=Registry)


def registry_or_default(
    registry: object, kind: type[R], default: Callable[[], R], caller: str, made_by: str
) -> R:
    """``registry``, or ``default()`` when it is None; anything but a ``kind`` is refused
    (TypeError naming ``caller``), so one kind's registry never builds another kind."""
    if registry is None:
        return default()
    if not isinstance(registry, kind):
        raise TypeError(
            f"{caller}: registry must be a {kind.__name__} (from {made_by}), got "
            f"{type(registry).__name__}"
        )
    return registry
