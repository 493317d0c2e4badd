"""Every registered op on inputs in the layouts models give them (transposed,
permuted, sliced, expanded: tests/layouts.py), built from the op's own
examples, so a new op is covered once it is registered:

- on every CPU backend, the op's fake describes exactly what its kernels
  return (sizes, strides, dtype, storage offset: opcheck's fake-tensor check);
- under torch.compile(fullgraph=True), with static and with dynamic shapes,
  the outputs and the gradients of every input that requires grad equal
  eager's. A compiled graph checks the strides a fake promised: a fake
  that promised an input's layout for a contiguous result failed there
  (attention_backward's `empty_like(q)` on a transposed q).
"""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import CPU_BACKENDS
from layouts import LAYOUTS, rebased
from torch_pallas import backends, registry

CPU = torch.device("cpu")


def examples(info):
    """The op's examples with inputs requiring grad where it has any, else
    those without (factory ops, the backward op)."""
    return info.examples(CPU, True) or info.examples(CPU, False)


def _floating(outputs):
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


# Every simulated call runs once per layout here; the attention ops on the
# simulators take a few seconds each, and go to -m exhaustive as in opcheck.
SLOW_ON_SIMULATORS = ("attention", "attention_backward")
FAKE_CASES = [
    pytest.param(backend, info, marks=[pytest.mark.exhaustive] if (
        backends.get(backend).simulated and info.name in SLOW_ON_SIMULATORS) else [],
        id=f"{backend}-{info.name}")
    for backend in CPU_BACKENDS for info in registry.ops()
]


@pytest.mark.parametrize("backend,info", FAKE_CASES)
def test_fakes_describe_what_the_kernels_return(backend, info):
    with torch_pallas.backend(backend):
        for example in info.examples(CPU, False):
            for layout in LAYOUTS:
                bases, rebuild = rebased(example.args, example.kwargs, layout)
                args, kwargs = rebuild(bases)
                torch.library.opcheck(info.overload, args, kwargs, test_utils="test_faketensor")


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("info", registry.ops(), ids=lambda info: info.name)
def test_compiled_forward_and_backward_equal_eager_on_model_layouts(info, dynamic):
    """One compiled function per example calls the op on every layout at
    once (one compilation, not one per layout); a loss weighting each
    floating output with fresh random numbers gives every input its
    gradient."""
    op = info.overload
    for number, example in enumerate(examples(info)):
        cases = [(layout.name, *rebased(example.args, example.kwargs, layout))
                 for layout in LAYOUTS]

        def calls(*all_bases):
            outputs, start = [], 0
            for _, bases, rebuild in cases:
                args, kwargs = rebuild(all_bases[start:start + len(bases)])
                outputs.append(op(*args, **kwargs))
                start += len(bases)
            return outputs

        def loss(outputs, weights):
            total = 0.0
            for out, w in zip([o for outs in outputs for o in _floating(outs)], weights):
                total = total + (out.float() * w).sum()
            return total

        eager_bases = [b for _, bases, _ in cases for b in bases]
        compiled_bases = [b.detach().clone().requires_grad_(b.requires_grad) for b in eager_bases]
        expected = calls(*eager_bases)
        weights = [torch.randn(o.shape) for outs in expected for o in _floating(outs)]
        torch._dynamo.reset()
        got = torch.compile(calls, fullgraph=True, dynamic=dynamic)(*compiled_bases)

        what = f"{info.name} example {number}"
        for (layout, _, _), g, e in zip(cases, got, expected):
            torch.testing.assert_close(g, e, msg=lambda m: f"{what}, {layout}: {m}")
        leaves = [(e, c) for e, c in zip(eager_bases, compiled_bases) if e.requires_grad]
        if not leaves or not weights:
            continue
        loss(expected, weights).backward()
        loss(got, weights).backward()
        for e, c in leaves:
            torch.testing.assert_close(c.grad, e.grad, msg=lambda m: f"{what} gradient: {m}")
