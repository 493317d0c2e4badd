"""The cache of compiled kernels, one entry per (op, backend, device, input
shapes and dtypes, op parameters, config): a repeated call never re-traces.

Entries are ahead-of-time compiled JAX executables (or Triton launchers).
The cache is bounded (past `MAX_ENTRIES` the least recently used entries are
dropped) and thread-safe: when several threads ask for a key at once, one
builds it and the others wait for that build.

A call first looks for its kernel under a cheaper key, the call's signature
as torch sees it (`remember_signature`/`lookup_signature`): what the full key
is computed from (backend selection, JAX dtype names) then costs nothing on
repeated calls. An entry may also hold a call ready to run (`set_ready`,
`ready`: a CPU kernel with its conversions chosen), which leaves the cache
with its entry.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Hashable
from typing import Any

MAX_ENTRIES = 512


class _Slot:
    """A cached entry, the call made ready to run from it (or None), and
    when it was last used (the cache's clock)."""

    __slots__ = ("entry", "ready", "used")

    def __init__(self, entry, used: int):
        self.entry, self.ready, self.used = entry, None, used


class CompileCache:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: dict[Hashable, _Slot] = {}
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}
        self.builds = 0
        # call signature -> (the entry's key, what the call resolved to, its slot)
        self._resolved: dict[Hashable, tuple[Hashable, Any, _Slot]] = {}
        # Advances on clear(): what holders of an entry key it by.
        self.generation = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        slot = self._entries.get(key)
        entry = None if slot is None else slot.entry
        if entry is not None:
            slot.used = next(self._clock)
            return entry
        with self._lock:
            key_lock = self._building.setdefault(key, threading.Lock())
        with key_lock:
            slot = self._entries.get(key)
            entry = None if slot is None else slot.entry
            if entry is None:
                entry = build()
                with self._lock:
                    self.builds += 1
                    self._entries[key] = _Slot(entry, next(self._clock))
                    while len(self._entries) > self.max_entries:
                        self._evict()
                    self._building.pop(key, None)
        return entry

    def _evict(self) -> None:
        """Drops the least recently used entry (a scan: evictions come with
        builds, which cost milliseconds), and the call made ready from it."""
        oldest = min(self._entries, key=lambda key: self._entries[key].used)
        slot = self._entries.pop(oldest)
        slot.entry = slot.ready = None  # what signatures still hold: gone

    def remember_signature(self, signature: Hashable, key: Hashable, resolved: Any = None) -> None:
        """Files the entry under `key` also under a call `signature` that
        always resolves to it (with `resolved`, e.g. the backend chosen)."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is None:
                return
            if len(self._resolved) >= self.max_entries:
                self._resolved.clear()
            self._resolved[signature] = (key, resolved, slot)

    def lookup_signature(self, signature: Hashable) -> tuple[Hashable, Any, Any] | None:
        """(key, resolved, entry) filed under `signature`, if the entry is
        still cached."""
        found = self._resolved.get(signature)
        if found is None:
            return None
        key, resolved, slot = found
        entry = slot.entry
        if entry is None:  # evicted
            return None
        slot.used = next(self._clock)
        return key, resolved, entry

    def set_ready(self, key: Hashable, call: Callable) -> None:
        """Keeps `call`, the entry under `key` made ready to run, beside the
        entry while it is cached."""
        with self._lock:
            slot = self._entries.get(key)
            if slot is not None:
                slot.ready = call

    def ready(self, signature: Hashable) -> Callable | None:
        """The ready call of the entry filed under `signature`, if both
        are still cached: one lookup, by the call's signature."""
        found = self._resolved.get(signature)
        if found is None:
            return None
        slot = found[2]
        call = slot.ready
        if call is not None:
            slot.used = next(self._clock)
        return call

    def clear(self) -> None:
        with self._lock:
            for slot in self._entries.values():
                slot.entry = slot.ready = None
            self._entries.clear()
            self._resolved.clear()
            self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


compiled = CompileCache()  # the process's compiled kernels


def clear() -> None:
    """Drops every compiled kernel (they are rebuilt on their next call)."""
    compiled.clear()
