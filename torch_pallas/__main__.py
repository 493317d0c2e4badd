"""`python -m torch_pallas`: what this machine has, which backend each op
uses, and one checked call of every op.

Prints the versions and devices, then runs every op once on the default
device (or on each backend given with --backend) against its float64
reference and prints a table: op, backend, max |error|, whether it is
within the error bound, the first call's time (compiling) and a later one's.
Exits 1 if any op is wrong.
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
from torch_pallas import backends, jax_env, references

OPS = ("fill", "iota", "add", "matmul")


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
    requested = backends.requested()
    print(f"default device: {device}; backend: "
          f"{backends.default_for(device).name}"
          + (f" (requested: {requested})" if requested else ""))


def cpu_threads() -> str:
    """torch's CPU threads and how its OpenMP workers wait (README,
    "Mixing with torch's CPU ops")."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    line = f"cpu threads: torch {torch.get_num_threads()}, OMP_WAIT_POLICY={policy or 'unset'}"
    if policy is None and torch.get_num_threads() > 1:
        line += (" (PASSIVE speeds up large CPU kernels that follow parallel torch ops;"
                 " set it before Python starts)")
    return line


def check_op(op: str, device: torch.device) -> tuple[float, bool]:
    """Runs `op` once on random inputs; returns (max |error|, within bound)."""
    if op == "fill":
        out = torch.ops.pallas.fill((257, 129), 3.25, dtype=torch.float32, device=device)
        ref = references.fill((257, 129), 3.25, torch.float32)
        bound = 0.0
    elif op == "iota":
        out = torch.ops.pallas.iota(5000, device=device)
        ref = references.iota(5000, torch.int64)
        bound = 0.0
    elif op == "add":
        x = torch.randn(257, 129, device=device)
        y = torch.randn(129, device=device)
        out, ref = torch.ops.pallas.add(x, y), references.add(x.cpu(), y.cpu())
        bound = references.ROUNDING[torch.float32] * ref.abs()
    else:
        a = torch.randn(257, 300, device=device)
        b = torch.randn(300, 65, device=device)
        out, ref = torch.ops.pallas.matmul(a, b), references.matmul(a.cpu(), b.cpu())
        bound = references.matmul_error_bound(a.cpu(), b.cpu(), ref)
    err = (out.cpu().double() - ref.double()).abs()
    return err.max().item(), bool((err <= bound).all())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_pallas", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", action="append", choices=list(backends.BACKENDS),
                        help="run the ops on this backend (repeatable); default: "
                             "the device's backend")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report_environment(device)
    names = args.backend or [None]

    rows, ok = [], True
    for name in names:
        with torch_pallas.backend(name):
            for op in OPS:
                backend = backends.select(device, f"pallas::{op}").name
                times = []
                try:
                    for _ in range(2):  # the first call compiles
                        start = time.perf_counter()
                        err, within = check_op(op, device)
                        times.append(f"{(time.perf_counter() - start) * 1e3:.1f} ms")
                    status = "ok" if within else "WRONG"
                except Exception as e:  # report every op, then fail
                    err, within, status = float("nan"), False, f"error: {e}"
                    times += ["-"] * (2 - len(times))
                ok &= within
                rows.append((op, backend, f"{err:.3g}", status, *times))

    header = ("op", "backend", "max |error|", "status", "first call", "time")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
