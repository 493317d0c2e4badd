"""torch_pallas on torch_tpu's `tpu` tensors (torch_pallas/torch_tpu.py),
checked on a CPU machine without a chip, where torch_tpu 0.2.0 loads (its
`torch.tpu` module and `torch.tpu.pallas.jax_op`) but PrivateUse1 keeps the
name "privateuseone" and holds no tensor with data:

- registration: every `pallas::` op with a device kernel has a PrivateUse1
  kernel, `import torch_pallas` registers them where torch_tpu is loaded,
  and imports neither torch_tpu nor JAX where it is not; the `pallas_tpu::`
  jax_ops' schemas; the factories (fill, iota) reach their `tpu` kernel by
  their device argument;
- the `tpu` kernels' logic with their JAX-side computations: each kernel is
  registered for the CPU key of a scoped library, its jax_op replaced by the
  same JAX function run on the CPU (`interpret`, or `tpu` on a TPU machine
  whose JAX sees the chip): values and torch autograd's gradients against
  the CPU ops, on ragged shapes; the refusals;
- the jax_ops' fakes (torch_tpu's, from `jax.export(platforms=["tpu"])`):
  `torch.library.opcheck`'s schema and fake tests on meta tensors, and each
  `tpu` kernel on meta tensors gives what the `pallas::` op's own fake
  promises (shapes, dtypes, strides);
- fake `privateuseone` tensors (FakeTensor over meta: torch_tpu creates
  no tensor without a chip): make_fx and torch.compile(backend="eager",
  fullgraph=True) of the ops, with symbolic shapes too, and a transformers
  Mixtral with attn_implementation and experts_implementation "pallas"
  after apply(), whose forward's graph holds the ops. Not possible here:
  autograd over them (torch's autograd engine records an event through
  torch_tpu's device guard, which aborts the process without a chip), and
  torch_tpu's own compile backend (it runs the graph on the chip);
- each jax_op's TPU export (`jax.export(platforms=["tpu"])` of its JAX
  function with the `tpu` backend's kernels) compiled for an abstract TPU
  v5e by libtpu's compile-only client, in a subprocess (libtpu's settings
  must be in place before JAX starts).

Values on a chip need torch_tpu there; the TPU machine within reach has
none: the JAX functions themselves run there (`tpu` backend) through the
CPU-key test above.

Marked `torch_tpu` (deselected by default): pytest -m torch_tpu
tests/test_torch_tpu.py, where torch-tpu is installed (CI's leg 4).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import torch_pallas
from torch_pallas import torch_tpu as tt

pytestmark = [
    pytest.mark.torch_tpu,
    # torch_tpu, asked for the device of a fake tpu tensor without a chip
    pytest.mark.filterwarnings("ignore:.*PJRT client not available:UserWarning"),
]

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@dataclasses.dataclass
class Case:
    """A call of the torch API on `args()`; its float tensors differentiated."""

    id: str
    args: Callable[[], tuple]
    call: Callable


def _cases() -> list[Case]:
    from test_jax_forms import CASES  # every op's public form, ragged shapes

    found = [Case(c.id, c.args, c.torch_call) for c in CASES]
    found += [
        Case("grouped_mm_batched_bias", lambda: (_r(3, 13, 40), _r(3, 40, 24), _r(3, 24)),
             lambda a, b, c: torch_pallas.grouped_mm(a, b, bias=c)),
        Case("grouped_mm_weights_stored_transposed",
             lambda: (_r(45, 40), _r(3, 24, 40), torch.tensor([7, 30, 45], dtype=torch.int32)),
             lambda a, w, e: torch_pallas.grouped_mm(a, w.mT, offs=e)),
        Case("rotary_heads_second_to_last",
             lambda: (_r(2, 11, 4, 16), _r(2, 11, 2, 16), _r(2, 11, 16), _r(2, 11, 16)),
             lambda q, k, c, s: torch_pallas.rotary_embedding(q, k, c, s, unsqueeze_dim=2)),
        Case("linear_cross_entropy_sum_bias_ignored",
             lambda: (_r(37, 24), _r(90, 24) * 0.3, _r(90),
                      torch.where(torch.rand(37) < 0.3, 5, torch.randint(0, 90, (37,)))),
             lambda x, w, b, t: torch_pallas.linear_cross_entropy(
                 x, w, t, b, ignore_index=5, reduction="sum")),
        Case("linear_logsumexp_softcap", lambda: (_r(29, 24), _r(70, 24) * 0.3, _r(70)),
             lambda x, w, b: torch.ops.pallas.linear_logsumexp(x, w, b, 3.0)),
        Case("token_log_probs_ignore_index_softcap_temperature",
             lambda: (_r(2, 19, 24), _r(90, 24) * 0.3, _r(90),
                      torch.where(torch.rand(2, 19) < 0.3, 5, torch.randint(0, 90, (2, 19)))),
             lambda x, w, b, t: torch_pallas.token_log_probs(
                 x, w, t, b, temperature=0.6, ignore_index=5, return_entropy=True,
                 softcap=4.0)),
        # a vocabulary shard's forward (DTensor's vocabulary-split head): targets
        # past the shard are other shards' tokens, -1 ignored
        Case("token_log_probs_forward_other_shards",
             lambda: (_r(23, 16), _r(40, 16), _r(40),
                      torch.where(torch.rand(23) < 0.2, -1, torch.randint(0, 80, (23,)))),
             lambda x, w, b, t: torch.ops.pallas.token_log_probs_forward(
                 x, w, t, b, -1, 0.8, None, True)[:2]),
        # the backward op asked for d_input and d_bias only
        Case("token_log_probs_backward_input_and_bias",
             lambda: (_r(17), _r(17), _r(17, 16), _r(50, 16), torch.randint(0, 50, (17,)),
                      _r(50)),
             lambda gl, ge, x, w, t, b: _token_log_probs_backward(gl, ge, x, w, t, b,
                                                                  [True, False, True])),
        Case("rms_norm_no_rows", lambda: (_r(0, 64), _r(64)),
             lambda x, w: torch_pallas.rms_norm(x, (64,), w)),
        Case("token_log_probs_no_rows",
             lambda: (_r(2, 0, 16), _r(40, 16), _r(40), torch.zeros(2, 0, dtype=torch.long)),
             lambda x, w, b, t: torch_pallas.token_log_probs(x, w, t, b, return_entropy=True)),
    ]
    return found


def _token_log_probs_backward(grad_log_prob, grad_entropy, x, w, t, b, grads):
    """pallas::token_log_probs_backward on the forward's lse and entropy,
    the gradients in `grads` (no autograd through the backward op)."""
    with torch.no_grad():
        _, entropy, lse = torch.ops.pallas.token_log_probs_forward(x, w, t, b, -100, 1.3, 3.0)
        return torch.ops.pallas.token_log_probs_backward(
            grad_log_prob, grad_entropy, x, w, t, b, lse, entropy, -100, 1.3, 3.0, grads)


CASES = _cases()


# --- running the tpu kernels on the CPU -----------------------------------------------

def _to_jax(value):
    """A jax_op argument as its JAX function gets it: a tensor as an array
    on JAX's default device (a TPU where JAX sees one), a dtype as JAX's,
    a list as a tuple."""
    import jax
    import numpy as np

    from torch_pallas.base import dtypes
    from torch_pallas.runtime import bridge

    if isinstance(value, torch.Tensor):
        host = np.array(bridge.to_kernel_argument(value.detach().contiguous()))
        return jax.device_put(host, jax.devices()[0])
    if isinstance(value, torch.dtype):
        return jax.numpy.dtype(dtypes.jax_name(value))
    if isinstance(value, list):
        return tuple(value)
    return value


def _to_torch(array) -> torch.Tensor:
    import jax
    import numpy as np

    from torch_pallas.base import dtypes

    host = np.asarray(jax.device_get(array))
    dtype = dtypes.TORCH_DTYPES[str(host.dtype)]
    if host.dtype.itemsize == 2 and dtype in (torch.bfloat16, torch.float16):
        return torch.from_numpy(host.view(np.int16).copy()).view(dtype)
    return torch.from_numpy(host.copy())


def _static(args) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))


class JaxOnHost:
    """Stands in for torch_pallas.torch_tpu._call (a jax_op on torch_tpu's
    chip): the jax_op's own JAX function, jitted with the jax_op's static
    arguments, on this machine's JAX device (its default backend's
    kernels). Notes each call (name, arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.kernels: list[str] = []  # the tpu kernels called (fixture tpu_kernels_on_cpu)

    def kernel(self, name):
        def call(*args, **kwargs):
            self.kernels.append(name)
            return tt.KERNELS[name](*args, **kwargs)
        return call

    def __call__(self, name, *args):
        import jax

        self.calls.append((name, args))
        function = tt.jax_functions()[name].__wrapped__  # without the tpu backend forced
        out = jax.jit(function, static_argnums=_static(args))(*map(_to_jax, args))
        return tuple(map(_to_torch, out)) if isinstance(out, tuple) else _to_torch(out)


@pytest.fixture
def tpu_kernels_on_cpu(monkeypatch):
    """The `tpu` kernels serve CPU tensors (a scoped library at the CPU
    key), their jax_ops run by JaxOnHost; yields it. (No torch_tpu needed:
    a TPU machine without it runs these with the `tpu` backend.)"""
    host = JaxOnHost()
    monkeypatch.setattr(tt, "_call", host)
    library = torch.library.Library("pallas", "IMPL")
    for name in tt.KERNELS:
        if name not in tt.FACTORIES:
            library.impl(name, host.kernel(name), "CPU")
    try:
        yield host
    finally:
        library._destroy()


def _run(case: Case, args):
    """(outputs, gradients of a random projection of them)."""
    leaves = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
              else a for a in args]
    out = case.call(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
    diff = [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(loss, diff, allow_unused=True) if loss.requires_grad else ()
    return [o.detach() for o in outs], grads


def _float32_allowance() -> float:
    """How far float32 may stray more on the backend the JAX functions run
    on here: the `tpu` backend's allowance where JAX sees a TPU."""
    import jax

    from torch_pallas.runtime import backends

    return backends.get("tpu").float32_allowance if jax.default_backend() == "tpu" else 1.0


def _assert_close(what, ours, theirs):
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, \
        f"{what}: {tuple(ours.shape)} {ours.dtype}, expected {tuple(theirs.shape)} {theirs.dtype}"
    if not theirs.numel():
        return
    tol = TOLERANCE.get(theirs.dtype, 2e-5) * max(1.0, theirs.float().abs().max().item())
    tol *= _float32_allowance() if theirs.dtype == torch.float32 else 1.0
    err = (ours.float() - theirs.float()).abs().max().item()
    assert err <= tol, f"{what}: max |tpu kernels - CPU op| = {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_tpu_kernels_give_the_cpu_ops_values_and_gradients(case, request):
    args = case.args()
    expected, expected_grads = _run(case, args)
    host = request.getfixturevalue("tpu_kernels_on_cpu")
    outs, grads = _run(case, args)
    assert host.kernels, f"{case.id}: no tpu kernel ran"
    for i, (o, e) in enumerate(zip(outs, expected, strict=True)):
        _assert_close(f"{case.id} output {i}", o, e)
    for i, (g, e) in enumerate(zip(grads, expected_grads, strict=True)):
        assert (g is None) == (e is None), f"{case.id}: gradient {i} is {g} where CPU's is {e}"
        if g is not None:
            _assert_close(f"{case.id} gradient {i}", g, e)


@pytest.mark.parametrize("size, value, dtype", [((3, 37), 2.5, None), ((130,), 7, None),
                                                 ((5, 2), -4.0, torch.float16), ((9,), -3, torch.int32),
                                                 ((2, 3), 1.25, torch.bfloat16)])
def test_fill_kernel(monkeypatch, size, value, dtype):
    monkeypatch.setattr(tt, "_call", JaxOnHost())
    out = tt.KERNELS["fill"](size, value, dtype=dtype, device="cpu")
    expected = torch.full(size, value, dtype=dtype)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


@pytest.mark.parametrize("n, dtype", [(1, None), (1000, None), (77, torch.float32),
                                      (5, torch.bfloat16), (0, None)])
def test_iota_kernel(monkeypatch, n, dtype):
    monkeypatch.setattr(tt, "_call", JaxOnHost())
    out = tt.KERNELS["iota"](n, dtype=dtype, device="cpu")
    expected = torch.arange(n, dtype=dtype or torch.int64)
    assert out.dtype == expected.dtype and torch.equal(out, expected)


@pytest.mark.parametrize("call, message", [
    (lambda: torch_pallas.attention(_r(1, 2, 9, 16), _r(1, 2, 9, 16), _r(1, 2, 9, 16),
                                    attn_mask=torch.rand(9, 9) < 0.5),
     r"pallas::attention_forward: on \w+ tensors \(torch_tpu\) mask \(a \(1, 1, 9, 9\) tensor\)"
     r" is not supported"),
    (lambda: torch_pallas.attention(_r(1, 2, 9, 16), _r(1, 2, 9, 16), _r(1, 2, 9, 16),
                                    dropout_p=0.25),
     r"pallas::attention_forward: on \w+ tensors \(torch_tpu\) dropout_p=0.25 is not supported"),
    (lambda: torch_pallas.grouped_mm(_r(8, 12), _r(12, 5), offs=torch.tensor([4, 12],
                                                                            dtype=torch.int32)),
     r"pallas::grouped_mm: .*mat_a \(8, 12\) and mat_b \(12, 5\) \(the 2-D x 2-D form, offs "
     r"slicing K\) are not supported"),
    (lambda: torch_pallas.grouped_mm(_r(2, 8, 12), _r(12, 6), offs=torch.tensor([4, 6],
                                                                               dtype=torch.int32)),
     r"pallas::grouped_mm: .*\(the 3-D x 2-D form, offs slicing the columns\) are not supported"),
])
def test_what_the_jax_forms_do_not_take_is_refused(tpu_kernels_on_cpu, call, message):
    with pytest.raises(NotImplementedError, match=message):
        call()
    assert tpu_kernels_on_cpu.kernels and not tpu_kernels_on_cpu.calls


# --- registration ----------------------------------------------------------------------

def _pallas_ops() -> dict[str, str]:
    """pallas:: op name -> the dispatch key of its body."""
    found = {}
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("pallas::"):
            name = schema.name.removeprefix("pallas::")
            for key in ("CompositeImplicitAutograd", "CompositeExplicitAutograd"):
                if torch._C._dispatch_has_kernel_for_dispatch_key(schema.name, key):
                    found[name] = key
    return found


def test_torch_tpu_is_detected_as_it_exposes_itself():
    assert tt.loaded() and tt.version() is not None
    assert "torch_tpu" in sys.modules and hasattr(torch.tpu.pallas, "jax_op")
    assert not hasattr(torch.backends, "tpu")  # what HF kernels tests for: absent in 0.2.0
    assert tt.device_type() in ("tpu", "privateuseone")


def test_import_registers_a_tpu_kernel_for_every_op_with_a_device_kernel():
    assert tt._state["library"] is not None  # by `import torch_pallas`, not by a test
    ops = _pallas_ops()
    with_kernels = {n for n, key in ops.items() if key == "CompositeExplicitAutograd"}
    assert with_kernels == set(tt.KERNELS)
    for name in ops:
        has = torch._C._dispatch_has_kernel_for_dispatch_key(f"pallas::{name}", "PrivateUse1")
        assert has == (name in with_kernels), name
    composites = {n for n, key in ops.items() if key == "CompositeImplicitAutograd"}
    assert {"attention", "varlen_attention", "rms_norm", "layer_norm",
            "linear_cross_entropy", "token_log_probs"} <= composites


JAX_OP_SCHEMAS = {
    "add": "(Tensor x, Tensor y) -> Tensor",
    "fill": "(SymInt[] size, Scalar value, ScalarType dtype) -> Tensor",
    "iota": "(SymInt n, ScalarType dtype) -> Tensor",
    "matmul": "(Tensor a, Tensor b) -> Tensor",
    "grouped_mm": "(Tensor lhs, Tensor rhs, Tensor group_ends, Tensor? bias, "
                  "ScalarType out_dtype) -> Tensor",
    "grouped_mm_backward": "(Tensor dy, Tensor lhs, Tensor rhs, Tensor group_ends, "
                           "bool want_lhs, bool want_rhs) -> (Tensor, Tensor)",
    "rms_norm_forward": "(Tensor x, Tensor? weight, float eps, str casting_mode) "
                        "-> (Tensor, Tensor)",
    "rms_norm_backward": "(Tensor grad_out, Tensor x, Tensor rstd, Tensor? weight, "
                         "str casting_mode) -> (Tensor, Tensor)",
    "layer_norm_forward": "(Tensor x, Tensor weight, Tensor bias, float eps) "
                          "-> (Tensor, Tensor, Tensor)",
    "layer_norm_backward": "(Tensor grad_out, Tensor x, Tensor mean, Tensor rstd, "
                           "Tensor weight) -> (Tensor, Tensor, Tensor)",
    "swiglu": "(Tensor gate, Tensor up) -> Tensor",
    "swiglu_backward": "(Tensor grad_out, Tensor gate, Tensor up) -> (Tensor, Tensor)",
    "rotary_embedding": "(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
    "rotary_embedding_backward": "(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin) "
                                 "-> (Tensor, Tensor)",
    "attention_forward": "(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? cu_seq_q, "
                         "Tensor? cu_seq_k, float scale, bool is_causal, SymInt window_left, "
                         "SymInt window_right, float softcap) -> (Tensor, Tensor)",
    "attention_backward": "(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, "
                          "Tensor lse, Tensor? cu_seq_q, Tensor? cu_seq_k, float scale, "
                          "bool is_causal, SymInt window_left, SymInt window_right, "
                          "float softcap) -> (Tensor, Tensor, Tensor)",
    "linear_cross_entropy_forward": "(Tensor input, Tensor weight, Tensor targets, "
                                    "Tensor? bias, str reduction, float label_smoothing, "
                                    "float softcap, bool want_input, bool want_weight, "
                                    "bool want_bias) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "linear_cross_entropy_backward": "(Tensor grad_loss, Tensor input, Tensor weight, "
                                     "Tensor targets, Tensor? bias, Tensor lse, str reduction, "
                                     "float label_smoothing, float softcap, bool want_input, "
                                     "bool want_weight, bool want_bias) "
                                     "-> (Tensor, Tensor, Tensor)",
    "token_log_probs_forward": "(Tensor input, Tensor weight, Tensor targets, Tensor? bias, "
                               "float temperature, float softcap) -> (Tensor, Tensor, Tensor)",
    "token_log_probs_backward": "(Tensor grad_log_prob, Tensor grad_entropy, Tensor input, "
                                "Tensor weight, Tensor targets, Tensor? bias, Tensor lse, "
                                "Tensor entropy, float temperature, float softcap, "
                                "bool want_input, bool want_weight, bool want_bias) "
                                "-> (Tensor, Tensor, Tensor)",
    "linear_logsumexp": "(Tensor input, Tensor weight, Tensor? bias, float softcap) -> Tensor",
    "linear_logsumexp_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor? bias, "
                                 "Tensor lse, float softcap, bool want_input, "
                                 "bool want_weight, bool want_bias) -> (Tensor, Tensor, Tensor)",
}


def test_jax_op_schemas():
    tt.register()
    assert set(JAX_OP_SCHEMAS) == set(tt.KERNELS)
    for name, schema in JAX_OP_SCHEMAS.items():
        assert str(getattr(torch.ops.pallas_tpu, name).default._schema) == \
            f"pallas_tpu::{name}{schema}"


def test_factories_reach_their_tpu_kernel_by_their_device(monkeypatch):
    calls = []

    def record(name, *args):
        calls.append((name, *args))
        return torch.zeros(args[0] if name == "fill" else (args[0],))

    monkeypatch.setattr(tt, "_call", record)
    device = torch.device(tt.device_type())
    torch.ops.pallas.fill([3, 2], 1.5, device=device)
    torch_pallas.fill((4,), 2, device=device)  # the direct path leaves other devices alone
    torch.ops.pallas.iota(5, dtype=torch.float32, device=device)
    assert calls == [("fill", [3, 2], 1.5, torch.float32), ("fill", [4], 2, torch.int32),
                     ("iota", 5, torch.float32)]
    # the other devices as before
    assert torch.equal(torch.ops.pallas.fill([2, 3], 7), torch.full((2, 3), 7))
    assert torch.ops.pallas.iota(9, device="meta").shape == (9,)
    assert not calls[3:]


def test_register_says_why_where_torch_tpu_is_absent(monkeypatch):
    monkeypatch.setitem(tt._state, "registered", False)
    monkeypatch.setitem(tt._state, "library", None)
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # `import torch_tpu` raises ImportError
    monkeypatch.delattr(torch, "tpu")
    assert not tt.loaded()
    with pytest.raises(ImportError, match=r"torch_pallas.torch_tpu.register: torch_tpu does not "
                                          r"import here \(torch-tpu .*pip install torch-tpu"):
        tt.register()
    tt.register_if_loaded()  # nothing: torch_tpu is not loaded


def _last_line_printed(code: str, **env) -> str:
    """The last line `python -c code` prints in a fresh process (with
    `env` added to this one's environment), which must succeed."""
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_import_torch_pallas_leaves_torch_tpu_and_jax_alone_where_not_loaded():
    code = ("import sys, torch, torch_pallas; "
            "print(sorted(m for m in ('torch_tpu', 'jax') if m in sys.modules), "
            "torch_pallas.torch_tpu._state['library'] is not None)")
    assert _last_line_printed(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == "[] False"


def test_import_torch_pallas_registers_the_kernels_but_imports_no_jax_where_loaded():
    code = ("import sys, torch, torch_pallas, torch._C as C; "
            "print('torch_tpu' in sys.modules, 'jax' in sys.modules, "
            "C._dispatch_has_kernel_for_dispatch_key('pallas::matmul', 'PrivateUse1'), "
            "hasattr(torch.ops.pallas_tpu, 'matmul'))")
    assert _last_line_printed(code) == "True False True False"


# --- the jax_ops' fakes, on meta tensors -------------------------------------------------

class Recorder:
    """Stands in for tt._call: notes each jax_op call and answers with
    zeros shaped as its JAX function's outputs (jax.eval_shape, no kernel
    run); `kernel_calls` notes each tpu kernel's call (op name, arguments)
    as the CPU-key library hands it over."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.kernel_calls: list[tuple[str, tuple, dict]] = []

    def __call__(self, name, *args):
        import jax

        from torch_pallas.base import dtypes

        self.calls.append((name, args))
        function = tt.jax_functions()[name].__wrapped__
        specs = [jax.ShapeDtypeStruct(tuple(a.shape), dtypes.jax_name(a.dtype))
                 if isinstance(a, torch.Tensor) else _to_jax(a) for a in args]
        static = _static(args)
        out = jax.eval_shape(lambda *arrays: function(*_merge(specs, arrays, static)),
                             *[s for i, s in enumerate(specs) if i not in static])
        leaves = [torch.zeros(o.shape, dtype=dtypes.TORCH_DTYPES[str(o.dtype)])
                  for o in jax.tree.leaves(out)]
        return tuple(leaves) if isinstance(out, (tuple, list)) else leaves[0]

    def kernel(self, name):
        def call(*args, **kwargs):
            self.kernel_calls.append((name, args, kwargs))
            return tt.KERNELS[name](*args, **kwargs)
        return call


def _merge(specs, arrays, static):
    arrays = iter(arrays)
    return [s if i in static else next(arrays) for i, s in enumerate(specs)]


def record_calls() -> Recorder:
    """Every case's calls of the tpu kernels and of their jax_ops, forward
    and backward, none run (each kernel answers zeros)."""
    recorder = Recorder()
    saved = tt._call
    tt._call = recorder
    library = torch.library.Library("pallas", "IMPL")
    try:
        for name in tt.KERNELS:
            if name not in tt.FACTORIES:
                library.impl(name, recorder.kernel(name), "CPU")
        torch.manual_seed(0)
        for case in CASES:
            _run(case, case.args())
        torch.ops.pallas.linear_cross_entropy_backward(  # reduction "none" takes this op
            _r(9), _r(9, 16), _r(40, 16), torch.randint(0, 40, (9,)), _r(40), _r(9), -100,
            "none", 0.0, 2.0, [True, True, True])
        tt.KERNELS["fill"]([3, 5], 1.5, dtype=torch.bfloat16, device="cpu")
        tt.KERNELS["iota"](100, device="cpu")
    finally:
        tt._call = saved
        library._destroy()
    return recorder


@pytest.fixture(scope="module")
def recorded():
    tt.register()  # the jax_ops, which the tests of their fakes call
    return record_calls()


def _meta(value):
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _first_calls(calls) -> dict:
    found = {}
    for name, *rest in calls:
        found.setdefault(name, rest)
    return found


def test_every_jax_op_and_tpu_kernel_is_reached(recorded):
    assert set(_first_calls(recorded.calls)) == set(tt.KERNELS)
    assert set(_first_calls(recorded.kernel_calls)) == set(tt.KERNELS) - set(tt.FACTORIES)


@pytest.mark.parametrize("name", sorted(set(tt.KERNELS) - set(tt.FACTORIES)))
def test_opcheck_schema_and_fake_of_each_jax_op_on_meta_tensors(recorded, name):
    (args,) = _first_calls(recorded.calls)[name]
    op = getattr(torch.ops.pallas_tpu, name).default
    with tt.building_for(tt._Chip("TPU v5 lite")):
        torch.library.opcheck(op, tuple(_meta(a) for a in args),
                              test_utils=("test_schema", "test_faketensor"))


def test_the_factory_jax_ops_fakes():
    """fill and iota take no tensor: opcheck's schema test would run their
    real kernel (torch_tpu's, on a chip); their fakes under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tt.building_for(tt._Chip("TPU v5 lite")), FakeTensorMode():
        filled = torch.ops.pallas_tpu.fill([3, 130], 2.5, torch.bfloat16)
        counted = torch.ops.pallas_tpu.iota(77, torch.int32)
    assert (filled.shape, filled.dtype) == ((3, 130), torch.bfloat16)
    assert (counted.shape, counted.dtype) == ((77,), torch.int32)


def _metadata(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [(tuple(o.shape), o.dtype, o.stride()) for o in outs]


@pytest.mark.parametrize("name", sorted(set(tt.KERNELS) - set(tt.FACTORIES)))
def test_each_tpu_kernel_on_meta_tensors_gives_what_the_ops_fake_promises(recorded, name):
    calls = [(args, kwargs) for n, args, kwargs in recorded.kernel_calls if n == name]
    for args, kwargs in calls[:3]:
        args = tuple(_meta(a) for a in args)
        expected = _metadata(getattr(torch.ops.pallas, name).default(*args, **kwargs))
        with tt.building_for(tt._Chip("TPU v5 lite")):
            got = _metadata(tt.KERNELS[name](*args, **kwargs))
        assert got == expected, f"{name}: the tpu kernel gives {got}, the op's fake {expected}"


# --- fake privateuseone tensors ----------------------------------------------------------

def _fake_tpu(mode, t: torch.Tensor):
    from torch._subclasses.fake_tensor import FakeTensor

    meta = t if t.device.type == "meta" else t.to("meta")
    return FakeTensor(mode, meta, torch.device(tt.device_type(), 0))


def _model(x, w_up, w_gate, w_down, norm, q, k, v, cos, sin):
    h = torch_pallas.rms_norm(x, (x.shape[-1],), norm)
    h = torch_pallas.swiglu(torch_pallas.matmul(h, w_gate), torch_pallas.matmul(h, w_up))
    h = torch_pallas.add(torch_pallas.matmul(h, w_down), x)
    q, k = torch_pallas.rotary_embedding(q, k, cos, sin)
    a = torch_pallas.attention(q, k, v, is_causal=True, enable_gqa=True)
    return h, a


def _model_inputs():
    return (_r(2, 9, 64), _r(64, 96), _r(64, 96), _r(96, 64), _r(64), _r(2, 4, 9, 16),
            _r(2, 2, 9, 16), _r(2, 2, 9, 16), _r(2, 9, 16), _r(2, 9, 16))


def test_make_fx_and_compile_on_fake_tpu_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    mode = FakeTensorMode()
    inputs = [_fake_tpu(mode, t) for t in _model_inputs()]
    with mode:
        graph = make_fx(_model)(*inputs)
        expected = _model(*inputs)
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"pallas.matmul.default", "pallas.swiglu.default", "pallas.add.default",
            "pallas.rms_norm_forward.default", "pallas.rotary_embedding.default",
            "pallas.attention_forward.default"} <= targets
    compiled = torch.compile(_model, backend="eager", fullgraph=True)
    with mode:
        got = compiled(*inputs)
    for g, e in zip(got, expected, strict=True):
        assert g.device.type == tt.device_type() and g.shape == e.shape and g.dtype == e.dtype
    # the backward ops' fakes on fake tpu tensors (autograd itself cannot run
    # here: see the module's docstring)
    q, k, v = inputs[5:8]
    with mode:
        out, lse = torch.ops.pallas.attention_forward(q, k.repeat_interleave(2, 1),
                                                      v.repeat_interleave(2, 1), None, 0.25,
                                                      True)
        grads = torch.ops.pallas.attention_backward(q, q, q, out, out, lse, None, 0.25, True)
    assert [g.shape for g in grads] == [q.shape] * 3
    assert all(g.device.type == tt.device_type() for g in grads)


def test_a_transformers_model_on_fake_tpu_tensors_reaches_the_ops():
    """A tiny Mixtral with attn_implementation and experts_implementation
    "pallas", after apply(), moved to fake tpu tensors: its forward's graph
    holds the ops (no CPU-only path, no value read back)."""
    import transformers  # the test extra's
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch_pallas.transformers
    from torch_pallas.transformers import experts

    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, intermediate_size=40,
        num_local_experts=6, num_experts_per_tok=2)
    torch_pallas.transformers.register()  # "pallas" for attn_ and experts_implementation
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="pallas", experts_implementation="pallas")
    torch_pallas.transformers.apply(model)
    for m in model.modules():  # the experts' activation check runs once on CPU values
        if isinstance(getattr(m, "act_fn", None), torch.nn.Module):
            experts._is_silu(type(m.act_fn))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(tt.device_type(), 0)
    with mode:
        model = model.to(device)
        ids = torch.randint(0, 97, (2, 9)).to(device)
        graph = make_fx(lambda i: model(input_ids=i).logits)(ids)
        logits = model(input_ids=ids).logits
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {f"pallas.{op}.default" for op in ("attention_forward", "grouped_mm", "swiglu",
                                               "matmul", "rms_norm_forward",
                                               "rotary_embedding")} <= targets
    assert logits.device.type == tt.device_type() and logits.shape == (2, 9, 97)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gpt_oss", "mixtral"])
def test_a_padded_batch_on_the_tpu_kernels_matches_the_eager_model(tpu_kernels_on_cpu, family):
    """A padded batch (left, right and both sides) through the `tpu`
    kernels (their jax_ops' JAX functions run on this machine): logits at
    real tokens, the loss and every gradient equal those of the same model
    on attn_implementation="eager"; the attention's jax_op takes packed
    sequences, never a dense mask."""
    from padded_models import (MODEL_PADDING, TOKENS, VOCAB, compare, gradients, model_pair,
                               train_step)

    reference, ours = model_pair(family)
    ids = torch.randint(3, VOCAB, (3, TOKENS))
    logits, loss = train_step(reference, ids, MODEL_PADDING)
    loss.backward()
    expected = (logits.detach(), loss.detach(), gradients(reference), MODEL_PADDING.bool())
    logits, loss = train_step(ours, ids, MODEL_PADDING)
    loss.backward()
    compare(family, logits.detach(), loss.detach(), gradients(ours), expected)
    attention = [args for name, args in tpu_kernels_on_cpu.calls if name == "attention_forward"]
    assert attention and all(args[4] is not None for args in attention)  # cu_seq_q


def test_a_padded_model_on_fake_tpu_tensors_builds_no_dense_mask():
    """A tiny Gemma 2 (window, softcap) on fake tpu tensors with a padded
    batch's attention_mask: the forward's graph reaches the attention op
    with packed sequences (five a batch row), and no op makes a tokens x
    tokens tensor (transformers' SDPA mask), nor reads a value back."""
    import transformers  # the test extra's
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    import torch_pallas.transformers

    tokens = 11
    config = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, intermediate_size=40,
        sliding_window=4, attn_logit_softcapping=7.0, final_logit_softcapping=None)
    torch_pallas.transformers.register()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="pallas")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device(tt.device_type(), 0)
    with mode:
        model = model.to(device)
        ids = torch.randint(0, 97, (2, tokens)).to(device)
        mask = torch.ones(2, tokens, dtype=torch.long).to(device)
        graph = make_fx(lambda i, m: model(input_ids=i, attention_mask=m, use_cache=False).logits)(
            ids, mask)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    attention = [n for n in calls if str(n.target) == "pallas.attention_forward.default"]
    assert len(attention) == config.num_hidden_layers
    for node in attention:
        mask_arg, cu_seq_q = node.args[3], node.args[12]
        assert mask_arg is None and cu_seq_q.meta["val"].shape == (5 * 2 + 1,)
    squares = [(str(n.target), tuple(n.meta["val"].shape)) for n in calls
               if isinstance(n.meta.get("val"), torch.Tensor)
               and list(n.meta["val"].shape).count(tokens) >= 2]
    assert not squares, squares[:3]


def test_symbolic_shapes_on_fake_tpu_tensors():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def symbolic(t):
        meta = mode.from_tensor(t.to("meta"), symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim()))
        return FakeTensor(mode, meta, torch.device(tt.device_type(), 0))

    x, w, g, u = (symbolic(t) for t in (_r(13, 40), _r(40, 24), _r(13, 24), _r(13, 24)))
    with mode:
        y = torch_pallas.matmul(x, w)
        s = torch_pallas.swiglu(g, u)
        n = torch_pallas.rms_norm(x, (x.shape[-1],))
    assert isinstance(y.shape[0], torch.SymInt) and y.device.type == tt.device_type()
    assert [d.node.expr for d in y.shape] == [x.shape[0].node.expr, w.shape[1].node.expr]
    assert s.shape == g.shape and n.shape == x.shape


# --- each jax_op compiled for a v5e, compile-only ------------------------------------------

LIBTPU_ENV = {"JAX_PLATFORMS": "cpu", "TPU_SKIP_MDS_QUERY": "1",
              "TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
              "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def compile_for_v5e() -> dict:
    """Each distinct jax_op call of the cases exported for the TPU as
    torch_tpu exports it (jax.export, platforms=["tpu"], the `tpu`
    backend's kernels for an abstract v5e) and the export compiled for that
    v5e by libtpu: {"device_kind", "results": [{name, call, mosaic,
    error}]}."""
    import jax
    from jax.experimental import topologies

    from torch_pallas.base import dtypes

    device = topologies.get_topology_desc(
        topology_name="v5e:1x1", platform="tpu", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False)).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    results, seen = [], set()
    for name, args in record_calls().calls:
        static = _static(args)
        specs = [jax.ShapeDtypeStruct(tuple(a.shape), dtypes.jax_name(a.dtype), sharding=sharding)
                 if isinstance(a, torch.Tensor) else _to_jax(a) for a in args]
        describe = f"{name}({', '.join(map(str, specs))})"
        if describe in seen:
            continue
        seen.add(describe)
        row = {"name": name, "call": describe, "mosaic": False, "error": None}
        try:
            with tt.building_for(device):
                function = jax.jit(tt.jax_functions()[name], static_argnums=static)
                exported = jax.export.export(function, platforms=["tpu"])(*specs)
                row["mosaic"] = "tpu_custom_call" in exported.mlir_module()
                arrays = [s for i, s in enumerate(specs) if i not in static]
                jax.jit(exported.call).lower(*arrays).compile()
        except Exception as e:  # noqa: BLE001  (reported per call)
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        results.append(row)
    return {"device_kind": device.device_kind, "results": results}


def test_each_jax_op_export_compiles_for_a_v5e():
    if sys.platform != "linux":
        pytest.skip("libtpu (the TPU compiler) ships for Linux only")
    env = {**os.environ, **LIBTPU_ENV, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile-v5e"], env=env,
                          capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["device_kind"] == "TPU v5 lite"
    results = report["results"]
    assert {r["name"] for r in results} == set(tt.KERNELS)
    failed = [f"  {r['call']}: {r['error']}" for r in results if r["error"]]
    assert not failed, "exports that do not compile for a v5e:\n" + "\n".join(failed)
    # fill and iota may lower to no kernel only if their kernels are Pallas's: all are
    not_mosaic = [r["call"] for r in results if not r["mosaic"]]
    assert not not_mosaic, f"exports without a Mosaic kernel (the interpreter's?): {not_mosaic}"


if __name__ == "__main__" and "--compile-v5e" in sys.argv:
    # stdout carries the JSON alone
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    json.dump(compile_for_v5e(), stdout)
    stdout.write("\n")
    stdout.flush()
