"""Named implementations the spec chooses between: one registry per extension point.

The API names the choices (`algorithm.name`, `reward.type`); the trainer registers one
implementation per name with a decorator, next to the implementation. A name the API allows
but no implementation registered is found by a unit test (the registry against the API's
choices) and, failing that, at start-up with the field named, never by a default branch that
quietly does something else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """The spec names a choice this trainer has no implementation of."""


class Registry(Generic[T]):
    """Implementations by name, for the spec field `field` (e.g. ``spec.algorithm.name``)."""

    def __init__(self, field: str) -> None:
        self.field = field
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `name`'s implementation (registering a name twice is a bug)."""

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.field}: {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def __getitem__(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries))
            raise UnknownNameError(
                f"{self.field}: {name!r} is not known to this trainer (it knows {known})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
