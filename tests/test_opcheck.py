"""torch.library.opcheck (schema, fake, autograd registration, AOT dispatch)
for every op, on every CPU backend, with and without requires_grad."""

from __future__ import annotations

import pytest
import torch


def op_samples(requires_grad: bool):
    def t(*shape):
        return torch.randn(*shape, requires_grad=requires_grad)

    return [
        ("add", torch.ops.pallas.add.default, (t(5, 1, 7), t(3, 7)), {}),
        ("matmul", torch.ops.pallas.matmul.default, (t(9, 13), t(13, 6)), {}),
    ]


FACTORY_SAMPLES = [
    ("fill", torch.ops.pallas.fill.default, ((3, 5), 1.5), {"dtype": torch.float32}),
    ("fill-int", torch.ops.pallas.fill.default, ((4,), 7), {}),
    ("iota", torch.ops.pallas.iota.default, (11,), {"dtype": torch.int32}),
    ("iota-int64", torch.ops.pallas.iota.default, (6,), {}),
]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_tensor_ops(cpu_backend, requires_grad):
    for name, op, args, kwargs in op_samples(requires_grad):
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("name,op,args,kwargs", FACTORY_SAMPLES, ids=[s[0] for s in FACTORY_SAMPLES])
def test_opcheck_factory_ops(cpu_backend, name, op, args, kwargs):
    torch.library.opcheck(op, args, kwargs)


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
