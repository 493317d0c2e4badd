"""The cost of one small call: each op on a few elements against the bare
JAX call of its own compiled kernel and against torch's counterpart, with
where the time goes.

For each op the test times, round by round in one process (interleaved, so
that every figure shares the machine's load):
- `torch`: torch's counterpart (torch.add, torch.full, torch.arange, torch.mm);
- `bare`: the compiled kernel the op runs, called on NumPy views of the same
  tensors prepared once (what a JAX program pays, minus its own dispatch);
- `launch`: torch_pallas.runtime.launch.run with the op's kernel parameters:
  the kernel's search, the tensors' crossing to JAX and back;
- `op`: `torch.ops.pallas.<op>` through torch's dispatcher;
- `public`: `torch_pallas.<op>`, the function users call (its direct path
  skips the dispatcher on plain eager calls).
pytest-benchmark times `public`; the others go into its extra_info with the
ratio `public / bare` (the issue's goal: at most 2x) and the breakdown:
checks and dispatch (`public - launch`), search and crossing (`launch -
bare`). `pytest bench/bench_call.py -s` prints them. The tensors are CPU
tensors on every machine: this is the CPU path (the `interpret` backend).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import torch_pallas
from conftest import record
from providers import SMOKE, Provider
from torch_pallas.runtime import bridge, launch

N = 64
x, y = torch.randn(N), torch.randn(N)
a, b = torch.randn(8, 8), torch.randn(8, 8)

# op: (torch's call, torch.ops.pallas's call, torch_pallas's call)
CALLS = {
    "add": (lambda: torch.add(x, y), lambda: torch.ops.pallas.add(x, y),
            lambda: torch_pallas.add(x, y)),
    "fill": (lambda: torch.full((N,), 1.5), lambda: torch.ops.pallas.fill((N,), 1.5),
             lambda: torch_pallas.fill((N,), 1.5)),
    "iota": (lambda: torch.arange(N, dtype=torch.int32),
             lambda: torch.ops.pallas.iota(N, dtype=torch.int32),
             lambda: torch_pallas.iota(N, dtype=torch.int32)),
    "matmul": (lambda: torch.mm(a, b), lambda: torch.ops.pallas.matmul(a, b),
               lambda: torch_pallas.matmul(a, b)),
}
ROUNDS, CALLS_PER_ROUND = (3, 20) if SMOKE else (15, 400)


def launched(public) -> tuple:
    """(op, device, inputs, params) of the kernel launch `public()` makes."""
    seen = []
    original = launch.run

    def spy(op, device, inputs=(), params=None, *args, **kwargs):
        seen.append((op, device, tuple(inputs), dict(params or {})))
        return original(op, device, inputs, params, *args, **kwargs)

    launch.run = spy
    try:
        public()
    finally:
        launch.run = original
    assert len(seen) == 1, seen
    return seen[0]


def per_call(fn) -> float:
    """Seconds per call of one round."""
    start = time.perf_counter()
    for _ in range(CALLS_PER_ROUND):
        fn()
    return (time.perf_counter() - start) / CALLS_PER_ROUND


@pytest.mark.parametrize("name", CALLS)
def test_small_call(benchmark, name):
    torch_call, op_call, public = CALLS[name]
    op, device, inputs, params = launched(public)
    _, kernel, _ = launch.compiled_kernel(op, device, inputs, params)
    views = [bridge.to_kernel_argument(t) for t in inputs]
    timed = {
        "torch": torch_call,
        "bare": lambda: kernel(*views).block_until_ready(),
        "launch": lambda: launch.run(op, device, inputs, params),
        "op": op_call,
        "public": public,
    }
    torch.testing.assert_close(public(), torch_call(), check_dtype=True)
    for fn in timed.values():  # warm: first calls build and cache
        fn()
    rounds = {what: [] for what in timed}
    for _ in range(ROUNDS):
        for what, fn in timed.items():
            rounds[what].append(per_call(fn))
    medians = {what: statistics.median(times) * 1e6 for what, times in rounds.items()}
    benchmark.group = f"call {name}"
    benchmark.pedantic(public, rounds=ROUNDS * 10, iterations=CALLS_PER_ROUND // 10 or 1)
    record(benchmark, Provider("pallas[interpret]", "interpret", "pallas"), op=f"call_{name}",
           dtype=inputs[0].dtype if inputs else torch.float32, shape=tuple(inputs[0].shape) if inputs else (N,), work=1.0,
           unit="calls/s")
    benchmark.extra_info.update(
        torch_median_interleaved=medians["torch"] * 1e-6,  # ratio_to_torch: these rounds'
        **{f"{what}_us": us for what, us in medians.items()},
        public_vs_bare=medians["public"] / medians["bare"],
        public_vs_torch=medians["public"] / medians["torch"],
        checks_and_dispatch_us=medians["public"] - medians["launch"],
        search_and_crossing_us=medians["launch"] - medians["bare"])
    print(f"\n{name}: " + ", ".join(f"{what} {us:.1f} us" for what, us in medians.items())
          + f"; public/bare {medians['public'] / medians['bare']:.2f}x"
          + f", checks+dispatch {medians['public'] - medians['launch']:.1f} us"
          + f", search+crossing {medians['launch'] - medians['bare']:.1f} us")
