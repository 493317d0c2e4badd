"""The ops among PyTorch's machinery: in-place ops on their outputs,
forward-mode AD, torch.func, shape guards under torch.compile and
torch.export, symbolic fill values, meta tensors and default devices,
vmap and FLOP counting."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torch_pallas

P = torch.ops.pallas


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
def test_outputs_may_be_modified_in_place(requires_grad):
    a = torch.randn(5, 7, requires_grad=requires_grad)
    b = torch.randn(7, 3)
    residual = torch.randn(5, 3)
    out = P.matmul(a, b)  # the kernel's (1, 5, 3) result, reshaped
    assert out._base is None
    out.mul_(2).add_(residual)
    expected = (a @ b) * 2 + residual
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    if requires_grad:
        (grad,) = torch.autograd.grad(out.sum(), a)
        (expected_grad,) = torch.autograd.grad(expected.sum(), a)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)
    layer = torch.nn.Sequential(torch_pallas.nn.Linear(7, 3, bias=False), torch.nn.ReLU(inplace=True))
    layer(a).sum().backward()  # an in-place activation after a Pallas Linear


@pytest.mark.parametrize("shapes", [((4, 6), (6, 3)), ((2, 4, 6), (6,)), ((6,), (6, 3))],
                         ids=["mm", "batched-vector", "vector-matrix"])
def test_forward_mode_ad_of_matmul(shapes):
    a, b = (torch.randn(s) for s in shapes)
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    for tangents in [(ta, None), (None, tb), (ta, tb)]:
        with fwAD.dual_level():
            duals = [x if t is None else fwAD.make_dual(x, t) for x, t in zip((a, b), tangents)]
            tangent = fwAD.unpack_dual(P.matmul(*duals)).tangent
            expected = fwAD.unpack_dual(torch.matmul(*duals)).tangent
        torch.testing.assert_close(tangent, expected, rtol=1e-5, atol=1e-5)


def test_forward_mode_ad_of_add_broadcasts_the_tangent():
    x, y = torch.randn(3, 4), torch.randn(4)
    for tangents in [(torch.randn(3, 4), None), (None, torch.randn(4)),
                     (torch.randn(3, 4), torch.randn(4))]:
        with fwAD.dual_level():
            duals = [v if t is None else fwAD.make_dual(v, t) for v, t in zip((x, y), tangents)]
            tangent = fwAD.unpack_dual(P.add(*duals)).tangent
            expected = fwAD.unpack_dual(torch.add(*duals)).tangent
        assert tangent.shape == (3, 4)
        torch.testing.assert_close(tangent, expected)


def test_forward_mode_ad_of_an_op_without_a_jvp_raises():
    import jax.numpy as jnp

    @torch_pallas.custom_op("machinery::double")
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * jnp.float32(2)

    x = torch.randn(5)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="machinery::double: forward-mode AD"):
        torch.ops.machinery.double(fwAD.make_dual(x, torch.ones_like(x)))


def test_torch_func_differentiation_says_what_to_use_instead():
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    for transform in (lambda f: torch.func.grad(f)(a),
                      lambda f: torch.func.jvp(f, (a,), (torch.ones_like(a),))):
        with pytest.raises(RuntimeError, match="pallas::matmul: torch.func transforms.*torch.autograd"):
            transform(lambda a: P.matmul(a, b).sum())
    # vmap alone (no gradient) works
    x = torch.randn(6, 3, 4)
    torch.testing.assert_close(torch.vmap(P.matmul, in_dims=(0, None))(x, b), x @ b,
                               rtol=1e-5, atol=1e-5)


def test_add_with_a_lower_rank_operand_compiles_once_for_every_batch():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    bias = torch.randn(8)
    compiled = torch.compile(lambda x: P.add(x, bias), backend=counter, dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    for batch in (3, 6, 8, 2):  # (s0, 6, 8) against (8,) once compared s0 with 6
        x = torch.randn(batch, 6, 8)
        torch.testing.assert_close(compiled(x), x + bias)
    assert counter.frame_count == 1


def test_export_with_a_dynamic_batch():
    class Affine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            return P.add(P.matmul(x, self.w), self.b)

    model = Affine()
    batch = torch.export.Dim("batch", max=64)
    exported = torch.export.export(model, (torch.randn(5, 3, 6),), dynamic_shapes=({0: batch},))
    for size in (2, 6, 11):
        x = torch.randn(size, 3, 6)
        torch.testing.assert_close(exported.module()(x), x @ model.w + model.b,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_fill_with_a_value_torch_compile_makes_symbolic(dynamic):
    compiled = torch.compile(lambda x, v: P.fill(list(x.shape), v) * x, fullgraph=True,
                             dynamic=dynamic)
    torch._dynamo.reset()
    x = torch.randn(3, 5)
    for value in (1, 2, 3, 1.5, 2.5):
        torch.testing.assert_close(compiled(x, value), torch.full(x.shape, value) * x)


def test_factories_on_meta_and_under_a_default_device():
    assert P.fill((2, 3), 1.5, device="meta").device.type == "meta"
    out = P.iota(7, dtype=torch.int32, device="meta")
    assert out.device.type == "meta" and out.shape == (7,) and out.dtype == torch.int32
    with torch.device("meta"):
        assert torch_pallas.fill((2, 3), 1.5).device.type == "meta"
        assert torch_pallas.iota(4).device.type == "meta"
    assert torch_pallas.fill(3, 2.0).device.type == "cpu"


VMAP_CASES = [  # op, the two operands' shapes, in_dims
    ("matmul", (5, 4, 6), (6, 3), (0, None)),
    ("matmul", (4, 6), (5, 6, 3), (None, 0)),
    ("matmul", (4, 5, 6), (6, 5, 3), (1, 1)),
    ("matmul", (2, 4, 6), (5, 6, 3), (None, 0)),  # a's own batch against the vmapped one
    ("matmul", (5, 6), (6, 3), (0, None)),  # per example a vector times a matrix
    ("matmul", (4, 6), (5, 6), (None, 0)),  # a matrix times a vector
    ("matmul", (5, 6), (6, 5), (0, 1)),  # vector . vector
    ("add", (5, 3, 4), (4,), (0, None)),
    ("add", (4,), (5, 3, 4), (None, 0)),
    ("add", (3, 5), (2, 3, 1), (1, None)),
    ("add", (5, 4), (5, 3, 4), (0, 0)),  # x's example rank below y's
]
# matmul sums in another order than torch's; add is exact
VMAP_TOLERANCE = {"matmul": {"rtol": 1e-5, "atol": 1e-5}, "add": {}}


@pytest.mark.parametrize("op,first,second,in_dims", VMAP_CASES,
                         ids=[f"{c[0]}-{c[3]}-{len(c[1])}d-{len(c[2])}d" for c in VMAP_CASES])
def test_vmap_is_one_call(op, first, second, in_dims, monkeypatch):
    from torch_pallas.runtime import launch

    x, y = torch.randn(first), torch.randn(second)
    calls = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda *args, **kw: calls.append(1) or run(*args, **kw))
    out = torch.vmap(getattr(P, op), in_dims=in_dims)(x, y)
    expected = torch.vmap(getattr(torch, op), in_dims=in_dims)(x, y)
    torch.testing.assert_close(out, expected, **VMAP_TOLERANCE[op])
    assert len(calls) == 1


# Shapes whose products torch counts (mm, bmm), broadcast batches included.
FLOP_SHAPES = [((7, 13), (13, 5)), ((3, 9, 6), (6, 11)), ((2, 1, 4, 5), (3, 5, 6)), ((4, 3, 5), (4, 5, 2))]


@pytest.mark.parametrize("shapes", FLOP_SHAPES, ids=lambda s: f"{s[0]}@{s[1]}")
def test_flop_counter_counts_matmul_forward_and_backward_as_torch_does(shapes):
    from torch.utils.flop_counter import FlopCounterMode

    def flops(matmul):
        a, b = (torch.randn(s, requires_grad=True) for s in shapes)
        with FlopCounterMode(display=False) as counter:
            matmul(a, b).sum().backward()
        return counter.get_total_flops()

    m, k = shapes[0][-2:]
    n = shapes[1][-1]
    batch = torch.broadcast_shapes(shapes[0][:-2], shapes[1][:-2]).numel()
    assert flops(P.matmul) == flops(torch.matmul) == 3 * 2 * batch * m * n * k  # forward, dA, dB


def test_flop_formulas_wait_for_flop_counter_to_be_imported():
    """torch_pallas does not import flop_counter (0.3 s: Inductor, Triton);
    its formulas are registered when flop_counter is imported, before or after."""
    count = (
        "import sys, torch, torch_pallas\n"
        "{imported}\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "a, b = torch.empty(3, 7, 5, device='meta'), torch.empty(5, 6, device='meta')\n"
        "with FlopCounterMode(display=False) as counter:\n"
        "    torch.ops.pallas.matmul(a, b)\n"
        "print(counter.get_total_flops())"
    )
    after = count.format(imported="print('torch.utils.flop_counter' in sys.modules)")
    before = "import torch.utils.flop_counter\n" + count.format(imported="")
    for code, expected in ((after, ["False", "1260"]), (before, ["1260"])):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        assert out.stdout.split() == expected
