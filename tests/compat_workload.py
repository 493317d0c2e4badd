"""The ops through what a model does with them: run by
tests/test_torch_compat.py in a fresh process with TORCH_PALLAS_PUBLIC_API
set to `all` (every part below) or to one probe (the parts that probe's
private path serves), so the public fallbacks carry the load. Prints "OK".
"""

import sys

import torch

import torch_pallas
from torch_pallas.base import torch_compat
from torch_pallas.runtime import registry

public = sys.argv[1]
assert not any(torch_compat.available()[p] for p in torch_compat.PROBES
               if public == "all" or p == public), torch_compat.available()
SERVES = {  # the parts each probe's private path serves
    "autograd_kernel": {"ops", "autograd"},
    "autocast_kernel": {"autocast"},
    "tracing_types": {"compile"},
    "symint_hint": {"custom_op"},
    "eager_direct": {"ops", "autograd", "autocast", "layers"},
    "fp32_precision": {"precision"},
    "sharding_key": {"sharding"},
    "device_dispatch": {"devices"},
}
parts = set().union(*SERVES.values()) if public == "all" else SERVES[public]

for info in registry.ops() if "ops" in parts else ():  # forward on every op, against float64
    for example in info.examples(torch.device("cpu"), False):
        err, within = example.error(info.overload(*example.args, **example.kwargs))
        assert within, (info.name, err)

if "autograd" in parts:
    a = torch.randn(5, 7, 9, requires_grad=True)
    b = torch.randn(9, 3, requires_grad=True)
    bias = torch.randn(3, requires_grad=True)
    out = torch_pallas.add(torch_pallas.matmul(a, b), bias)
    ref_a, ref_b, ref_bias = (t.detach().double().requires_grad_() for t in (a, b, bias))
    ref = ref_a @ ref_b + ref_bias
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    for t, r in ((a, ref_a), (b, ref_b), (bias, ref_bias)):
        torch.testing.assert_close(t.grad, r.grad.float(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)

if "autocast" in parts:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_pallas.matmul(torch.randn(4, 8), torch.randn(8, 2)).dtype == torch.bfloat16

if "autograd" in parts:
    with torch.autograd.forward_ad.dual_level():
        x = torch.autograd.forward_ad.make_dual(torch.randn(3, 4), torch.randn(3, 4))
        w = torch.randn(4, 2)
        try:
            tangent = torch.autograd.forward_ad.unpack_dual(torch_pallas.matmul(x, w)).tangent
        except RuntimeError:  # the public autograd path has no forward mode
            assert not torch_compat.available()["autograd_kernel"]
        else:
            torch.testing.assert_close(tangent, torch.autograd.forward_ad.unpack_dual(x).tangent @ w)

if "layers" in parts:  # a converted layer without gradients, repeated (its plans)
    layer = torch_pallas.nn.replace_linear(torch.nn.Sequential(torch.nn.Linear(9, 5)))[0]
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 9)
            ref = x.double() @ layer.weight.double().t() + layer.bias.double()
            torch.testing.assert_close(layer(x), ref.float(), rtol=1e-5, atol=1e-5)

if "precision" in parts:  # what the float32 matmul precision settings allow, as read per call
    from torch_pallas.ops import matmul as matmul_op

    assert matmul_op.float32_precision() == "ieee"
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    assert matmul_op.float32_precision() == "tf32"
    torch.set_float32_matmul_precision(saved)
    assert matmul_op.float32_precision() == "ieee"

if "compile" in parts:
    compiled = torch.compile(lambda a, b: torch_pallas.add(torch_pallas.matmul(a, b), b[0]),
                             fullgraph=True, dynamic=True)
    for m in (6, 11):
        x, y = torch.randn(m, 4), torch.randn(4, 4)
        torch.testing.assert_close(compiled(x, y), x @ y + y[0], rtol=1e-5, atol=1e-5)

if "custom_op" in parts:  # its fake function reads symbolic sizes' hints
    import jax.numpy as jnp

    @torch_pallas.custom_op("compat::double")
    def double(x: torch.Tensor) -> torch.Tensor:
        return jnp.concatenate([x, x])

    compiled = torch.compile(lambda x: double(x) + 1, fullgraph=True, dynamic=True)
    for n in (5, 9):
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(x), torch.cat([x, x]) + 1)

if "sharding" in parts:  # the backward op, whose decisions need more keys, gets no rule
    import torch_pallas.distributed.grouped_mm  # noqa: F401

    rules = torch_compat._sharding_schema_infos()  # torch's own record, read directly
    assert torch.ops.pallas.grouped_mm.default in rules
    assert torch.ops.pallas.grouped_mm_backward.default not in rules

if "devices" in parts:  # PrivateUse1's name from a device parse, no device key sets
    assert torch_compat.privateuse1_name("tpu") in ("tpu", "privateuseone")
    assert torch_compat.device_key_set("cpu") is None

print("OK")
