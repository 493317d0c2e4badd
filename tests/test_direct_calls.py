"""registration.direct_caller: the Python functions (torch_pallas.matmul,
torch_pallas.linear and the converted layers) run the op's kernel straight
on a plain eager call that needs no gradient, and hand every other call to
torch.ops, so that modes, transforms, autocast, tracers, profilers and
autograd see and decide it as they would the op itself. Each case runs on
fresh random ragged data against float64."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_pallas
from torch_pallas.base import torch_compat
from torch_pallas.library import registration
from torch_pallas.ops import matmul as matmul_op

OP = torch.ops.pallas.matmul.default

# Where this torch lacks the internals the short cut reads (torch_compat's
# eager_direct probe), every call goes through the dispatcher: none is taken.
SHORT_CUTS = 0 if torch_compat.EAGER is None else 1


@pytest.fixture
def counted(monkeypatch):
    """A direct caller of matmul whose short cut counts its calls."""
    calls = []
    kernel = registration._kernels[OP.name()]

    def counting(*args):
        calls.append(args)
        return kernel(*args)

    monkeypatch.setitem(registration._kernels, OP.name(), counting)
    return registration.direct_caller(OP), calls


def _operands(requires_grad=False):
    a = torch.randn(3, 7, 37, requires_grad=requires_grad)
    w = torch.nn.Parameter(torch.randn(29, 37), requires_grad=requires_grad)
    return a, w.t()


def _close(got, a, b, rtol=1e-5):
    want = a.detach().double() @ b.detach().double()
    scale = a.detach().double().abs() @ b.detach().double().abs() + 1
    assert got.shape == want.shape and ((got.double() - want).abs() <= rtol * scale).all()


@pytest.mark.parametrize("no_grad", [True, False], ids=["no_grad", "inputs_without_grad"])
def test_a_plain_call_without_gradients_takes_the_short_cut(counted, no_grad):
    call, calls = counted
    a, b = _operands(requires_grad=not no_grad)
    with torch.no_grad() if no_grad else torch.enable_grad():
        if not no_grad:
            a, b = a.detach(), b.detach()
        out = call(a, b)
    assert len(calls) == SHORT_CUTS
    assert out._base is None  # a fresh output, as the op's own (below views)
    _close(out, a, b)


def test_inference_mode_takes_the_short_cut_on_inference_tensors(counted):
    call, calls = counted
    a, b = _operands()
    with torch.inference_mode():
        x = a * 1  # an inference tensor
        out = call(x, b)
        assert out.is_inference()
    assert len(calls) == SHORT_CUTS
    _close(out, a, b)


def test_a_call_needing_a_gradient_goes_through_autograd(counted):
    call, calls = counted
    a, b = _operands(requires_grad=True)
    out = call(a, b)
    assert calls == [] and out.grad_fn is not None
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_a = a.detach().double().requires_grad_()
    (ref_a @ b.detach().double()).backward(grad.double())
    torch.testing.assert_close(a.grad, ref_a.grad.float(), rtol=1e-4, atol=1e-4)


class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _intercepted():
    """Contexts under which a call must reach the dispatcher: (name, context
    factory, what the call's result is checked for besides its values)."""
    from torch.utils.flop_counter import FlopCounterMode

    yield "dispatch_mode", Recording, lambda ctx, out: OP in ctx.calls
    yield "flop_counter", lambda: FlopCounterMode(display=False), \
        lambda ctx, out: ctx.get_total_flops() == 2 * 3 * 7 * 29 * 37
    yield "autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16), \
        lambda ctx, out: out.dtype == torch.bfloat16
    yield "default_device", lambda: torch.device("cpu"), lambda ctx, out: True
    yield "profiler", lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), \
        lambda ctx, out: any(e.name == "pallas::matmul" for e in ctx.events())


INTERCEPTED = {name: (make, check) for name, make, check in _intercepted()}


@pytest.mark.parametrize("name", INTERCEPTED)
def test_an_intercepted_call_reaches_the_dispatcher(counted, name):
    call, calls = counted
    make, check = INTERCEPTED[name]
    a, b = _operands()
    with torch.no_grad(), make() as ctx:
        out = call(a, b)
    assert calls == [] and check(ctx, out)
    if out.dtype == torch.float32:
        _close(out, a, b)
    else:  # autocast: the bfloat16-rounded operands' product, rounded to bfloat16
        _close(out.float(), a.bfloat16().float(), b.bfloat16().float(), rtol=2.0**-8)


def test_vmap_forward_ad_and_jit_trace_reach_the_dispatcher(counted):
    call, calls = counted
    a, b = _operands()
    with torch.no_grad():
        batched = torch.vmap(call, in_dims=(0, None))(a, b)
    _close(batched, a, b)
    with torch.autograd.forward_ad.dual_level():
        tangent = torch.randn_like(a)
        dual = call(torch.autograd.forward_ad.make_dual(a, tangent), b)
        got = torch.autograd.forward_ad.unpack_dual(dual).tangent
    _close(got, tangent, b)
    with torch.no_grad():
        traced = torch.jit.trace(lambda x, y: call(x, y), (a, b), check_trace=False)
        assert "pallas::matmul" in str(traced.graph)
    assert calls == []


def test_tensors_that_are_not_plain_reach_the_dispatcher(counted):
    """A subclass keeps its own handling; a meta tensor gets the op's fake
    function; neither is handed to the kernel."""
    call, calls = counted

    class Tagged(torch.Tensor):
        pass

    a, b = _operands()
    with torch.no_grad():
        out = call(a.as_subclass(Tagged), b)
        assert type(out) is Tagged  # torch.ops' __torch_function__ default keeps the subclass
        _close(out.as_subclass(torch.Tensor), a, b)
        meta = call(a.to("meta"), b.to("meta"))
        assert meta.device.type == "meta" and meta.shape == (3, 7, 29)
    assert calls == []


def test_the_public_functions_and_converted_layers_use_the_short_cut(monkeypatch):
    calls = []
    call = matmul_op.call

    def counting(*args):
        calls.append(args)
        return call(*args)

    monkeypatch.setattr(matmul_op, "call", counting)
    layer = torch_pallas.nn.replace_linear(torch.nn.Sequential(torch.nn.Linear(37, 29)))
    x = torch.randn(5, 37)
    with torch.no_grad():
        _close(torch_pallas.matmul(x, layer[0].weight.t()), x, layer[0].weight.t())
        out = layer(x)
    want = x.double() @ layer[0].weight.detach().double().t() + layer[0].bias.detach().double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2


def test_add_runs_its_kernel_straight_without_gradients_and_through_autograd_with_them():
    """torch_pallas.add is add's direct caller: a plain call needing no
    gradient runs the kernel below the dispatcher (a fresh output, no graph),
    one needing a gradient goes through autograd; both exact against float64
    on ragged broadcast shapes."""
    from torch_pallas.ops import add as add_op

    assert (add_op.call is torch.ops.pallas.add.default) == (SHORT_CUTS == 0)
    x, y = torch.randn(3, 1, 37), torch.randn(5, 37)
    with torch.no_grad():
        out = torch_pallas.add(x, y)
    assert out._base is None and out.grad_fn is None
    torch.testing.assert_close(out.double(), x.double() + y.double(), rtol=1e-6, atol=1e-6)
    x.requires_grad_()
    out = torch_pallas.add(x, y)
    out.backward(torch.ones_like(out))
    assert out.grad_fn is not None and torch.equal(x.grad, torch.full_like(x, 5.0))


FACTORIES = {"fill": (torch.ops.pallas.fill.default, ((37,), 1.25), torch.full),
             "iota": (torch.ops.pallas.iota.default, (37,), None)}


@pytest.fixture
def counted_factory(monkeypatch, request):
    """A direct caller of a factory op (fill, iota) whose short cut counts
    its calls."""
    op = FACTORIES[request.param][0]
    calls = []
    kernel = registration._kernels[op.name()]

    def counting(*args, **kwargs):
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setitem(registration._kernels, op.name(), counting)
    return request.param, registration.direct_caller(op), calls


def _factory_reference(name, args, dtype):
    if name == "fill":
        return torch.full(*args, dtype=dtype)
    return torch.arange(*args, dtype=dtype)


@pytest.mark.parametrize("counted_factory", FACTORIES, indirect=True)
def test_a_factory_call_with_plain_values_takes_the_short_cut(counted_factory):
    """fill and iota take no tensor: a size, a value, a dtype and a device
    of the schema's own types go to the kernel as they are (the dispatcher
    would hand them over unchanged)."""
    name, call, calls = counted_factory
    args = FACTORIES[name][1]
    for kwargs in ({}, {"dtype": torch.int32, "device": torch.device("cpu")},
                   {"dtype": None, "device": None}):
        out = call(*args, **kwargs)
        want = _factory_reference(name, args, kwargs.get("dtype"))
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert len(calls) == 3 * SHORT_CUTS


@pytest.mark.parametrize("counted_factory", FACTORIES, indirect=True)
def test_a_factory_call_the_dispatcher_would_convert_or_refuse_goes_through_it(counted_factory):
    """A device named by a string, a float size, a dtype that is not a
    torch.dtype, a tensor for a number: the dispatcher converts or refuses
    these, so the call goes to it and ends as the op's own would, with the
    same result or the same exception."""
    name, call, calls = counted_factory
    op, args = FACTORIES[name][:2]
    out = call(*args, device="cpu")  # converted: a string device
    torch.testing.assert_close(out, _factory_reference(name, args, None), rtol=0, atol=0)
    size_as_float = ((37.0,), 1.25) if name == "fill" else (37.0,)
    refused = [(size_as_float, {}), (args, {"dtype": "float32"})]
    if name == "fill":
        refused.append((((37,), torch.tensor(1.25)), {}))
    for bad_args, kwargs in refused:
        with pytest.raises(Exception) as through_op:
            op(*bad_args, **kwargs)
        with pytest.raises(type(through_op.value)) as direct:
            call(*bad_args, **kwargs)
        assert str(direct.value) == str(through_op.value)
    assert calls == []


def test_the_factories_public_functions_call_with_what_the_short_cut_takes(monkeypatch):
    """torch_pallas.fill and torch_pallas.iota call their ops' direct callers
    with arguments the short cut takes (the default device filled in as a
    torch.device), and get the op's results."""
    from torch_pallas.ops import fill as fill_op, iota as iota_op

    seen = []
    for module, op in ((fill_op, torch.ops.pallas.fill.default),
                       (iota_op, torch.ops.pallas.iota.default)):
        direct = registration.runs_directly(op)
        call = module.call

        def checking(*args, _call=call, _direct=direct, **kwargs):
            seen.append(_direct is not None and _direct(*args, **kwargs))
            return _call(*args, **kwargs)

        monkeypatch.setattr(module, "call", checking)
    value = float(torch.randn(()))
    torch.testing.assert_close(torch_pallas.fill((3, 5), value), torch.full((3, 5), value))
    torch.testing.assert_close(torch_pallas.fill(7, 3), torch.full((7,), 3))
    torch.testing.assert_close(torch_pallas.iota(11, dtype=torch.int32),
                               torch.arange(11, dtype=torch.int32))
    assert seen == [bool(SHORT_CUTS)] * 3


# --- composites: the ops whose implementation is other ops -------------------

def _composite_calls():
    """(name, composite OpOverload, call arguments (fresh, ragged), float64
    reference of the call)."""
    import torch.nn.functional as F

    x, w = torch.randn(3, 5, 37), torch.rand(37) + 0.5
    yield ("rms_norm", torch.ops.pallas.rms_norm.default, (x, [37], w, 1e-6),
           lambda x, s, w, eps: F.rms_norm(x.double(), s, w.double(), eps))
    b = torch.randn(37)
    yield ("layer_norm", torch.ops.pallas.layer_norm.default, (x, [37], w, b, 1e-5),
           lambda x, s, w, b, eps: F.layer_norm(x.double(), s, w.double(), b.double(), eps))
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
    yield ("attention", torch.ops.pallas.attention.default, (q, k, v, None, 0.0, False),
           lambda q, k, v, *rest: F.scaled_dot_product_attention(
               q.double(), k.double(), v.double(), enable_gqa=True))


COMPOSITES = {name: rest for name, *rest in _composite_calls()}


@pytest.mark.parametrize("name", COMPOSITES)
def test_a_composite_runs_its_implementation_straight_with_or_without_gradients(
        monkeypatch, name):
    """A composite's direct caller runs its implementation as the dispatcher
    would (above autograd): on plain tensors with or without gradients, the
    same values and gradients as the op through torch.ops; under a dispatch
    mode it goes to the dispatcher, whose decomposition the mode sees."""
    op, args, reference = COMPOSITES[name]
    kwargs = {"enable_gqa": True} if name == "attention" else {}
    implementation = registration._composites[op.name()]
    calls = []

    def counting(*a, **k):
        calls.append(a)
        return implementation(*a, **k)

    monkeypatch.setitem(registration._composites, op.name(), counting)
    call = registration.direct_caller(op)
    want = reference(*args)
    with torch.no_grad():
        torch.testing.assert_close(call(*args, **kwargs).double(), want, rtol=1e-5, atol=1e-5)
    inputs = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    out = call(*inputs, **kwargs)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [a for a in inputs if isinstance(a, torch.Tensor)], grad)
    through_op = op(*inputs, **kwargs)
    expected = torch.autograd.grad(through_op, [a for a in inputs if isinstance(a, torch.Tensor)],
                                   grad)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * SHORT_CUTS  # torch.ops runs the registered implementation
    with torch.no_grad(), Recording() as mode:
        torch.testing.assert_close(call(*args, **kwargs).double(), want, rtol=1e-5, atol=1e-5)
    assert any(f.name().startswith("pallas::") for f in mode.calls)
    assert len(calls) == 2 * SHORT_CUTS
