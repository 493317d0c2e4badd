"""Peak memory of a workload, for the benchmarks' JSON (`peak_bytes`) and
the memory tests: the most it held at once above what its inputs hold.

On a CUDA device, torch's allocator's own peak (`max_memory_allocated`,
reset before the call). On the CPU torch's and JAX's buffers come from
allocators that Python's `tracemalloc` does not see, so the figure comes
from the kernel: a fresh process builds the inputs, runs the workload once
(it compiles), resets its high-water mark (/proc/self/clear_refs) and runs
it again: the peak resident size (VmHWM) less the resident size before
that second call. Both torch and XLA allocate through glibc's malloc,
told to map every buffer from 128 KiB and unmap it when freed, so that no
buffer of the first call is reused by the second out of sight.

A workload is named as "module:function" (a module the child process can
import, with bench/ on its path) and called with `args` (plain values):
it returns the callable to measure; it builds its inputs itself.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes(workload: str, *args, device: torch.device | None = None) -> int:
    """The peak memory of `workload(*args)()` above its inputs, in bytes."""
    (found,) = peaks(workload, [args], device=device)
    return found


def peaks(workload: str, calls: list, device: torch.device | None = None) -> list[int]:
    """`peak_bytes` of `workload(*args)` for each `args` in `calls`, in one
    fresh process (one start-up for all)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        found = []
        for args in calls:
            run = _load(workload)(*args)
            run()  # compiled
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            found.append(torch.cuda.max_memory_allocated() - before)
            del run
        return found
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        # a fixed threshold: every buffer from 128 KiB is mapped and unmapped
        # per call (glibc otherwise pools those up to 32 MiB after a first free)
        MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, __file__, workload, json.dumps([list(a) for a in calls])], env=env,
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _load(workload: str) -> Callable:
    import importlib

    module, function = workload.split(":")
    return getattr(importlib.import_module(module), function)


def _high_water_mark() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _peak(run: Callable) -> int:
    run()  # compiles; what it leaves cached stays in the baseline
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the resident size (Linux >= 4.0)
    before = resident_bytes()
    run()
    return _high_water_mark() - before


def _child(workload: str, calls: list) -> None:
    found = []
    for args in calls:
        run = _load(workload)(*args)
        found.append(_peak(run))
        del run
        gc.collect()
    print(json.dumps(found))


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
