"""`python -m torch_pallas`: what this machine has, which backend each op
uses, and checked calls of every op.

Prints the versions and devices, then runs the example calls of every op
(torch_pallas.runtime.registry) on the default device (or on each backend given with
--backend) against their float64 references and prints a table: op,
backend, max |error|, status, the first round's time (compiling) and a later
one's. A backend that cannot run here, or an op without a kernel for it, gets
its row with the reason. Exits 1 if an op that should run failed or was
wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
import time

import torch

import torch_pallas
from torch_pallas.base import jax_env
from torch_pallas.base.errors import BackendError
from torch_pallas.runtime import backends, registry


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report_environment(device: torch.device) -> None:
    print(f"torch_pallas {torch_pallas.__version__} on Python {platform.python_version()}"
          f" ({platform.machine()})")
    for package in ("torch", "jax", "jaxlib", "triton", "numpy"):
        print(f"  {package:8s} {version(package)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"  cuda:{i}   {torch.cuda.get_device_name(i)} (sm{major}{minor})")
    else:
        print("  torch devices: cpu (no CUDA)")
    print(f"  jax devices: {', '.join(str(d) for d in jax_env.jax().devices())}")
    print(f"  {cpu_threads()}")
    print(f"backends here: {', '.join(b.name for b in backends.available(device.type))}")
    requested = backends.requested()
    print(f"default device: {device}; backend: "
          f"{backends.default_for(device).name}"
          + (f" (requested: {requested})" if requested else ""))


def cpu_threads() -> str:
    """torch's CPU threads and how its OpenMP workers wait (docs/performance.md,
    "Mixing with torch's CPU ops")."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    line = f"cpu threads: torch {torch.get_num_threads()}, OMP_WAIT_POLICY={policy or 'unset'}"
    if policy is None and torch.get_num_threads() > 1:
        line += (" (PASSIVE speeds up large CPU kernels that follow parallel torch ops;"
                 " set it before Python starts)")
    return line


def check_op(info: registry.OpInfo, examples: list[registry.Example],
             float32_allowance: float = 1.0) -> tuple[float, bool]:
    """Runs the op's examples; returns (max |error|, all within bounds, a
    float32 output's widened by the backend's allowance)."""
    worst, ok = 0.0, True
    for example in examples:
        out = info.overload(*example.args, **example.kwargs)
        err, within = example.error(out, float32_allowance)
        worst, ok = max(worst, err), ok and within
    return worst, ok


def report_op(info: registry.OpInfo, device: torch.device) -> tuple[tuple, bool]:
    """(table row, whether it counts as a failure) for one op on the backend
    in effect."""
    try:
        backend = backends.select(device, info.qualified_name)
    except BackendError as e:  # this backend cannot run here: said, not failed
        requested = backends.requested() or backends.default_for(device).name
        reason = str(e).removeprefix(f"{info.qualified_name}: ")
        return (info.name, requested, "-", f"unavailable: {reason}", "-", "-"), False
    if not info.serves(backend):
        return (info.name, backend.name, "-",
                f"no {backend.family} kernel (implemented for {', '.join(info.families)})",
                "-", "-"), False
    times = []
    try:
        examples = info.examples(device, False)
        for _ in range(2):  # the first round compiles
            start = time.perf_counter()
            err, within = check_op(info, examples, backend.float32_allowance)
            times.append(f"{(time.perf_counter() - start) * 1e3:.1f} ms")
        status = "ok" if within else "WRONG"
    except Exception as e:  # report every op, then fail
        err, within, status = float("nan"), False, f"error: {type(e).__name__}: {e}"
        times += ["-"] * (2 - len(times))
    return (info.name, backend.name, f"{err:.3g}", status.splitlines()[0], *times), not within


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_pallas", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", action="append", choices=list(backends.BACKENDS),
                        help="run the ops on this backend (repeatable); default: "
                             "the device's backend")
    args = parser.parse_args(argv)
    device = backends.default_device()
    report_environment(device)

    rows, failed = [], False
    for name in args.backend or [None]:
        with torch_pallas.backend(name):
            for info in registry.ops():
                row, failure = report_op(info, device)
                rows.append(row)
                failed |= failure

    header = ("op", "backend", "max |error|", "status", "first call", "time")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
