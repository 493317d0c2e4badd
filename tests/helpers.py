"""Helpers the tests share: the CPU backends, random inputs, and a verbose
bounded comparison that prints the first mismatches."""

from __future__ import annotations

import torch

from torch_pallas.runtime import backends

# Every backend that runs on this machine's CPU (Triton's under its
# interpreter, which conftest.py turns on where there is no GPU); not the
# chip's (`tpu`: tests/test_tpu_backend.py, one process).
CPU_BACKENDS = tuple(b.name for b in backends.available("cpu", chips=False))


def simulators_exhaustive(names=CPU_BACKENDS, also=()) -> list:
    """The CPU backends as pytest params, the simulators' (and those named
    in `also`) marked `exhaustive`: for the long sweeps (torch's sample
    inputs, large ragged shapes) that the default run makes on the other
    backends and `pytest -m exhaustive` on the simulators too."""
    import pytest

    return [pytest.param(name, marks=[pytest.mark.exhaustive]
                         if backends.get(name).simulated or name in also else [], id=name)
            for name in names]
# Ops whose simulated calls take seconds each: on the simulators, the sweeps
# over every registered op (examples, opcheck, every layout, inputs left as
# found, determinism) run them with -m exhaustive; each one's own test file
# runs it on every simulator in the default run (past its blocks, with its
# gradients).
SLOW_ON_SIMULATORS = ("attention", "attention_backward", "linear_cross_entropy",
                      "linear_cross_entropy_backward", "rotary_embedding",
                      "rotary_embedding_backward", "rms_norm", "rms_norm_backward",
                      "layer_norm", "layer_norm_backward", "swiglu", "swiglu_backward",
                      "grouped_mm", "grouped_mm_backward", "varlen_attention", "token_log_probs",
                      "token_log_probs_backward")


def backend_cases(subjects: dict) -> list:
    """(backend, subject) pytest params for every CPU backend and every
    `subjects` entry (name -> value), id "backend-name"; the slow ops on the
    simulators marked `exhaustive`."""
    import pytest

    return [pytest.param(backend, value, marks=[pytest.mark.exhaustive] if (
        backends.get(backend).simulated and name in SLOW_ON_SIMULATORS) else [],
        id=f"{backend}-{name}")
        for backend in CPU_BACKENDS for name, value in subjects.items()]


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound, what: str = "") -> None:
    """|out - ref| <= bound elementwise (bound: tensor or number); on failure
    the message lists the first mismatching positions."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = (out.double() - ref.double()).abs()
    bad = ~(err <= bound)  # NaN counts as a mismatch
    if bad.any():
        idx = bad.nonzero()[:5]
        bound_t = torch.as_tensor(bound, dtype=torch.float64).expand_as(err)
        rows = [
            f"  at {tuple(i.tolist())}: got {out[tuple(i)].item()!r}, "
            f"expected {ref[tuple(i)].item()!r} (|err| {err[tuple(i)].item():.3g} > "
            f"{bound_t[tuple(i)].item():.3g})"
            for i in idx
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements out of bounds, "
            f"max |err| {err.max().item():.3g}\n" + "\n".join(rows)
        )


def random_tensor(shape, dtype, scale: float = 1.0) -> torch.Tensor:
    """Random values of `dtype`: normal floats, or ints in [-1000, 1000)."""
    if dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.float32) * scale).to(dtype)
    return torch.randint(-1000, 1000, shape, dtype=dtype)


def shares_memory(tensor: torch.Tensor, array) -> bool:
    """Whether `tensor` and the JAX `array` are one buffer (zero copy)."""
    return tensor.data_ptr() == array.unsafe_buffer_pointer()


def kernel_calls(info) -> list[tuple[tuple, dict]]:
    """The (avals, params) of every kernel call that op `info`'s examples
    make, as the op hands them to its kernel (recorded on the `interpret`
    backend): what the lowering tests lower for the hardware."""
    import torch_pallas
    from torch_pallas.runtime import compile_cache, launch

    calls = []
    real = launch.compiled_kernel

    from torch_pallas.runtime import registry

    def recording(op, device, inputs=(), params=None, *rest):
        # The op's own kernels (varlen_attention's are attention's), not the
        # other ops an example calls to build its inputs.
        if op == info.name or registry.get(op).kernels == info.kernels:
            calls.append((tuple((tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                for t in inputs), dict(params or {})))
        return real(op, device, inputs, params, *rest)

    launch.compiled_kernel = recording
    try:
        compile_cache.clear()  # every call reaches compiled_kernel
        with torch_pallas.backend("interpret"):
            for example in info.examples(torch.device("cpu"), False):
                info.overload(*example.args, **example.kwargs)
    finally:
        launch.compiled_kernel = real
    return calls


FAKE_CUDA_TRACE = """
import torch, torch_pallas
from torch._functorch.aot_autograd import aot_export_module
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode

{model}

with FakeTensorMode():
{inputs}
    gm, _ = aot_export_module(Model(), inputs, trace_joint=False)

def name(kernel):
    while not hasattr(kernel, "__name__"):
        kernel = kernel.fn
    return kernel.__name__

kernels = sorted({{name(kernel_side_table.get_kernel(i))
                  for i in range(len(kernel_side_table.id_to_kernel))}})
print("KERNELS", *kernels)
print("WRAPPERS", gm.code.count("higher_order.triton_kernel_wrapper_functional("))
print("OPAQUE", "torch.ops.pallas" in gm.code)
"""


def fake_cuda_trace(model: str, inputs: str) -> dict[str, str]:
    """Traces `Model` (source defining an nn.Module class of that name) on
    fake CUDA tensors (no GPU needed; `inputs`: source, indented by 4,
    binding the tuple `inputs`) through AOTAutograd, in a fresh process
    without TRITON_INTERPRET, and returns what the graph calls: the Triton
    kernels' names (KERNELS), the wrapped launches (WRAPPERS) and whether
    an opaque pallas op is left (OPAQUE)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = FAKE_CUDA_TRACE.format(model=textwrap.dedent(model),
                                  inputs=textwrap.indent(textwrap.dedent(inputs), "    "))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def computed_once(tmp_path_factory, worker_id: str, name: str, compute):
    """compute()'s (picklable) result, computed once per pytest run however
    many xdist workers ask for it: the first under a file lock, in the run's
    shared temporary folder; the others read it (a module fixture that
    starts processes would otherwise start them on every worker running
    one of its tests). Without xdist, computed here."""
    import pickle

    from filelock import FileLock

    if worker_id == "master":
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    path = shared / f"{name}.pickle"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            path.write_bytes(pickle.dumps(compute()))
        return pickle.loads(path.read_bytes())
