"""The cost of one small call: each op on a few elements (the core ops), or
on one token of a decode step (the training ops), against the bare JAX
call of its own compiled kernel and against torch's counterpart, with
where the time goes.

For each op the test times, round by round in one process (interleaved, so
that every figure shares the machine's load):
- `torch`: torch's counterpart (torch.add, torch.full, torch.arange,
  torch.mm, F.rms_norm, silu(gate) * up, transformers' rotary, SDPA);
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
import torch.nn.functional as F

import torch_pallas
from conftest import record
from providers import SMOKE, Provider
from torch_pallas.runtime import bridge, launch

N = 64
x, y = torch.randn(N), torch.randn(N)
a, b = torch.randn(8, 8), torch.randn(8, 8)
# A decode step's calls (one token, hidden 512, 8 query heads and 4
# key/value heads of 64, 40 cached keys; gate/up 1376): what a generating
# model patched by torch_pallas.transformers.apply calls per layer.
hidden, norm_weight = torch.randn(1, 1, 512), torch.rand(512) + 0.5
gate, up = torch.randn(1, 1, 1376), torch.randn(1, 1, 1376)
q, k_new = torch.randn(1, 8, 1, 64), torch.randn(1, 4, 1, 64)
keys, values = torch.randn(1, 4, 40, 64), torch.randn(1, 4, 40, 64)
cos, sin = torch.randn(1, 1, 64), torch.randn(1, 1, 64)


def torch_rotary():
    """transformers' apply_rotary_pos_emb."""
    def rotated(t):
        return torch.cat((-t[..., 32:], t[..., :32]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotated(q) * s, k_new * c + rotated(k_new) * s

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
    "rms_norm": (lambda: F.rms_norm(hidden, (512,), norm_weight, 1e-6),
                 lambda: torch.ops.pallas.rms_norm(hidden, [512], norm_weight, 1e-6),
                 lambda: torch_pallas.rms_norm(hidden, (512,), norm_weight, 1e-6)),
    "swiglu": (lambda: F.silu(gate) * up, lambda: torch.ops.pallas.swiglu(gate, up),
               lambda: torch_pallas.swiglu(gate, up)),
    "rotary_embedding": (torch_rotary,
                         lambda: torch.ops.pallas.rotary_embedding(q, k_new, cos, sin),
                         lambda: torch_pallas.rotary_embedding(q, k_new, cos, sin)),
    "attention": (lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
                  lambda: torch.ops.pallas.attention(q, keys, values, enable_gqa=True),
                  lambda: torch_pallas.attention(q, keys, values, enable_gqa=True)),
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


def bare_call(kernel, views):
    """The kernel's call on `views`, waited for (each of its results)."""
    if isinstance(kernel(*views), (tuple, list)):
        return lambda: [out.block_until_ready() for out in kernel(*views)]
    return lambda: kernel(*views).block_until_ready()


@pytest.mark.parametrize("name", CALLS)
def test_small_call(benchmark, name):
    torch_call, op_call, public = CALLS[name]
    op, device, inputs, params = launched(public)
    _, kernel, _ = launch.compiled_kernel(op, device, inputs, params)
    views = [bridge.to_kernel_argument(t) for t in inputs]
    timed = {
        "torch": torch_call,
        "bare": bare_call(kernel, views),
        "launch": lambda: launch.run(op, device, inputs, params),
        "op": op_call,
        "public": public,
    }
    torch.testing.assert_close(public(), torch_call(), check_dtype=True, rtol=1e-5, atol=1e-5)
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
