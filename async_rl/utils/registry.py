"""Name -> class registries filled by decorators (agent loops, tools, interactions)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T", bound=type)


def add_to_registry(table: dict[str, T], what: str, name: str, cls: T) -> T:
    """Register `cls` as `name`; registering another class under a taken name is an error naming both."""
    if name in table and table[name] is not cls:
        raise ValueError(f"{what} {name!r} is already registered by {table[name].__name__}")
    table[name] = cls
    return cls


def registrar(table: dict[str, T], what: str) -> Callable[[str], Callable[[T], T]]:
    """`register = registrar(TABLE, "tool")`, then `@register("name")` on a class."""
    return lambda name: lambda cls: add_to_registry(table, what, name, cls)
