"""torch.ops.pallas.matmul(a, b): torch.matmul's semantics (1-D operands,
batches with broadcasting, empty dimensions), accumulated in float32, in
the operands' dtype.

The op reduces every call to one batched kernel call on 3-D operands
(batch, rows, cols) whose batch is 1 or the full batch:
- a's batch folds into its rows when b has none (`[B, T, K] @ [K, N]` is one
  (B*T, K) @ (K, N) product), without a copy;
- an operand whose last two dimensions are transposed (`w.t()`, `x.mT`) is
  passed as the contiguous tensor it views, with a transpose flag, so the
  kernel reads it in place;
- an operand broadcast along some batch dimensions but not all is
  materialised (one copy); so is one with any other layout.

float32 products follow torch's float32 matmul precision on CUDA: full
float32 by default, TF32 where torch allows it (`float32_precision`). The Hopper
kernel (mosaic_gpu) multiplies float32 only as TF32, so where torch asks
for full float32 an automatic mosaic_gpu choice runs the Triton kernel
instead, and an explicit one raises.
"""

from __future__ import annotations

import contextvars
import math

import torch

from torch_pallas.base import dtypes, torch_compat
from torch_pallas.runtime import bridge, compilation, launch, registry, shape_buckets
from torch_pallas.library import registration
from torch_pallas.ops import checks

OP = "pallas::matmul"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def output_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """torch.matmul's output shape, after checking everything a kernel
    relies on."""
    checks.tensor(OP, "a", a)
    checks.tensor(OP, "b", b)
    for name, t in (("a", a), ("b", b)):
        if t.dim() == 0:
            raise checks.RefusedLikeTorch(
                f"{OP}: {name} must have at least 1 dimension, got a 0-d tensor "
                f"({name}.shape=())"
            )
    checks.same_dtype(OP, a, b, names=("a", "b"))
    checks.dtype_in(OP, "a", a.dtype, DTYPES)
    checks.same_device(OP, a, b, names=("a", "b"))
    k_a = a.shape[-1]
    k_b = b.shape[-2] if b.dim() >= 2 else b.shape[0]
    checks.require(
        k_a == k_b,
        lambda: f"{OP}: inner dimensions differ: a.shape={tuple(a.shape)}, "
        f"b.shape={tuple(b.shape)} (a.shape[-1] must equal "
        f"{'b.shape[-2]' if b.dim() >= 2 else 'b.shape[0]'})",
    )
    batch = batch_shape(a, b)
    rows = (a.shape[-2],) if a.dim() >= 2 else ()
    cols = (b.shape[-1],) if b.dim() >= 2 else ()
    return (*batch, *rows, *cols)


def batch_shape(a: torch.Tensor, b: torch.Tensor):
    """The broadcast batch dimensions of a and b (those before the last two;
    1-D operands have none)."""
    a_batch, b_batch = a.shape[:-2], b.shape[:-2]
    if not b_batch:  # the common cases (x @ w, a weight without batch) cost nothing
        return a_batch
    if not a_batch:
        return b_batch
    try:
        return torch.broadcast_shapes(a_batch, b_batch)
    except RuntimeError:
        raise checks.RefusedLikeTorch(
            f"{OP}: batch dimensions of a.shape={tuple(a.shape)} and "
            f"b.shape={tuple(b.shape)} do not broadcast"
        ) from None


def as_kernel_operand(t: torch.Tensor, batch: tuple) -> tuple[torch.Tensor, bool]:
    """`t` (..., rows, cols) as a 3-D (1 or B, rows, cols) operand, or as the
    contiguous (1 or B, cols, rows) tensor it transposes, with that flag."""
    rows, cols = t.shape[-2:]
    if math.prod(t.shape[:-2]) == 1:
        t = t.reshape(1, rows, cols)
    elif tuple(t.shape[:-2]) == tuple(batch):
        t = t.reshape(-1, rows, cols)
    else:  # broadcast along some batch dimensions: materialised
        t = t.expand(*batch, rows, cols).reshape(-1, rows, cols)
    if t.is_contiguous():
        return t, False
    if t.mT.is_contiguous():
        return t.mT, True
    return t.contiguous(), False


def matmul_implementation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    key = _plan_key(a, b)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan.run(a, b)
    shape = output_shape(a, b)
    a2 = a if a.dim() >= 2 else a.unsqueeze(0)
    b2 = b if b.dim() >= 2 else b.unsqueeze(-1)
    if math.prod(shape) == 0:
        return a.new_empty(shape)
    k = a2.shape[-1]
    if k == 0:
        return a.new_zeros(shape)  # an empty sum
    batch = batch_shape(a2, b2)
    if b2.dim() == 2 and a2.dim() > 2:
        try:
            a2 = a2.view(-1, k)  # fold the batch into the rows
        except RuntimeError:
            pass  # a layout that does not fold: a batch of a's, one b
    a3, transpose_a = as_kernel_operand(a2, batch)
    b3, transpose_b = as_kernel_operand(b2, batch)
    params = {"transpose_a": transpose_a, "transpose_b": transpose_b}
    if a.dtype == torch.float32:
        params["precision"] = float32_precision()
    sizes = bucket_sizes(a3, b3, transpose_a, transpose_b, weights=(_is_weight(a), _is_weight(b)),
                         weight_shaped=_weight_gradient.get())
    plan = None if key is None else _Plan.of(a, b, a3, b3, sizes, params, shape)
    if plan is not None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return _run(pad_operands(a3, b3, transpose_a, transpose_b, sizes), sizes, params, shape)


def _run(operands, sizes, params, shape, call=None):
    """The kernel on `operands` (through `call`, a launch.bound call, where
    given), its padding sliced off, in the op's output shape."""
    (m, n, _), _ = sizes
    if call is None:
        out = launch.run("matmul", operands[0].device, operands, params)
    else:
        out = call(*operands)
    if out.shape[1:] != (m, n):
        out = out[:, :m, :n].contiguous()  # a copy only where the rows do not end it
    return out.reshape(shape)


# --- eager CPU calls: a plan per layout -----------------------------------
# What matmul_implementation works out before the kernel runs (the checks,
# the folded batch, the transposes, the buckets) follows from the operands'
# shapes, strides, dtypes and device alone, and a decode loop repeats a few
# layouts thousands of times: on the 2-core CPU the working out took 137 of
# the 356 us a (1 x 512) @ (512 x 1376) call spent in matmul_implementation.
# A plan keeps it per layout: the operands' kernel views (as_strided
# recipes, no tensors), the buckets, the parameters, and the kernel's call
# (launch.bound) while launch.binding_state() stays as it was. It is keyed by
# everything it follows from, the float32 precision setting, which operands
# are weights and the buckets' state included; CPU tensors only (not fake
# tensors or other subclasses, whose sizes may be symbolic).

MAX_PLANS = 1024
_PLANS: dict = {}
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plan_key(a, b):
    if type(a) not in _PLAIN or type(b) not in _PLAIN or a.device.type != "cpu":
        return None
    precision = float32_precision() if a.dtype == torch.float32 else None
    return (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype, b.device, precision,
            _is_weight(a), _is_weight(b), _weight_gradient.get(), shape_buckets.state())


class _Plan:
    __slots__ = ("views", "sizes", "params", "shape", "transposes", "padded", "call", "bound_in")

    @classmethod
    def of(cls, a, b, a3, b3, sizes, params, shape):
        """The plan of a call whose kernel operands a3 and b3 view a and b
        (None where either is a copy)."""
        views = []
        for t, t3 in ((a, a3), (b, b3)):
            if t3.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                return None
            views.append((tuple(t3.shape), t3.stride(), t3.storage_offset() - t.storage_offset()))
        plan = cls()
        plan.views, plan.sizes, plan.params, plan.shape = tuple(views), sizes, params, shape
        plan.transposes = (params["transpose_a"], params["transpose_b"])
        plan.padded = sizes[0] != sizes[1]
        plan.call = plan.bound_in = None
        return plan

    def run(self, a, b):
        (a_size, a_stride, a_offset), (b_size, b_stride, b_offset) = self.views
        a3 = a.as_strided(a_size, a_stride, a.storage_offset() + a_offset)
        b3 = b.as_strided(b_size, b_stride, b.storage_offset() + b_offset)
        if self.padded:
            operands = pad_operands(a3, b3, *self.transposes, self.sizes)
        else:
            operands = (a3, b3)
        state = launch.binding_state()
        if self.bound_in != state:
            self.call = launch.bound("matmul", a3.device, operands, self.params)
            self.bound_in = state
        if self.padded or self.call is None:
            return _run(operands, self.sizes, self.params, self.shape, self.call)
        return self.call(*operands).view(self.shape)  # the kernel's (1 or B, M, N), unpadded


# --- linear without gradients: a layer's product in one step ---------------
# A decode step is a stream of small no-grad linear calls, and on the 2-core
# CPU their Python cost more than their products: a (1 x 256) @ (256 x 256)
# call interleaved with a model's other layers spent ~70 us on the way from
# the layer to its kernel (the weight's transpose, the direct call's checks,
# the plan's key, two as_strided views, the argument makers) against ~50 us
# in the kernel and its crossings. A call that runs directly
# (registration.runs_directly) and whose layout has an unpadded plan takes
# one step: its key (the plan's, read off input and weight), the NumPy
# views of both, the kernel, the export.


def linear_product(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`input @ weight.T`, linear's product: `call(input, weight.t())`, which
    a call needing no gradient on the CPU runs through its layout's linear
    plan once the op has made that layout's plan (see above)."""
    if _runs_directly is None or not _runs_directly(input, weight):
        return call(input, weight.t())
    plan = _LINEAR_PLANS.get(_linear_key(input, weight))
    if plan is not None:
        return plan.run(input, weight)
    out = call(input, weight.t())
    plan = _LinearPlan.of(input, weight)  # the layout's plan, made (or found) by that call
    if plan is not None:
        if len(_LINEAR_PLANS) >= MAX_PLANS:
            _LINEAR_PLANS.clear()
        # Keyed anew: the call may have moved the buckets' state (a size changed).
        _LINEAR_PLANS[_linear_key(input, weight)] = plan
    return out


_LINEAR_PLANS: dict = {}


def _linear_key(input, weight):
    """The plan key of (input, weight.t()) (_plan_key: a weight's transpose
    is a weight where the weight is), and the state the kernel was found in."""
    precision = float32_precision() if input.dtype == torch.float32 else None
    return (input.shape, input.stride(), input.dtype, weight.shape, weight.stride(),
            weight.dtype, precision, _is_weight(input), _is_weight(weight),
            _weight_gradient.get(), shape_buckets.state(), launch.binding_state())


class _LinearPlan:
    __slots__ = ("kernel", "input_shape", "transpose_b", "shape", "read_input", "read_weight",
                 "export", "device", "weight_shape", "reshaped")

    @classmethod
    def of(cls, input, weight):
        """The linear plan of the op's plan for (input, weight.t()), where
        that plan is unpadded and its kernel reads input as (1, M, K) and
        the weight as it is (linear's weight (N, K), or its transpose, as
        Conv1D's (K, N) weight arrives); None otherwise."""
        wt = weight.t()
        plan = _PLANS.get(_plan_key(input, wt))
        if (plan is None or plan.padded or plan.transposes[0] or not input.is_contiguous()
                or plan.transposes[1] != weight.is_contiguous()):
            return None
        (a_size, _, _), (b_size, _, _) = plan.views
        a3 = input.reshape(a_size)
        b3 = weight[None] if plan.transposes[1] else wt[None]
        kernel = launch.cpu_kernel("matmul", (a3, b3), plan.params)
        if kernel is None:
            return None
        linear = cls()
        linear.kernel, linear.input_shape, linear.shape = kernel, a_size, plan.shape
        linear.transpose_b = plan.transposes[1]
        linear.read_input = bridge.kernel_argument_maker(input.dtype)
        linear.read_weight = bridge.kernel_argument_maker(weight.dtype)
        linear.export = bridge.cpu_to_torch()
        linear.device = compilation.input_device(kernel)
        linear.weight_shape = tuple(b3.shape)
        linear.reshaped = (1, *a_size[1:2], plan.shape[-1]) != tuple(plan.shape)
        return linear

    def run(self, input, weight):
        a = self.read_input(input).reshape(self.input_shape)  # (1, M, K)
        # The weight as it is, (N, K): a JAX array made once per weight
        # (bridge.kept_array), unless JAX would copy it (read each call).
        b = bridge.kept_array(weight, self.device, self.weight_shape) if self.transpose_b else None
        if b is None:
            b = self.read_weight(weight)
            b = b[None] if self.transpose_b else b.T[None]
        with _below_views():
            out = self.export(self.kernel(a, b))
            return out.view(self.shape) if self.reshaped else out


def bucket_sizes(a3, b3, transpose_a: bool, transpose_b: bool, weights=(False, False),
                 weight_shaped: bool = False):
    """((M, N, K), (M', N', K')): the product's sizes and those its kernel
    is built for, the sizes torch_pallas.runtime.shape_buckets chooses once a size
    changes from call to call (a model whose token count varies builds a
    bounded number of kernels). On the CPU only: CUDA's Triton kernels take
    their sizes at run time.

    The sizes of a weight (an nn.Parameter, or a view of one such as
    linear's weight.t()) are its own: they change only from layer to layer,
    never from call to call, so they call for no new kernel, and padding
    them would copy the weight on every call. Only the other operand's
    sizes, M or N, and K where neither operand is a weight, are bucketed.
    A weight's gradient (`weight_shaped`: X^T @ dY in the backward) has the
    weight's sizes as its M and N: only its K, the token count, is
    bucketed. Layers of different widths share its family, which would
    otherwise see M change from call to call in a step of fixed shapes and
    pad it (an MLP's 1376 to 1536: 12% more work and a copy of dY)."""
    m, k = (a3.shape[2], a3.shape[1]) if transpose_a else a3.shape[1:]
    n = b3.shape[1] if transpose_b else b3.shape[2]
    if not shape_buckets.enabled or a3.device.type != "cpu":
        return (m, n, k), (m, n, k)
    a_weight, b_weight = weights
    family = (a3.device, a3.dtype, a3.shape[0], b3.shape[0], transpose_a, transpose_b)
    mp = m if a_weight or weight_shaped else shape_buckets.size((*family, "m", n, k), m)
    np_ = n if b_weight or weight_shaped else shape_buckets.size((*family, "n", m, k), n)
    kp = k if a_weight or b_weight else shape_buckets.size((*family, "k", m, n), k)
    return (m, n, k), (mp, np_, kp)


# Set while the backward computes a weight's gradient (see bucket_sizes).
_weight_gradient = contextvars.ContextVar("pallas_matmul_weight_gradient", default=False)
# Set while one backward computes both gradients: the padded copies made in
# it, by source and size, for its second product (_zero_padded). It lives
# for that one backward call, in which no other code writes to the sources.
_pads = contextvars.ContextVar("pallas_matmul_pads", default=None)


def _is_weight(t: torch.Tensor) -> bool:
    return _is_parameter(t) or _is_parameter(t._base)


def _is_parameter(t) -> bool:
    # isinstance(t, Parameter) runs Parameter's metaclass's Python
    # __instancecheck__ (it also accepts tensors marked _is_param): ~1.5 us
    # a call, twice per matmul; the common types are answered without it.
    kind = type(t)
    if kind is torch.nn.Parameter:
        return True
    if kind is torch.Tensor or t is None:
        return bool(getattr(t, "_is_param", False))
    return isinstance(t, torch.nn.Parameter)


def pad_operands(a3, b3, transpose_a: bool, transpose_b: bool, sizes):
    """a3 and b3 zero-padded to the kernel's sizes (themselves where those
    are theirs): the padded rows are sliced off the result, the padded
    contraction terms are zeros."""
    (m, n, k), (mp, np_, kp) = sizes
    if (mp, np_, kp) == (m, n, k):
        return a3, b3
    a_rows, a_cols = (kp, mp) if transpose_a else (mp, kp)
    b_rows, b_cols = (np_, kp) if transpose_b else (kp, np_)
    return _zero_padded(a3, a_rows, a_cols), _zero_padded(b3, b_rows, b_cols)


def _zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t (B, R, C) in a (B, rows, cols) tensor, zeros beyond: written once,
    the padding alone zeroed (F.pad zeroes the whole tensor, then copies
    t over it: a write of the whole tensor more)."""
    batch, r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    pads = _pads.get()
    if pads is not None and t.is_contiguous():  # inside a backward: dC padded for dA serves dB
        # (contiguous: the shape fixes the layout but for size-1 dimensions' strides)
        key = (t.data_ptr(), t.shape, t.dtype, t._version, rows, cols)
        if key in pads:
            return pads[key]
        pads[key] = out = zero_padded(t, rows, cols)
        return out
    return zero_padded(t, rows, cols)


def zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t (B, R, C) copied into a new (B, rows, cols) tensor, zeros beyond;
    t written once and only the padding zeroed (as below)."""
    batch, r, c = t.shape
    out = t.new_empty(batch, rows, cols)
    out[:, :r, :c] = t
    if out.device.type != "cpu":
        out[:, r:, :].zero_()
        out[:, :r, c:].zero_()
        return out
    # The padding zeroed through NumPy, on this thread: torch's fill would
    # wake its OpenMP workers, which under OMP_WAIT_POLICY=PASSIVE costs more
    # than the fill (a 600 -> 640-row pad of 1376 float32 columns after a
    # torch op: median 314 -> 220 us, a clone of the input 188; 300
    # interleaved rounds on the 2-core CPU). Zero bits are +0.0 in every
    # float format.
    bits = bridge.numpy_view(out.view(_SAME_WIDTH_INT[out.element_size()]))
    bits[:, r:, :] = 0
    bits[:, :r, c:] = 0
    return out


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def float32_precision() -> str:
    """How float32 products may be computed, as torch.matmul's are on CUDA:
    "ieee" (full float32, torch's default) or "tf32" where torch allows TF32,
    through `torch.backends.cuda.matmul.fp32_precision` (or the global
    `torch.backends.fp32_precision` it inherits) or the older
    torch.set_float32_matmul_precision('high' / 'medium'), which sets it too."""
    setting = torch_compat.cuda_matmul_fp32_precision()
    if setting is None:  # a torch before the fp32_precision settings
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return "tf32" if setting == "tf32" else "ieee"


def matmul_fake(a, b):
    return a.new_empty(output_shape(a, b))


def _setup_context(ctx, inputs, output):
    a, b = inputs
    ctx.save_for_backward(
        a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None
    )
    ctx.shapes = (a.shape, b.shape)
    # b viewing a transposed matrix (linear's weight.t()): its gradient is
    # computed in the matrix's own layout, which AccumulateGrad then keeps
    # as it is instead of copying it into the weight's layout.
    ctx.b_transposed = b.dim() == 2 and not b.is_contiguous() and b.mT.is_contiguous()
    ctx.b_is_weight = _is_weight(b)


def _backward(ctx, grad):
    """dA = dC @ B^T and dB = A^T @ dC, with pallas::matmul, summed over the
    batch dimensions each operand was broadcast along."""
    a, b = ctx.saved_tensors
    a_shape, b_shape = ctx.shapes
    # Restore the dimensions torch.matmul drops for 1-D operands.
    a_mat = (1, a_shape[0]) if len(a_shape) == 1 else a_shape
    b_mat = (b_shape[0], 1) if len(b_shape) == 1 else b_shape
    batch = torch.broadcast_shapes(a_mat[:-2], b_mat[:-2])
    grad = grad.reshape(*batch, a_mat[-2], b_mat[-1])
    grad_a = grad_b = None
    # Both products read dC; where both pad its rows to one bucket, the
    # second reuses the first's copy (see _zero_padded).
    pads = _pads.set({}) if all(ctx.needs_input_grad) else None
    try:
        if ctx.needs_input_grad[0]:
            grad_a = torch.ops.pallas.matmul(grad, b.reshape(b_mat).mT)
            grad_a = grad_a.sum_to_size(a_mat).reshape(a_shape)
        if ctx.needs_input_grad[1]:
            token = _weight_gradient.set(ctx.b_is_weight)
            try:
                grad_b = _grad_b(ctx, a.reshape(a_mat), grad, b_mat)
            finally:
                _weight_gradient.reset(token)
            grad_b = grad_b.reshape(b_shape)
    finally:
        if pads is not None:
            _pads.reset(pads)
    return grad_a, grad_b


def _grad_b(ctx, a_rows, grad, b_mat):
    """A^T @ dC, summed over the batch dimensions b was broadcast along."""
    if len(b_mat) == 2:  # b has no batch: fold every batch into one product
        rows = math.prod(grad.shape[:-1])  # not -1: K or N may be 0
        a_flat, grad_flat = a_rows.reshape(rows, b_mat[0]), grad.reshape(rows, b_mat[-1])
        if ctx.b_transposed:  # (dC^T @ A)^T: the transposed matrix's layout
            return torch.ops.pallas.matmul(grad_flat.mT, a_flat).mT
        return torch.ops.pallas.matmul(a_flat.mT, grad_flat)
    return torch.ops.pallas.matmul(a_rows.mT, grad).sum_to_size(b_mat)


def _jvp(inputs, tangents):
    """The tangent of a @ b: ta @ b + a @ tb."""
    (a, b), (ta, tb) = inputs, tangents
    parts = [torch.ops.pallas.matmul(x, y) for x, y in ((ta, b), (a, tb))
             if x is not None and y is not None]
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def _flops(a_shape, b_shape, *, out_shape, **kwargs) -> int:
    """A multiply and an add per output element and step along K."""
    return 2 * math.prod(out_shape) * a_shape[-1]


registration.define(
    OP, matmul_implementation, fake=matmul_fake, backward=_backward,
    setup_context=_setup_context, jvp=_jvp,
    flops=_flops,
)


def _autocast_call(device_type: str, a, b):
    """Under torch.autocast, floating inputs on the autocast device are cast
    to its autocast dtype the way torch.matmul's are."""
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return torch.ops.pallas.matmul(cast(a), cast(b))


registration.register_autocast(OP, _autocast_call)


def _vmap(info, in_dims, a, b):
    """torch.vmap of matmul as one batched call: the vmapped dimension goes
    first, ahead of each operand's own batch dimensions (padded with size-1
    ones to a common count), and 1-D operands become matrices and back."""
    a_dim, b_dim = in_dims
    if a_dim is None and b_dim is None:
        return torch.ops.pallas.matmul(a, b), None
    a_rank, b_rank = a.dim() - (a_dim is not None), b.dim() - (b_dim is not None)
    a = a if a_dim is None else a.movedim(a_dim, 0)
    b = b if b_dim is None else b.movedim(b_dim, 0)
    if a_rank == 1:
        a = a.unsqueeze(-2)
    if b_rank == 1:
        b = b.unsqueeze(-1)
    a_batch, b_batch = max(a_rank, 2) - 2, max(b_rank, 2) - 2
    batch = max(a_batch, b_batch)
    if a_dim is not None:
        a = a.reshape(a.shape[0], *[1] * (batch - a_batch), *a.shape[1:])
    if b_dim is not None:
        b = b.reshape(b.shape[0], *[1] * (batch - b_batch), *b.shape[1:])
    out = torch.ops.pallas.matmul(a, b)
    if a_rank == 1:
        out = out.squeeze(-2)
    if b_rank == 1:
        out = out.squeeze(-1)
    return out, 0


torch.library.register_vmap(OP, _vmap)


# torch.ops.pallas.matmul, skipping the dispatcher on plain eager calls.
call = registration.direct_caller(torch.ops.pallas.matmul.default)
_runs_directly = registration.runs_directly(torch.ops.pallas.matmul.default)
_below_views = torch_compat.EAGER.below_views if torch_compat.EAGER is not None else None


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matrix product with `torch.matmul`'s semantics (1-D operands,
    broadcast batch dimensions), accumulated in float32 and returned in the
    operands' dtype (float32, float16 or bfloat16). Differentiable; cast
    by torch.autocast like torch.matmul."""
    return call(a, b)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`input @ weight.T + bias` with the Pallas matmul, like
    `torch.nn.functional.linear` (`torch_pallas.linear`). The weight's
    transpose is read in place and the batch dimensions of `input` fold into
    one product."""
    out = linear_product(input, weight)
    if bias is None:
        return out
    if torch.is_autocast_enabled(out.device.type):  # cast with the operands, as F.linear's is
        bias = bias.to(out.dtype)
    elif bias.dtype != out.dtype:
        raise TypeError(
            f"torch_pallas.linear: bias has dtype {bias.dtype}, input and weight "
            f"{out.dtype}; they must be the same (convert one explicitly)"
        )
    return out + bias


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul in float64."""
    return a.double() @ b.double()


# What rounding a Tensor Core input costs: TF32 for float32, when torch allows it.
TF32_INPUT = 2.0**-11


def error_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor,
                tf32: bool = False) -> torch.Tensor:
    """Elementwise bound on |pallas - ref| for a float32-accumulated product
    in a's dtype: float32 accumulation, one rounding of the output and, with
    `tf32` (float32 at torch's 'high' precision), the inputs rounded to TF32;
    16-bit inputs are exact in float32."""
    k = a.shape[-1]
    magnitude = a.double().abs() @ b.double().abs()
    accumulate = k * 2.0**-24 * magnitude
    inputs = 2 * TF32_INPUT * magnitude if tf32 and a.dtype == torch.float32 else 0
    finfo = torch.finfo(a.dtype)
    output = dtypes.ROUNDING[a.dtype] * ref.abs() + finfo.tiny * finfo.eps  # subnormals too
    return inputs + accumulate + output


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged product and a batch against one matrix."""
    found = []
    for a_shape, b_shape in (((9, 13), (13, 6)), ((2, 37, 70), (70, 21))):
        a = torch.randn(a_shape, device=device, requires_grad=requires_grad)
        b = torch.randn(b_shape, device=device, requires_grad=requires_grad)
        ref = reference(a.detach().cpu(), b.detach().cpu())
        found.append(registry.Example((a, b), {}, ref, error_bound(a.detach().cpu(), b.detach().cpu(), ref)))
    return found


registry.register(registry.OpInfo(
    name="matmul",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.matmul",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.matmul",
        "triton": "torch_pallas.kernels.triton.matmul",
    },
    function=matmul,
    torch_function=torch.matmul,
    examples=examples,
))
