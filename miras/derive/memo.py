"""Every derivation once: what the compiler derives from a component is cached by the
component's canonical form, and validation, the passes and the checks all ask the cache.

    rule = RETENTIONS.get(component_key(retention), lambda: _derive(retention))

`component_key` is the component's class and the JSON of its fields (every parameter,
defaults filled, in field order): two components with equal fields share a derivation, and
anything that changes the derivation changes the key (a fixed value, a potential, a solver;
a class registered under a kind that another class had). A refusal (`DerivationError`) is
cached too and raised again as a fresh error with the same message; any other exception is
not cached.

Safe for threads: a key is derived by one thread while the others asking for it wait for
its result; different keys are derived side by side. Search workers are processes: each has
its own cache (a forked child keeps its parent's results and gets fresh locks). The caches
hold at most `Memo.size` results each, dropping the least recently used.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from miras.errors import DerivationError

T = TypeVar("T")

_MEMOS: weakref.WeakSet[Memo] = weakref.WeakSet()


def component_key(component: Any) -> tuple[type, str]:
    """(class, JSON of the fields): the canonical form a derivation is cached by."""
    return type(component), component.model_dump_json()


class Memo(Generic[T]):
    """A thread-safe cache of derivations by key, refusals included. `computed` counts the
    derivations run, `asked` the lookups (tests hold passes to one lookup each)."""

    def __init__(self, name: str, size: int = 1024):
        self.name = name
        self.size = size
        self.computed = 0
        self.asked = 0
        self._results: OrderedDict[Hashable, tuple[bool, Any]] = OrderedDict()
        self._reset_locks()
        _MEMOS.add(self)

    def _reset_locks(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, derive: Callable[[], T]) -> T:
        """The result of `derive()` for `key`, derived on the first ask only."""
        with self._lock:
            self.asked += 1
            found = self._lookup(key)
            if found is None:
                pending = self._pending.setdefault(key, threading.Lock())
        if found is not None:
            return _unpack(found)
        with pending:  # one thread derives; the others wait here, then read its result
            with self._lock:
                found = self._lookup(key)
            if found is None:
                try:
                    found = (True, derive())
                except DerivationError as err:
                    found = (False, err)
                with self._lock:
                    self.computed += 1
                    self._results[key] = found
                    while len(self._results) > self.size:
                        self._results.popitem(last=False)
                    self._pending.pop(key, None)
        return _unpack(found)

    def peek(self, key: Hashable) -> T | None:
        """The cached result for `key` (not counted as asked), or None; a refusal is None."""
        with self._lock:
            found = self._results.get(key)
        return found[1] if found is not None and found[0] else None

    def _lookup(self, key: Hashable) -> tuple[bool, Any] | None:
        found = self._results.get(key)
        if found is not None:
            self._results.move_to_end(key)
        return found

    def clear(self) -> None:
        with self._lock:
            self._results.clear()

    def __len__(self) -> int:
        return len(self._results)


def _unpack(found: tuple[bool, Any]) -> Any:
    ok, value = found
    if ok:
        return value
    raise type(value)(*value.args) from None  # a fresh error: tracebacks do not pile up


def _after_fork() -> None:
    for memo in list(_MEMOS):
        memo._reset_locks()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


__all__ = ["Memo", "component_key"]
