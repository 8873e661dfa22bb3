"""One registry mechanism for every method: adapter heads (``ADAPTERS``) and pre-training objectives
(``PRETRAIN``).

A method is one file that registers itself: adapter heads live in ``adapters/heads/``, pre-training
objectives in ``adapters/objectives/``; both folders are imported on first lookup, so adding a method is that
file plus its test, with no list to edit. ``train/`` only ever asks the registry (``ADAPTERS.get(name)``)
and never branches on a method's name.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> registered object (a class), with the folder whose modules register into it."""

    def __init__(self, kind: str, package: str):
        self.kind, self.package = kind, package
        self._entries: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: ``@ADAPTERS.register("comalign")``. The name is stored as ``obj.name``."""

        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice "
                                 f"({self._entries[name].__module__} and {obj.__module__})")
            self._entries[name] = obj
            try:
                obj.name = name  # type: ignore[attr-defined]
            except (AttributeError, TypeError):
                pass
            return obj

        return deco

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")

    def names(self) -> list[str]:
        self._discover()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        self._discover()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; choose from: {', '.join(self.names())}") from None

    def __contains__(self, name: str) -> bool:
        self._discover()
        return name in self._entries


ADAPTERS: Registry = Registry("adapter method", "adapters.heads")
PRETRAIN: Registry = Registry("pre-training method", "adapters.objectives")
