"""torch.library.opcheck (schema, fake, autograd registration, AOT dispatch)
for every registered op, on every CPU backend, with and without
requires_grad."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import backend_cases
from torch_pallas.runtime import registry


# opcheck runs each example several times: the attention ops on the
# simulators take minutes, and run with -m exhaustive.
CASES = backend_cases({info.name: info for info in registry.ops()})


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("backend,info", CASES)
def test_opcheck_every_op(backend, info, requires_grad):
    """Every registered op's examples (ops/<op>.py), with and without
    requires_grad (factory ops have no tensor inputs: no gradient case)."""
    examples = info.examples(torch.device("cpu"), requires_grad)
    assert examples or requires_grad, f"{info.name} has no examples"
    with torch_pallas.backend(backend):
        for example in examples:
            torch.library.opcheck(info.overload, example.args, dict(example.kwargs))


# The slow ops' examples on the simulators with -m exhaustive: each of them
# runs on every simulator in its own test file's default cases.
@pytest.mark.parametrize("backend,info", CASES)
def test_examples_match_their_references(backend, info):
    with torch_pallas.backend(backend):
        for example in info.examples(torch.device("cpu"), False):
            err, within = example.error(info.overload(*example.args, **example.kwargs))
            assert within, f"{info.name}{example.args}: max |error| {err:.3g} past the bound"


def test_dispatch_modes_see_every_call():
    """Calls that need no gradient take a short cut past the dispatcher only
    when nothing sits between autograd and the kernel: a
    TorchDispatchMode (as used by FakeTensorMode, functionalization,
    profilers) still sees the op and decides what runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(4, 6), torch.randn(6)
    with Recording() as mode, torch.no_grad():
        out = torch.ops.pallas.add(x, y)
    assert "pallas.add.default" in mode.calls
    torch.testing.assert_close(out, x + y)
