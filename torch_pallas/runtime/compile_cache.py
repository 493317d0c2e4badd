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

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

MAX_ENTRIES = 512


class CompileCache:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}
        self.builds = 0
        # call signature -> (the entry's key, what the call resolved to)
        self._resolved: dict[Hashable, tuple[Any, Hashable]] = {}
        # an entry's key -> its call ready to run, where one was set
        self._ready: dict[Hashable, Callable] = {}
        # Advances on clear(): what holders of an entry key it by.
        self.generation = 0

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self._used(key)
            return entry
        with self._lock:
            key_lock = self._building.setdefault(key, threading.Lock())
        with key_lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = build()
                with self._lock:
                    self.builds += 1
                    self._entries[key] = entry
                    while len(self._entries) > self.max_entries:
                        evicted, _ = self._entries.popitem(last=False)
                        self._ready.pop(evicted, None)
                    self._building.pop(key, None)
        return entry

    def remember_signature(self, signature: Hashable, key: Hashable, resolved: Any = None) -> None:
        """Files the entry under `key` also under a call `signature` that
        always resolves to it (with `resolved`, e.g. the backend chosen)."""
        with self._lock:
            if len(self._resolved) >= self.max_entries:
                self._resolved.clear()
            self._resolved[signature] = (key, resolved)

    def lookup_signature(self, signature: Hashable) -> tuple[Hashable, Any, Any] | None:
        """(key, resolved, entry) filed under `signature`, if the entry is
        still cached."""
        found = self._resolved.get(signature)
        if found is None:
            return None
        entry = self._entries.get(found[0])
        if entry is None:
            return None
        self._used(found[0])
        return (*found, entry)

    def set_ready(self, key: Hashable, call: Callable) -> None:
        """Keeps `call`, the entry under `key` made ready to run, beside the
        entry while it is cached."""
        with self._lock:
            if key in self._entries:
                self._ready[key] = call

    def ready(self, signature: Hashable) -> Callable | None:
        """The ready call of the entry filed under `signature`, if both
        are still cached."""
        found = self._resolved.get(signature)
        if found is None:
            return None
        call = self._ready.get(found[0])
        if call is not None:
            self._used(found[0])
        return call

    def _used(self, key: Hashable) -> None:
        """Marks `key` as the most recently used: eviction takes the least
        recently used entries."""
        try:
            self._entries.move_to_end(key)
        except KeyError:  # evicted meanwhile by another thread
            pass

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._resolved.clear()
            self._ready.clear()
            self.generation += 1

    def __len__(self) -> int:
        return len(self._entries)


compiled = CompileCache()  # the process's compiled kernels


def clear() -> None:
    """Drops every compiled kernel (they are rebuilt on their next call)."""
    compiled.clear()
