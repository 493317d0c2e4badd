"""The `tpu` backend: CPU torch tensors run on the TPU JAX sees, the TPU
kernels compiled by Mosaic for the chip.

Without a TPU (CI, every CPU machine) an explicit request raises a clear
BackendError, and the tests marked `tpu` skip. On a TPU machine they run in
one process (one program holds the chip): `pytest -m tpu -n 0`. Each op's
examples against their float64 references, every gradient against the same
call on the CPU (`interpret`), a user's TPU kernel through `custom_op`, and
a small model's training step."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import backends, registry

needs_tpu = pytest.mark.skipif("not backends.has_tpu()", reason="needs a TPU that JAX sees")
OPS = registry.ops()


def test_tpu_is_a_backend_that_refuses_without_a_chip():
    """Without a chip an explicit `tpu` raises, naming the op and the
    backend; with one the same call runs there."""
    assert backends.get("tpu").family == "tpu"
    x, y = torch.randn(4), torch.randn(4)
    with torch_pallas.backend("tpu"):
        if backends.has_tpu():
            torch.testing.assert_close(torch_pallas.add(x, y), x + y)
            return
        with pytest.raises(torch_pallas.BackendError, match=r"pallas::add: backend 'tpu'.*TPU"):
            torch_pallas.add(x, y)


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("info", OPS, ids=lambda info: info.name)
def test_examples_on_the_chip(info):
    with torch_pallas.backend("tpu"):
        for example in info.examples(torch.device("cpu"), False):
            out = info.overload(*example.args, **example.kwargs)
            # float32 bounds widened by the chip's allowance (its exp and log)
            err, within = example.error(out, backends.get("tpu").float32_allowance)
            assert within, f"{info.name}: max |error| {err:.3g} beyond the bound"


def _leaves(example) -> list[torch.Tensor]:
    return [a for a in example.args if isinstance(a, torch.Tensor) and a.requires_grad]


def _gradients(info, example) -> tuple[torch.Tensor, ...]:
    out = info.overload(*example.args, **example.kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator().manual_seed(0)
    total = sum((o.float() * torch.randn(o.shape, generator=generator)).sum()
                for o in outs if o.is_floating_point() and o.requires_grad)
    return torch.autograd.grad(total, _leaves(example), allow_unused=True)


def _differentiable():
    """The ops whose examples have leaves that require grad (on a TPU
    machine; elsewhere every op, each skipped for want of the chip)."""
    if not backends.has_tpu():
        return OPS
    return [info for info in OPS
            if any(_leaves(e) for e in info.examples(torch.device("cpu"), True))]


@pytest.mark.tpu
@needs_tpu
@pytest.mark.parametrize("info", _differentiable(), ids=lambda info: info.name)
def test_gradients_on_the_chip_match_the_cpu(info):
    examples = [e for e in info.examples(torch.device("cpu"), True) if _leaves(e)]
    for example in examples:
        with torch_pallas.backend("tpu"):
            got = _gradients(info, example)
        expected = _gradients(info, example)  # the CPU's `interpret`
        for g, e in zip(got, expected):
            if e is None:
                assert g is None
                continue
            # float32: the chip's products in full, its exp and rsqrt a few
            # ulps from the CPU's; 16-bit: their rounding
            tol = 1e-4 if e.dtype == torch.float32 else 3e-2
            scale = e.abs().max().item() or 1.0
            torch.testing.assert_close(g, e, rtol=tol, atol=tol * scale,
                                       msg=f"{info.name}: {tuple(e.shape)} {e.dtype}")


@pytest.mark.tpu
@needs_tpu
def test_a_users_tpu_kernel_through_custom_op():
    """Bring your own kernel: a Pallas TPU kernel registered with custom_op
    runs on the chip, with its backward (JAX cannot differentiate a
    pallas_call by itself)."""
    import jax
    from jax.experimental import pallas as pl

    @torch_pallas.custom_op("tputest::scaled_square",
                            backward=lambda grad, x, scale: (grad * 2.0 * scale * x,))
    def scaled_square(x: torch.Tensor, scale: float, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * x_ref[...] * scale

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    x = torch.randn(8, 128, requires_grad=True)
    with torch_pallas.backend("tpu"):
        y = scaled_square(x, 1.5)
        (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, 1.5 * x.detach() ** 2)
    torch.testing.assert_close(gx, 3.0 * x.detach())


@pytest.mark.tpu
@needs_tpu
def test_a_training_step_on_the_chip():
    """A small MLP on the ops (linear, rms_norm, swiglu, linear_cross_entropy)
    trained for three AdamW steps on the chip and on the CPU: the same
    losses."""
    losses = {}
    for name in ("tpu", None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.SiLU(),
                                    torch.nn.Linear(256, 128))
        model = torch_pallas.nn.replace_linear(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, target = torch.randn(64, 128), torch.randint(0, 128, (64,))
        losses[name] = []
        with torch_pallas.backend(name):
            for _ in range(3):
                hidden = torch_pallas.rms_norm(model(x), (128,), eps=1e-6)
                loss = torch.nn.functional.cross_entropy(hidden, target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses[name].append(loss.item())
    assert losses["tpu"] == pytest.approx(losses[None], rel=1e-3)
