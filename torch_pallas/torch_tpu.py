"""torch_pallas's ops on torch_tpu's `tpu` tensors: the one module that
knows torch_tpu (PyPI `torch-tpu`, 0.2.0: a native TPU device for torch
2.11-2.15, whose Pallas interop is marked experimental).

What torch_tpu 0.2.0 exposes, read from its sources:

- it loads itself on `import torch`, through torch's `torch.backends`
  entry point (`torch_tpu._loader:load`), and installs the public module
  `torch.tpu` (with `torch.tpu.pallas.jax_op`) whether or not a chip is
  there; PrivateUse1 is renamed "tpu" only where a chip is (elsewhere it
  stays "privateuseone"). There is no `torch.backends.tpu`: `loaded()`
  looks for the imported `torch_tpu` and its `torch.tpu` module;
- `torch.tpu.pallas.jax_op("ns::name")(fn)` turns a JAX function with
  annotated parameters into a `torch.library` custom op: the schema from
  the annotations (every non-array parameter static), the kernel a
  `jax.export(..., platforms=["tpu"])` of the function run by torch_tpu's
  runtime, a fake kernel from the same export (which refuses symbolic
  dimensions), and no autograd.

`register()` gives every `pallas::` op with a device kernel a PrivateUse1
(`tpu`) kernel that calls the op's JAX-side form (torch_pallas.jax, the
same Pallas kernels, built for the TPU by Mosaic) through such a jax_op
(`torch.ops.pallas_tpu.<name>`). The `pallas::` ops keep their own schemas,
fakes (symbolic shapes too) and autograd, so `torch.ops.pallas.*`,
`torch_pallas.nn`, transformers' `attn_implementation="pallas"`,
`experts_implementation="pallas"` and `torch_pallas.transformers.apply()`
reach the TPU kernels on `tpu` tensors, eagerly and under `torch.compile`
(the ops stay opaque calls in the graph, which torch_tpu's backend runs
through their `tpu` kernels). The composites (`attention`,
`varlen_attention`, `rms_norm`, `layer_norm`, `linear_cross_entropy`,
`token_log_probs`)
need no kernel of their own: they call the others.

`import torch_pallas` registers the `tpu` kernels where torch_tpu is loaded
(and warns, instead of failing, where that goes wrong), importing no JAX:
the jax_ops are defined at the first `tpu` kernel's call. Where torch_tpu
is not loaded it imports nothing of torch_tpu or JAX. `register()` does
both at once, and raises ImportError saying why where torch_tpu is not
there.

What the JAX-side forms do not take is refused on `tpu` tensors with the
op, the argument and its value (NotImplementedError): attention's dense
mask and dropout, grouped_mm's 2-D x 2-D and 3-D x 2-D forms. Values that
the CPU ops check on the host (grouped_mm's offs, the loss's targets,
packed attention's cu_seq) are not read back from the chip here, as
torch_pallas.jax does not under jax.jit.

Imports: `torch_pallas.jax` and the op files (their checks, fakes and
torch-side helpers) inside `register`; torch_tpu and JAX only there.
"""

import functools
import importlib.metadata
import math
import sys
import warnings

import torch

from torch_pallas.base import torch_compat

DISTRIBUTION = "torch-tpu"
NAMESPACE = "pallas_tpu"  # torch.ops.pallas_tpu.<name>: the jax_op ops

_state = {"registered": False, "library": None}


# --- detection ---------------------------------------------------------------------

def version() -> str | None:
    """The installed torch-tpu's version, or None."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def loaded() -> bool:
    """Whether torch_tpu is loaded in this process (torch's backend entry
    point imports it on `import torch`) with its public `torch.tpu` module.
    Imports nothing."""
    return "torch_tpu" in sys.modules and getattr(torch, "tpu", None) is not None


def device_type() -> str:
    """The PrivateUse1 device's name: "tpu" once torch_tpu found a chip,
    "privateuseone" where it did not."""
    return torch_compat.privateuse1_name("tpu")


def _jax_op():
    """torch_tpu's `torch.tpu.pallas.jax_op` (its import brings JAX)."""
    return torch.tpu.pallas.jax_op


class _Chip:
    """What the kernels are built for: a TPU's device kind (JAX's name for
    it, "TPU v5 lite") and its TensorCores."""

    def __init__(self, device_kind: str, num_cores: int = 1):
        self.device_kind, self.num_cores = device_kind, num_cores

    def __repr__(self):
        return f"_Chip({self.device_kind!r}, num_cores={self.num_cores})"


# torch_tpu's device names (read from the PCI ids, "TPU" when unknown) ->
# JAX's device kinds where JAX spells them otherwise.
_JAX_KINDS = {"TPU v7": "TPU7x"}


@functools.cache
def _runtime_chip():
    """The chip torch_tpu runs on, by `torch.tpu.get_device_name()` ("TPU
    v5e"; experimental in 0.2.0), one TensorCore a device; None where it
    names no chip generation (the kernels then take their defaults)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its "experimental" warning
            name = str(torch.tpu.get_device_name())
    except Exception:  # an API that moved
        return None
    if name == "TPU" or not name.startswith("TPU"):
        return None
    return _Chip(_JAX_KINDS.get(name, name))


def building_for(chip=None):
    """The context in which the JAX-side forms build the `tpu` backend's
    kernels for `chip` (see torch_pallas.jax.calls.building_for_tpu):
    by default the chip of a context already open, else torch_tpu's."""
    import contextlib

    from torch_pallas.jax import calls

    if chip is None and calls.building():
        return contextlib.nullcontext()
    return calls.building_for_tpu(_runtime_chip() if chip is None else chip)


def _refuse(op: str, problem: str):
    raise NotImplementedError(f"{op}: on {device_type()} tensors (torch_tpu) {problem}")


# --- the JAX functions torch_tpu exports: one jax_op each --------------------------

@functools.cache
def jax_functions() -> dict:
    """name -> the annotated JAX function registered as
    `pallas_tpu::<name>`: each op's kernel computation in the JAX-side
    form, building the `tpu` backend's kernels. Imports JAX (annotations
    are evaluated here, where `jax` is bound)."""
    import importlib

    import jax
    import jax.numpy as jnp

    import torch_pallas.jax as forms
    from torch_pallas.jax import calls
    from torch_pallas.jax import ops as jops

    # (the package's own names `attention` and `linear_cross_entropy` are
    # the public functions: the modules by their full names)
    attn = importlib.import_module("torch_pallas.jax.attention")
    lce = importlib.import_module("torch_pallas.jax.linear_cross_entropy")
    tlp = importlib.import_module("torch_pallas.jax.token_log_probs")

    Array = jax.Array
    MaybeArray = jax.Array | None

    def tpu_kernels(fn):
        """fn traced with the `tpu` backend's kernels, for the chip of the
        context the call comes from (or of unknown kind)."""
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if calls.building():
                return fn(*args, **kwargs)
            with calls.building_for_tpu(None):
                return fn(*args, **kwargs)
        return traced

    def empty(dtype):
        return jnp.zeros((0,), dtype)

    @tpu_kernels
    def add(x: Array, y: Array) -> Array:
        return forms.add(x, y)

    @tpu_kernels
    def fill(size: list[int], value: int | float | bool, dtype: torch.dtype) -> Array:
        return forms.fill(tuple(size), value, dtype)

    @tpu_kernels
    def iota(n: int, dtype: torch.dtype) -> Array:
        return forms.iota(n, dtype)

    @tpu_kernels
    def matmul(a: Array, b: Array) -> Array:
        return forms.matmul(a, b)

    @tpu_kernels
    def grouped_mm(lhs: Array, rhs: Array, group_ends: Array, bias: MaybeArray,
                   out_dtype: torch.dtype) -> Array:
        return forms.grouped_mm(lhs, rhs, group_ends, bias, out_dtype=out_dtype)

    @tpu_kernels
    def grouped_mm_backward(dy: Array, lhs: Array, rhs: Array, group_ends: Array,
                            want_lhs: bool, want_rhs: bool) -> tuple[Array, Array]:
        """(d_lhs (M, K), d_rhs (G, K, N)) of the rows form, empty where not
        wanted; dy in lhs's dtype."""
        dtype = jnp.dtype(lhs.dtype).name
        ends = group_ends.astype(jnp.int32)
        d_lhs = (calls.run("grouped_mm", dy, rhs, ends, transpose_rhs=True, out_dtype=dtype)
                 if want_lhs else empty(lhs.dtype))
        d_rhs = (calls.run("grouped_mm_backward", lhs, dy, ends, out_dtype=dtype)
                 if want_rhs else empty(rhs.dtype))
        return d_lhs, d_rhs

    @tpu_kernels
    def rms_norm_forward(x: Array, weight: MaybeArray, eps: float,
                         casting_mode: str) -> tuple[Array, Array]:
        return jops.rms_norm_forward(x, weight, eps, jops.CASTINGS[casting_mode])

    @tpu_kernels
    def rms_norm_backward(grad_out: Array, x: Array, rstd: Array, weight: MaybeArray,
                          casting_mode: str) -> tuple[Array, Array]:
        return jops.rms_norm_backward(grad_out, x, rstd, weight, jops.CASTINGS[casting_mode])

    @tpu_kernels
    def layer_norm_forward(x: Array, weight: Array, bias: Array,
                           eps: float) -> tuple[Array, Array, Array]:
        return jops.layer_norm_forward(x, weight, bias, eps)

    @tpu_kernels
    def layer_norm_backward(grad_out: Array, x: Array, mean: Array, rstd: Array,
                            weight: Array) -> tuple[Array, Array, Array]:
        return jops.layer_norm_backward(grad_out, x, mean, rstd, weight)

    @tpu_kernels
    def swiglu(gate: Array, up: Array) -> Array:
        return forms.swiglu(gate, up)

    @tpu_kernels
    def swiglu_backward(grad_out: Array, gate: Array, up: Array) -> tuple[Array, Array]:
        return tuple(calls.run("swiglu_backward", grad_out, gate, up))

    @tpu_kernels
    def rotary_embedding(q: Array, k: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """q, k (N1, H, N2, D); cos, sin (N1, N2, D)."""
        return forms.rotary_embedding(q, k, cos, sin)

    @tpu_kernels
    def rotary_embedding_backward(grad_q: Array, grad_k: Array, cos: Array,
                                  sin: Array) -> tuple[Array, Array]:
        return tuple(calls.run("rotary_embedding_backward", grad_q, grad_k, cos, sin))

    @tpu_kernels
    def attention_forward(q: Array, k: Array, v: Array, sinks: MaybeArray,
                          cu_seq_q: MaybeArray, cu_seq_k: MaybeArray, scale: float,
                          is_causal: bool, window_left: int, window_right: int,
                          softcap: float) -> tuple[Array, Array]:
        static = attn.Static(scale, is_causal, window_left, window_right, softcap)
        return attn.attention_forward(q, k, v, sinks, cu_seq_q, cu_seq_k, static)

    @tpu_kernels
    def attention_backward(q: Array, k: Array, v: Array, out: Array, grad_out: Array,
                           lse: Array, cu_seq_q: MaybeArray, cu_seq_k: MaybeArray,
                           scale: float, is_causal: bool, window_left: int, window_right: int,
                           softcap: float) -> tuple[Array, Array, Array]:
        static = attn.Static(scale, is_causal, window_left, window_right, softcap)
        return attn.attention_backward(q, k, v, out, grad_out, lse, cu_seq_q, cu_seq_k, static)

    def _loss_gradients(saved, smoothing, softcap, row_grad, wants, bias):
        d_x, d_w, d_b, _ = lce._loss_rows_backward(smoothing, softcap, saved, row_grad)
        x, weight = saved[0], saved[1]
        return (d_x if wants[0] else empty(x.dtype), d_w if wants[1] else empty(weight.dtype),
                d_b if wants[2] and bias is not None else empty(weight.dtype))

    @tpu_kernels
    def linear_cross_entropy_forward(input: Array, weight: Array, targets: Array,
                                     bias: MaybeArray, reduction: str, label_smoothing: float,
                                     softcap: float, want_input: bool, want_weight: bool,
                                     want_bias: bool
                                     ) -> tuple[Array, Array, Array, Array, Array]:
        """pallas::linear_cross_entropy_forward on rows, `targets` int32
        with -1 for an ignored row: (loss, lse, and for "mean" and "sum" the
        gradients asked for, of a loss gradient of 1; empty otherwise)."""
        loss_rows, saved = lce._loss_rows_forward(input, weight, bias, targets,
                                                  label_smoothing, softcap)
        valid = (targets >= 0).sum()
        if reduction == "none":
            loss = loss_rows
        else:
            loss = loss_rows.sum()
            loss = loss / valid if reduction == "mean" else loss
        wants = (want_input, want_weight, want_bias)
        if reduction == "none" or not any(wants):
            grads = (empty(input.dtype), empty(weight.dtype), empty(weight.dtype))
        else:
            one = jnp.float32(1.0)
            row_grad = jnp.broadcast_to(one / valid if reduction == "mean" else one,
                                        targets.shape)
            grads = _loss_gradients(saved, label_smoothing, softcap, row_grad, wants, bias)
        return (loss, saved[4], *grads)

    @tpu_kernels
    def linear_cross_entropy_backward(grad_loss: Array, input: Array, weight: Array,
                                      targets: Array, bias: MaybeArray, lse: Array,
                                      reduction: str, label_smoothing: float, softcap: float,
                                      want_input: bool, want_weight: bool,
                                      want_bias: bool) -> tuple[Array, Array, Array]:
        grad = grad_loss.astype(jnp.float32)
        if reduction == "none":
            row_grad = grad.reshape(-1)
        else:
            scale = grad / (targets >= 0).sum() if reduction == "mean" else grad
            row_grad = jnp.broadcast_to(scale, targets.shape)
        saved = (input, weight, bias, targets, lse)
        return _loss_gradients(saved, label_smoothing, softcap, row_grad,
                               (want_input, want_weight, want_bias), bias)

    def _no_class(input, weight):
        # targets that match no column and are not ignored: each row's loss
        # is its log-sum-exp, its logits' gradient the softmax
        return jnp.full((input.shape[0],), weight.shape[0], jnp.int32)

    @tpu_kernels
    def linear_logsumexp(input: Array, weight: Array, bias: MaybeArray,
                         softcap: float) -> Array:
        _, saved = lce._loss_rows_forward(input, weight, bias, _no_class(input, weight), 0.0,
                                          softcap)
        return saved[4]

    @tpu_kernels
    def linear_logsumexp_backward(grad: Array, input: Array, weight: Array, bias: MaybeArray,
                                  lse: Array, softcap: float, want_input: bool,
                                  want_weight: bool, want_bias: bool
                                  ) -> tuple[Array, Array, Array]:
        saved = (input, weight, bias, _no_class(input, weight), lse)
        return _loss_gradients(saved, 0.0, softcap, grad.astype(jnp.float32),
                               (want_input, want_weight, want_bias), bias)

    @tpu_kernels
    def token_log_probs_forward(input: Array, weight: Array, targets: Array, bias: MaybeArray,
                                temperature: float, softcap: float
                                ) -> tuple[Array, Array, Array]:
        """pallas::token_log_probs_forward on rows, `targets` int32 with -1
        for an ignored row: (log_prob, entropy, lse)."""
        (log_prob, entropy), saved = tlp._rows_forward(input, weight, bias, targets,
                                                       temperature, softcap)
        return log_prob, entropy, saved[4]

    @tpu_kernels
    def token_log_probs_backward(grad_log_prob: Array, grad_entropy: Array, input: Array,
                                 weight: Array, targets: Array, bias: MaybeArray, lse: Array,
                                 entropy: Array, temperature: float, softcap: float,
                                 want_input: bool, want_weight: bool, want_bias: bool
                                 ) -> tuple[Array, Array, Array]:
        saved = (input, weight, bias, targets, lse, entropy)
        d_x, d_w, d_b, _ = tlp._rows_backward(temperature, softcap, saved,
                                              (grad_log_prob, grad_entropy))
        return (d_x if want_input else empty(input.dtype),
                d_w if want_weight else empty(weight.dtype),
                d_b if want_bias and bias is not None else empty(weight.dtype))

    return {f.__name__: f for f in (
        add, fill, iota, matmul, grouped_mm, grouped_mm_backward, rms_norm_forward,
        rms_norm_backward, layer_norm_forward, layer_norm_backward, swiglu, swiglu_backward,
        rotary_embedding, rotary_embedding_backward, attention_forward, attention_backward,
        linear_cross_entropy_forward, linear_cross_entropy_backward, linear_logsumexp,
        linear_logsumexp_backward, token_log_probs_forward, token_log_probs_backward)}


def _op(name: str):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _call(name: str, *args):
    """The jax_op `pallas_tpu::<name>` on torch_tpu's chip (its export
    lowered there, for that chip)."""
    define_jax_ops()
    with building_for():
        return _op(name)(*args)


# --- the pallas:: ops' tpu kernels, in the ops' signatures --------------------------

def _add(x, y):
    return _call("add", x, y)


def _fill(size, value, *, dtype=None, device=None):
    from torch_pallas.base import dtypes
    from torch_pallas.ops import fill as fill_op

    dtype = fill_op.result_dtype(value, dtype)
    value = fill_op.kernel_value(value, dtype)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if math.prod(size) == 0:
        return torch.empty(tuple(size), dtype=dtype, device=device)
    kernel_dtype = dtypes.COMPUTED_IN_32_BITS.get(dtype, dtype)
    out = _call("fill", list(size), value, kernel_dtype)
    return out if kernel_dtype == dtype else out.to(dtype)


def _iota(n, *, dtype=None, device=None):
    from torch_pallas.base import dtypes
    from torch_pallas.ops import iota as iota_op

    dtype = iota_op._check(n, dtype)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if n == 0:
        return torch.empty((0,), dtype=dtype, device=device)
    # 64-bit results: counted in int32 (exact below 2**31), widened after
    kernel_dtype = torch.int32 if dtype in dtypes.COMPUTED_IN_32_BITS else dtype
    out = _call("iota", int(n), kernel_dtype)
    return out if kernel_dtype == dtype else out.to(dtype)


def _matmul(a, b):
    return _call("matmul", a, b)


def _grouped_form(op: str, mat_a, mat_b, offs):
    from torch_pallas.ops import grouped_mm as gmm

    form = gmm._form(mat_a, mat_b)
    if form not in (gmm.Form.ROWS, gmm.Form.BATCHED):
        _refuse(op, f"mat_a {tuple(mat_a.shape)} and mat_b {tuple(mat_b.shape)} (the "
                f"{form.value} form, offs slicing "
                f"{'K' if form is gmm.Form.CONTRACTION else 'the columns'}) are not supported: "
                "the JAX-side form takes 2-D x 3-D with offs, or 3-D x 3-D without")
    if form is gmm.Form.ROWS:
        return form, offs.to(torch.int32)
    g, m, _ = mat_a.shape
    return form, torch.arange(1, g + 1, dtype=torch.int32, device=mat_a.device) * m


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    from torch_pallas.ops import grouped_mm as gmm

    op = "pallas::grouped_mm"
    _, groups, out_shape, dtype = gmm.check(mat_a, mat_b, offs, bias, out_dtype)
    form, ends = _grouped_form(op, mat_a, mat_b, offs)
    if math.prod(out_shape) == 0 or groups == 0 or mat_a.shape[-1] == 0:
        out = mat_a.new_zeros(out_shape, dtype=torch.float32)
        if bias is not None and form is gmm.Form.ROWS:
            out = gmm._bias_rows(out, offs, bias, torch.float32)
        elif bias is not None:
            out = out + bias.unsqueeze(1).float()
        return out.to(dtype)
    lhs = mat_a.reshape(-1, mat_a.shape[-1])
    return _call("grouped_mm", lhs, mat_b, ends, bias, dtype).reshape(out_shape)


def _grouped_mm_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask):
    from torch_pallas.ops import grouped_mm as gmm

    op = "pallas::grouped_mm_backward"
    form, groups, _ = gmm._check_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask)
    _, ends = _grouped_form(op, mat_a, mat_b, offs)
    want_a, want_b, want_bias = (bool(w) for w in output_mask)
    _, b_transposed = gmm._transposed_gradients(form, mat_b)
    dy = grad_out.to(mat_a.dtype)  # one rounding of a float32 output's gradient
    grad_a = grad_b = None
    if groups == 0 or mat_a.numel() == 0 or mat_b.numel() == 0 or dy.numel() == 0:
        grad_a = gmm._new(mat_a, False, True) if want_a else None
        grad_b = gmm._new(mat_b, b_transposed, True) if want_b else None
    elif want_a or want_b:
        rows_a = mat_a.reshape(-1, mat_a.shape[-1])
        d_a, d_b = _call("grouped_mm_backward", dy.reshape(-1, dy.shape[-1]), rows_a, mat_b,
                         ends, want_a, want_b)
        grad_a = d_a.reshape(mat_a.shape) if want_a else None
        # laid out as the CPU op's (and the fake's): weights stored (G, N, K)
        # get their gradient as the transposed view of a (G, N, K) one
        grad_b = (d_b.mT.contiguous().mT if b_transposed else d_b) if want_b else None
    grad_bias = None
    if want_bias and has_bias:
        grad_bias = gmm._group_sums(grad_out.reshape(-1, grad_out.shape[-1]), ends, groups)
    return gmm._filled(grad_a, grad_b, grad_bias, mat_a, mat_b)


def _rms_norm_forward(x, weight, eps, casting_mode="none"):
    from torch_pallas.ops import rms_norm as rms

    rms.casting_of(rms.FORWARD_OP, casting_mode, weight)
    if x.numel() == 0:
        return rms._forward_fake(x, weight, eps, casting_mode)
    return _call("rms_norm_forward", x, weight, float(eps), casting_mode)


def _rms_norm_backward(grad_out, x, rstd, weight, casting_mode="none"):
    from torch_pallas.ops import rms_norm as rms

    rms.casting_of(rms.BACKWARD_OP, casting_mode, weight)
    if x.numel() == 0:
        dx, dw = rms._backward_fake(grad_out, x, rstd, weight, casting_mode)
        return dx, dw.zero_()
    return _call("rms_norm_backward", grad_out, x, rstd, weight, casting_mode)


def _layer_norm_forward(x, weight, bias, eps):
    from torch_pallas.ops import layer_norm as ln

    if x.numel() == 0:
        return ln._forward_fake(x, weight, bias, eps)
    return _call("layer_norm_forward", x, weight, bias, float(eps))


def _layer_norm_backward(grad_out, x, mean, rstd, weight):
    from torch_pallas.ops import layer_norm as ln

    if x.numel() == 0:
        dx, dw, db = ln._backward_fake(grad_out, x, mean, rstd, weight)
        return dx, dw.zero_(), db.zero_()
    return _call("layer_norm_backward", grad_out, x, mean, rstd, weight)


def _swiglu(gate, up):
    from torch_pallas.ops import swiglu as sw

    sw._check(gate, up)
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return _call("swiglu", gate, up)


def _swiglu_backward(grad_out, gate, up):
    from torch_pallas.ops import swiglu as sw

    sw._check(gate, up)
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    return _call("swiglu_backward", grad_out, gate, up)


def _rotate(name: str, op: str, names, x, y, cos, sin, unsqueeze_dim):
    """ops/rotary_embedding.py's layout plan around the jax_op: x and y as
    (N1, H, N2, D), the angles as (N1, N2, D), the results laid out as the
    CPU op's."""
    from torch_pallas.ops import rotary_embedding as rope

    plan = rope._plan(op, names, x, y, cos, sin, unsqueeze_dim)
    dtype = torch.promote_types(x.dtype, cos.dtype)
    if x.numel() == 0 and y.numel() == 0:
        return x.new_empty(x.shape, dtype=dtype), y.new_empty(y.shape, dtype=dtype)
    xs = (x if x.numel() else y, y if y.numel() else x)  # the kernels need heads on both sides
    outs = _call(name, *(plan.operand(t) for t in xs), plan.angles(cos, x.shape),
                 plan.angles(sin, x.shape))
    return tuple(plan.result(o, t.shape) if t.numel() else t.new_empty(t.shape, dtype=dtype)
                 for o, t in zip(outs, (x, y)))


def _rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    return _rotate("rotary_embedding", "pallas::rotary_embedding", ("q", "k"), q, k, cos, sin,
                   unsqueeze_dim)


def _rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim=1, q=None, k=None):
    from torch_pallas.ops import rotary_embedding as rope

    rope._check_inputs(grad_q, grad_k, q, k)
    dq, dk = _rotate("rotary_embedding_backward", rope.BACKWARD_OP, ("grad_q", "grad_k"),
                     grad_q, grad_k, cos, sin, unsqueeze_dim)
    if q is None:
        return dq, dk, cos.new_empty((0,)), sin.new_empty((0,))
    return dq, dk, *rope.angle_gradients(grad_q, grad_k, q, k, cos, unsqueeze_dim)


def _attention_refusals(op: str, mask, dropout_p):
    from torch_pallas.ops import attention_spans

    if mask is not None:
        _refuse(op, f"mask (a {tuple(mask.shape)} tensor) is not supported: the kernels' dense "
                "mask has no JAX-side form (is_causal, window_size and packed sequences have; "
                f"{attention_spans.PADDING_SERVED})")
    if dropout_p:
        _refuse(op, f"dropout_p={dropout_p} is not supported (only 0)")


def _int32(t):
    return None if t is None else t.to(torch.int32)


def _attention_forward(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=None,
                       window_left=-1, window_right=-1, softcap=0.0, sinks=None, cu_seq_q=None,
                       cu_seq_k=None, max_q=0, max_k=0):
    from torch_pallas.ops import attention as attention_op

    _attention_refusals("pallas::attention_forward", mask, dropout_p)
    if q.shape[:3].numel() * v.shape[-1] == 0 or k.shape[2] == 0:
        out, lse = attention_op._forward_fake(q, k, v, mask, scale, is_causal)
        if k.shape[2] == 0:  # no keys: every row sees nothing
            out.zero_()
        lse.fill_(float("inf"))
        return (out, lse) if sinks is None else attention_op._with_sinks(out, lse, sinks)
    return _call("attention_forward", q, k, v, sinks, _int32(cu_seq_q), _int32(cu_seq_k),
                 float(scale), bool(is_causal), int(window_left), int(window_right),
                 float(softcap))


def _attention_backward(q, k, v, out, grad_out, lse, mask, scale, is_causal, dropout_p=0.0,
                        seed=None, window_left=-1, window_right=-1, softcap=0.0, cu_seq_q=None,
                        cu_seq_k=None):
    _attention_refusals("pallas::attention_backward", mask, dropout_p)
    if grad_out.dtype != q.dtype:
        raise TypeError(f"pallas::attention_backward: grad_out has dtype {grad_out.dtype}, "
                        f"q {q.dtype}; they must be the same")
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or out.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    return _call("attention_backward", q, k, v, out, grad_out, lse, _int32(cu_seq_q),
                 _int32(cu_seq_k), float(scale), bool(is_causal), int(window_left),
                 int(window_right), float(softcap))


def _targets(target, ignore_index: int):
    """The kernels' targets: int32, -1 for an ignored row (not checked
    against the vocabulary: that would read them back from the chip)."""
    return torch.where(target == ignore_index, -1, target).to(torch.int32)


def _written(grads, bias, reduction=None):
    from torch_pallas.ops import linear_cross_entropy as lce_op

    return lce_op._written(grads, bias, reduction)


def _linear_cross_entropy_forward(input, weight, target, bias, ignore_index, reduction,
                                  label_smoothing, softcap, grads):
    wants = _written(grads, bias, reduction)
    return _call("linear_cross_entropy_forward", input, weight, _targets(target, ignore_index),
                 bias, reduction, float(label_smoothing), float(softcap or 0.0), *wants)


def _linear_cross_entropy_backward(grad_loss, input, weight, target, bias, lse, ignore_index,
                                   reduction, label_smoothing, softcap, grads):
    return _call("linear_cross_entropy_backward", grad_loss, input, weight,
                 _targets(target, ignore_index), bias, lse, reduction, float(label_smoothing),
                 float(softcap or 0.0), *_written(grads, bias))


def _linear_logsumexp(input, weight, bias, softcap):
    from torch_pallas.ops import linear_cross_entropy as lce_op

    lce_op._check_rows(input, weight, bias, softcap)
    return _call("linear_logsumexp", input, weight, bias, float(softcap or 0.0))


def _linear_logsumexp_backward(grad, input, weight, bias, lse, softcap, grads):
    return _call("linear_logsumexp_backward", grad, input, weight, bias, lse,
                 float(softcap or 0.0), *_written(grads, bias))


def _log_prob_targets(target, ignore_index: int, vocab: int, other_shards: bool):
    from torch_pallas.ops import token_log_probs as tlp_op

    if other_shards:  # a vocabulary shard's: tokens past it are other shards'
        target = torch.where(target >= vocab, tlp_op.NO_CLASS, target)
    return _targets(target, ignore_index)


def _token_log_probs_forward(input, weight, target, bias, ignore_index, temperature, softcap,
                             other_shards=False):
    from torch_pallas.ops import token_log_probs as tlp_op

    if input.shape[0] == 0:  # no rows: no kernel (its grid would have no row block)
        return tlp_op._forward_fake(input, weight, target, bias, ignore_index, temperature,
                                    softcap)
    return _call("token_log_probs_forward", input, weight,
                 _log_prob_targets(target, ignore_index, weight.shape[0], other_shards), bias,
                 float(temperature), float(softcap or 0.0))


def _token_log_probs_backward(grad_log_prob, grad_entropy, input, weight, target, bias, lse,
                              entropy, ignore_index, temperature, softcap, grads,
                              other_shards=False):
    from torch_pallas.ops import token_log_probs as tlp_op

    if input.shape[0] == 0:  # no rows: no gradient
        return tuple(g.zero_() for g in tlp_op._backward_fake(
            grad_log_prob, grad_entropy, input, weight, target, bias, lse, entropy,
            ignore_index, temperature, softcap, grads))
    return _call("token_log_probs_backward", grad_log_prob, grad_entropy, input, weight,
                 _log_prob_targets(target, ignore_index, weight.shape[0], other_shards), bias,
                 lse, entropy, float(temperature), float(softcap or 0.0),
                 *_written(grads, bias))


# pallas:: op -> its tpu kernel. The composites (attention, varlen_attention,
# rms_norm, layer_norm, linear_cross_entropy, token_log_probs) call these ops.
KERNELS = {
    "add": _add, "fill": _fill, "iota": _iota, "matmul": _matmul,
    "grouped_mm": _grouped_mm, "grouped_mm_backward": _grouped_mm_backward,
    "rms_norm_forward": _rms_norm_forward, "rms_norm_backward": _rms_norm_backward,
    "layer_norm_forward": _layer_norm_forward, "layer_norm_backward": _layer_norm_backward,
    "swiglu": _swiglu, "swiglu_backward": _swiglu_backward,
    "rotary_embedding": _rotary_embedding, "rotary_embedding_backward": _rotary_embedding_backward,
    "attention_forward": _attention_forward, "attention_backward": _attention_backward,
    "linear_cross_entropy_forward": _linear_cross_entropy_forward,
    "linear_cross_entropy_backward": _linear_cross_entropy_backward,
    "token_log_probs_forward": _token_log_probs_forward,
    "token_log_probs_backward": _token_log_probs_backward,
    "linear_logsumexp": _linear_logsumexp, "linear_logsumexp_backward": _linear_logsumexp_backward,
}
FACTORIES = ("fill", "iota")  # no tensor argument: chosen by their device argument


def _by_device(op):
    """A BackendSelect kernel for factory op `op` (no tensor to dispatch
    on): the dispatch key of its `device` argument (the default device
    when None), as torch.library.custom_op's own factories get."""
    def select(keyset, *args, **kwargs):
        device = kwargs.get("device")
        device = torch.device(device) if device is not None else torch.get_default_device()
        return op.redispatch(torch_compat.device_key_set(device.type), *args, **kwargs)

    return select


def _check_loaded(where: str) -> None:
    """Raises ImportError saying why unless torch_tpu is loaded (importing
    it where it is installed but was not autoloaded)."""
    if loaded():
        return
    installed = version()
    try:
        import torch_tpu  # noqa: F401  (installs torch.tpu)
    except Exception as error:
        raise ImportError(
            f"{where}: torch_tpu does not import here ({DISTRIBUTION} "
            f"{installed or 'is not installed'}; torch {torch.__version__}): "
            f"{type(error).__name__}: {error}. pip install torch-tpu (with its libtpu), "
            "for torch 2.11-2.15 on Linux") from error
    if not loaded():
        raise ImportError(f"{where}: torch_tpu {installed} imported but did not install "
                          "torch.tpu (its Pallas interop, torch.tpu.pallas.jax_op, lives there)")


def _register_kernels() -> None:
    """The pallas:: ops' PrivateUse1 kernels (and the factories' device
    choice): plain Python, no JAX imported."""
    if _state["library"] is not None:
        return
    import torch_pallas.ops  # noqa: F401  (the pallas:: ops)

    library = torch.library.Library("pallas", "IMPL")
    for name, kernel in KERNELS.items():
        library.impl(name, kernel, "PrivateUse1")
    if torch_compat.available()["device_dispatch"]:  # else their CPU kernels refuse tpu
        for name in FACTORIES:
            library.impl(name, _by_device(getattr(torch.ops.pallas, name).default),
                         "BackendSelect", with_keyset=True)
    _state["library"] = library


def define_jax_ops() -> None:
    """Defines the `pallas_tpu::` jax_ops through torch_tpu's
    `torch.tpu.pallas.jax_op` (importing JAX): at the first tpu kernel's
    call, or in `register()`. Idempotent."""
    if _state["registered"]:
        return
    _check_loaded("torch_pallas.torch_tpu")
    try:
        jax_op = _jax_op()
    except Exception as error:
        raise ImportError(
            f"torch_pallas.torch_tpu: torch_tpu's torch.tpu.pallas.jax_op is not available: "
            f"{type(error).__name__}: {error}") from error
    with warnings.catch_warnings():  # jax_op's "experimental" warning, once per op
        warnings.simplefilter("ignore")
        for name, function in jax_functions().items():
            if not hasattr(getattr(torch.ops, NAMESPACE), name):
                jax_op(f"{NAMESPACE}::{name}")(function)
    _state["registered"] = True


def register() -> None:
    """Registers the PrivateUse1 (`tpu`) kernel of every `pallas::` op that
    has a device kernel and the `pallas_tpu::` jax_ops they call (see the
    module's docstring). Idempotent. Raises ImportError where torch_tpu is
    not installed or not loaded."""
    _check_loaded("torch_pallas.torch_tpu.register")
    _register_kernels()
    define_jax_ops()


def register_if_loaded() -> None:
    """Where torch_tpu is loaded (import torch_pallas calls this), the
    ops' `tpu` kernels, which define their jax_ops at their first call:
    nothing here imports JAX, as `import torch_pallas` never does. A
    failure warns, and torch_pallas imports as ever. Does nothing, importing
    nothing, where torch_tpu is not loaded."""
    if not loaded():
        return
    try:
        _register_kernels()
    except Exception as error:
        warnings.warn(f"torch_pallas: torch_tpu is loaded, but torch_pallas's ops could not be "
                      f"given tpu kernels: {type(error).__name__}: {error}", RuntimeWarning,
                      stacklevel=2)
