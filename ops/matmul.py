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

import math

import torch

from torch_pallas import dtypes, launch, registration, registry, shape_buckets
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
    torch._check(
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
    a3, b3, (m, n) = bucketed(a3, b3, transpose_a, transpose_b)
    out = launch.run("matmul", a.device, (a3, b3), params)
    if out.shape[1:] != (m, n):
        out = out[:, :m, :n].contiguous()  # a copy only where the rows do not end it
    return out.reshape(shape)


def bucketed(a3, b3, transpose_a: bool, transpose_b: bool):
    """(a3, b3, (M, N)): the operands zero-padded along M, N and K to the
    sizes torch_pallas.shape_buckets chooses once a size changes from call
    to call (a model whose token count varies builds a bounded number of
    kernels), and the unpadded output size. On the CPU only: CUDA's
    Triton kernels take their sizes at run time."""
    m, k = (a3.shape[2], a3.shape[1]) if transpose_a else a3.shape[1:]
    n = b3.shape[1] if transpose_b else b3.shape[2]
    if not shape_buckets.enabled or a3.device.type != "cpu":
        return a3, b3, (m, n)
    family = (a3.device, a3.dtype, a3.shape[0], b3.shape[0], transpose_a, transpose_b)
    mp = shape_buckets.size((*family, "m", n, k), m)
    np_ = shape_buckets.size((*family, "n", m, k), n)
    kp = shape_buckets.size((*family, "k", m, n), k)
    if (mp, np_, kp) == (m, n, k):
        return a3, b3, (m, n)
    a_rows, a_cols = (kp, mp) if transpose_a else (mp, kp)
    b_rows, b_cols = (np_, kp) if transpose_b else (kp, np_)
    pad = torch.nn.functional.pad
    a3 = pad(a3, (0, a_cols - a3.shape[2], 0, a_rows - a3.shape[1]))
    b3 = pad(b3, (0, b_cols - b3.shape[2], 0, b_rows - b3.shape[1]))
    return a3, b3, (m, n)


def float32_precision() -> str:
    """How float32 products may be computed, as torch.matmul's are on CUDA:
    "ieee" (full float32, torch's default) or "tf32" where torch allows TF32,
    through `torch.backends.cuda.matmul.fp32_precision` (or the global
    `torch.backends.fp32_precision` it inherits) or the older
    torch.set_float32_matmul_precision('high' / 'medium'), which sets it too."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting is None:  # a torch before the fp32_precision settings
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if setting == "none":  # inherits the global setting
        setting = getattr(torch.backends, "fp32_precision", "none")
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
    if ctx.needs_input_grad[0]:
        grad_a = torch.ops.pallas.matmul(grad, b.reshape(b_mat).mT)
        grad_a = grad_a.sum_to_size(a_mat).reshape(a_shape)
    if ctx.needs_input_grad[1]:
        a_rows = a.reshape(a_mat)
        if len(b_mat) == 2:  # b has no batch: fold every batch into one product
            rows = math.prod(grad.shape[:-1])  # not -1: K or N may be 0
            a_flat, grad_flat = a_rows.reshape(rows, a_mat[-1]), grad.reshape(rows, b_mat[-1])
            if ctx.b_transposed:  # (dC^T @ A)^T: the transposed matrix's layout
                grad_b = torch.ops.pallas.matmul(grad_flat.mT, a_flat).mT
            else:
                grad_b = torch.ops.pallas.matmul(a_flat.mT, grad_flat)
        else:
            grad_b = torch.ops.pallas.matmul(a_rows.mT, grad).sum_to_size(b_mat)
        grad_b = grad_b.reshape(b_shape)
    return grad_a, grad_b


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


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matrix product with `torch.matmul`'s semantics (1-D operands,
    broadcast batch dimensions), accumulated in float32 and returned in the
    operands' dtype (float32, float16 or bfloat16). Differentiable; cast
    by torch.autocast like torch.matmul."""
    return torch.ops.pallas.matmul(a, b)


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
