"""torch.ops.pallas.grouped_mm(mat_a, mat_b, offs, bias, out_dtype): torch's
`F.grouped_mm`, the grouped GEMM of a mixture of experts, on every device
and dtype, differentiable in mat_a, mat_b and bias.

The forms (torch's; `offs` holds each group's cumulative end, int32 or
int64, groups may be empty):

- 2-D x 3-D (the experts' forward): mat_a (M, K), mat_b (G, K, N), offs
  over mat_a's rows -> (M, N); rows past offs[-1] are zero;
- 3-D x 3-D: (G, M, K) @ (G, K, N) -> (G, M, N), no offs;
- 2-D x 2-D (a weight's gradient): mat_a (M, K), mat_b (K, N), offs over
  the shared K -> (G, M, N);
- 3-D x 2-D: mat_a (G, M, K), mat_b (K, N), offs over mat_b's columns ->
  (M, N); columns past offs[-1] are zero.

`bias` (G, N) is added to each group's rows (2-D x 3-D) or to out[g]
(3-D x 3-D, 2-D x 2-D), in float32 before the one rounding; the 3-D x 2-D
form, whose groups have no common N, takes none. Products accumulate in
float32 and round once to `out_dtype`: the inputs' dtype, or float32 for
16-bit inputs (their gradients then come back in the inputs' dtype, the
incoming gradient rounded to it once).

Every form is one of two kernels (kernels/<family>/grouped_mm.py over
ragged rows, grouped_mm_backward.py contracting over ragged rows), on
operands transposed where the form needs it; a mat_b that is the transposed
view of weights stored (G, N, K), as transformers passes them, is read in
place. The backward is the same two kernels: dA = dY @ B[g]^T over ragged
rows, dB = A[rows]^T @ dY[rows] contracted over them, and dbias the rows'
sums; rows past offs[-1] give nothing to dB or dbias (their gradient is
masked, not multiplied by zero) and get a zero gradient.

offs' values (non-decreasing, non-negative, at most the dimension they
slice) are checked where the op runs, before its kernel, which costs one
read of offs (a sync on a GPU); what torch.compile traces (the fake, the
Triton decomposition) checks shapes and dtypes only.
"""

from __future__ import annotations

import enum
import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::grouped_mm"
NAME = "grouped_mm"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OFFS_DTYPES = (torch.int32, torch.int64)


class Form(enum.Enum):
    """Which operand's dimension offs slices."""

    ROWS = "2-D x 3-D"         # mat_a's rows
    BATCHED = "3-D x 3-D"      # none: a batched product
    CONTRACTION = "2-D x 2-D"  # the shared K
    COLUMNS = "3-D x 2-D"      # mat_b's columns


def _form(mat_a, mat_b) -> Form:
    for name, t in (("mat_a", mat_a), ("mat_b", mat_b)):
        if t.dim() not in (2, 3):
            raise checks.RefusedLikeTorch(
                f"{OP}: {name} must be 2-D or 3-D, got {name}.dim()={t.dim()} "
                f"({name}.shape={tuple(t.shape)})")
    return {(2, 3): Form.ROWS, (3, 3): Form.BATCHED, (2, 2): Form.CONTRACTION,
            (3, 2): Form.COLUMNS}[(mat_a.dim(), mat_b.dim())]


def _out_dtype(mat_a, out_dtype) -> torch.dtype:
    if out_dtype is None or out_dtype == mat_a.dtype:
        return mat_a.dtype
    if out_dtype == torch.float32:
        return out_dtype
    raise TypeError(f"{OP}: out_dtype={out_dtype} is not supported for {mat_a.dtype} inputs; "
                    f"use None, {mat_a.dtype} or torch.float32 (a narrower output would round "
                    "what the float32 accumulator holds twice)")


def check(mat_a, mat_b, offs, bias, out_dtype):
    """(form, groups, output shape, output dtype), after every check that
    needs no value of offs."""
    checks.tensor(OP, "mat_a", mat_a)
    checks.tensor(OP, "mat_b", mat_b)
    checks.dtype_in(OP, "mat_a", mat_a.dtype, DTYPES)
    checks.same_dtype(OP, mat_a, mat_b, names=("mat_a", "mat_b"))
    checks.same_device(OP, mat_a, mat_b, names=("mat_a", "mat_b"))
    form = _form(mat_a, mat_b)
    a, b = tuple(mat_a.shape), tuple(mat_b.shape)
    if form is Form.CONTRACTION:
        checks.require(a[1] == b[0], lambda: f"{OP}: mat_a.shape={a} and mat_b.shape={b}: "
                       "mat_a.shape[1] must equal mat_b.shape[0] (the K offs slices)")
    else:
        checks.require(a[-1] == b[-2], lambda: f"{OP}: mat_a.shape={a} and mat_b.shape={b}: "
                       "mat_a.shape[-1] must equal mat_b.shape[-2] (the contracted K)")
    if form is Form.BATCHED:
        if offs is not None:
            raise ValueError(f"{OP}: offs must be None for 3-D mat_a and mat_b (a batched "
                             f"product, its groups are dimension 0), got offs.shape="
                             f"{tuple(offs.shape)}")
        checks.require(a[0] == b[0], lambda: f"{OP}: mat_a.shape={a} and mat_b.shape={b} must "
                       "have the same number of groups (dimension 0)")
        groups = a[0]
    else:
        if offs is None:
            raise ValueError(f"{OP}: offs is required when mat_a or mat_b is 2-D "
                             f"(mat_a.shape={a}, mat_b.shape={b}): each group's cumulative end")
        checks.tensor(OP, "offs", offs)
        if offs.dtype not in OFFS_DTYPES:
            raise TypeError(f"{OP}: offs must be an integer tensor (int32 or int64), got "
                            f"offs.dtype={offs.dtype}")
        if offs.dim() != 1:
            raise ValueError(f"{OP}: offs must be 1-D (one cumulative end per group), got "
                             f"offs.shape={tuple(offs.shape)}")
        checks.same_device(OP, mat_a, offs, names=("mat_a", "offs"))
        groups = offs.shape[0]
        grouped = {Form.ROWS: ("mat_b.shape[0]", b[0]), Form.COLUMNS: ("mat_a.shape[0]", a[0])}
        if form in grouped:
            what, count = grouped[form]
            checks.require(count == groups, lambda: f"{OP}: offs has {groups} groups but "
                           f"{what}={count} (mat_a.shape={a}, mat_b.shape={b})")
    out_shape = {Form.ROWS: lambda: (a[0], b[2]), Form.BATCHED: lambda: (a[0], a[1], b[2]),
                 Form.CONTRACTION: lambda: (groups, a[0], b[1]),
                 Form.COLUMNS: lambda: (a[1], b[1])}[form]()
    out_dtype = _out_dtype(mat_a, out_dtype)
    if bias is not None:
        checks.tensor(OP, "bias", bias)
        checks.same_device(OP, mat_a, bias, names=("mat_a", "bias"))
        if form is Form.COLUMNS:
            raise ValueError(f"{OP}: bias is not supported for 3-D mat_a and 2-D mat_b (each "
                             "group has its own columns, so no (G, N) bias fits them)")
        if tuple(bias.shape) != (groups, out_shape[-1]):
            raise ValueError(f"{OP}: bias.shape={tuple(bias.shape)} must be (groups, N) = "
                             f"{(groups, out_shape[-1])}")
        if bias.dtype not in (mat_a.dtype, out_dtype):
            raise TypeError(f"{OP}: bias.dtype={bias.dtype} must be mat_a's dtype "
                            f"({mat_a.dtype}) or the output's ({out_dtype})")
    return form, groups, out_shape, out_dtype


def check_offs(offs: torch.Tensor, limit: int, sliced: str) -> None:
    """offs' values: non-negative, non-decreasing, at most `limit` (the
    size of the dimension they slice, `sliced`). One read of offs."""
    values = offs.tolist()
    if not values:
        return
    if values[0] < 0:
        raise ValueError(f"{OP}: offs must be non-negative, got offs[0]={values[0]}")
    for g in range(1, len(values)):
        if values[g] < values[g - 1]:
            raise ValueError(f"{OP}: offs must be non-decreasing (cumulative group ends), got "
                             f"offs[{g - 1}]={values[g - 1]} > offs[{g}]={values[g]}")
    if values[-1] > limit:
        raise ValueError(f"{OP}: offs[-1]={values[-1]} is past {sliced}={limit}, the "
                         "dimension offs slices")


def _sliced(form: Form, mat_a, mat_b) -> tuple[int, str]:
    return {Form.ROWS: (mat_a.shape[0], "mat_a.shape[0]"),
            Form.CONTRACTION: (mat_a.shape[1], "mat_a.shape[1]"),
            Form.COLUMNS: (mat_b.shape[1], "mat_b.shape[1]")}[form]


# --- the two kernels, on operands in their layouts -------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return dtypes.jax_name(dtype)


def _weights(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(G, K, N) weights as the kernel reads them: (tensor, transpose_rhs),
    the transposed view of (G, N, K) weights passed as those weights."""
    if w.mT.is_contiguous():
        return w.mT, True
    return w.contiguous(), False


def ragged_rows(lhs, w, ends, bias, out_dtype: torch.dtype):
    """lhs (M, K) times w (G, K, N), any layout, per group of rows: (M, N)."""
    rhs, transpose_rhs = _weights(w)
    inputs = (lhs.contiguous(), rhs, ends)
    if bias is not None:
        inputs += (bias.to(torch.float32).contiguous(),)
    return launch.run(NAME, lhs.device, inputs,
                      {"transpose_rhs": transpose_rhs, "out_dtype": _dtype_name(out_dtype)})


def ragged_contraction(lhs, rhs, ends, out_dtype: torch.dtype):
    """lhs (M, K), rhs (M, N) contracted over each group's rows: (G, K, N)."""
    return launch.run(f"{NAME}_backward", lhs.device, (lhs.contiguous(), rhs.contiguous(), ends),
                      {"out_dtype": _dtype_name(out_dtype)})


def _uniform_ends(groups: int, rows: int, device) -> torch.Tensor:
    return torch.arange(1, groups + 1, dtype=torch.int32, device=device) * rows


def _ends(offs: torch.Tensor) -> torch.Tensor:
    return offs.to(torch.int32).contiguous()


def _forward(mat_a, mat_b, offs, bias, out_dtype, form: Form, groups: int, out_shape):
    if math.prod(out_shape) == 0 or groups == 0:
        return mat_a.new_zeros(out_shape, dtype=out_dtype)
    if form is Form.ROWS:
        if mat_a.shape[1] == 0:
            return _bias_rows(mat_a.new_zeros(out_shape, dtype=torch.float32), offs, bias, out_dtype)
        return ragged_rows(mat_a, mat_b, _ends(offs), bias, out_dtype)
    if form is Form.BATCHED:
        g, m, k = mat_a.shape
        if k == 0:
            out = mat_a.new_zeros(out_shape, dtype=torch.float32)
            return (out if bias is None else out + bias.unsqueeze(1).float()).to(out_dtype)
        out = ragged_rows(mat_a.reshape(g * m, k), mat_b, _uniform_ends(g, m, mat_a.device),
                          bias, out_dtype)
        return out.reshape(out_shape)
    if form is Form.CONTRACTION:
        if mat_a.shape[1] == 0:  # every group empty
            out = mat_a.new_zeros(out_shape, dtype=torch.float32)
            return (out if bias is None else out + bias.unsqueeze(1).float()).to(out_dtype)
        # out[g] = A[:, K_g] @ B[K_g]: the contraction over K's rows of A^T and B.
        wide = torch.float32 if bias is not None else out_dtype
        out = ragged_contraction(mat_a.mT, mat_b, _ends(offs), wide)
        return out if bias is None else (out + bias.unsqueeze(1).float()).to(out_dtype)
    # COLUMNS: out^T (N, M) = B^T (N, K) times A[g]^T per group of B's columns.
    if mat_a.shape[2] == 0:
        return mat_a.new_zeros(out_shape, dtype=out_dtype)
    return ragged_rows(mat_b.mT, mat_a.mT, _ends(offs), None, out_dtype).mT.contiguous()


def _bias_rows(out_f32, offs, bias, out_dtype):
    """out_f32 (M, N) plus each group's bias on its rows (rows past the last
    group keep zero)."""
    if bias is not None:
        out_f32 = out_f32 + _per_row(bias.float(), offs, out_f32.shape[0])
    return out_f32.to(out_dtype)


def _group_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's group; G for the rows past the last."""
    return torch.bucketize(torch.arange(rows, device=offs.device), offs.to(torch.int64),
                           right=True)


def _per_row(per_group: torch.Tensor, offs, rows: int) -> torch.Tensor:
    padded = torch.cat([per_group, per_group.new_zeros((1, *per_group.shape[1:]))])
    return padded.index_select(0, _group_of_rows(offs, rows))


def grouped_mm_implementation(mat_a: torch.Tensor, mat_b: torch.Tensor,
                              offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    form, groups, out_shape, dtype = check(mat_a, mat_b, offs, bias, out_dtype)
    if offs is not None:
        check_offs(offs, *_sliced(form, mat_a, mat_b))
    return _forward(mat_a, mat_b, offs, bias, dtype, form, groups, out_shape)


def _traced_implementation(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """What torch.compile traces on CUDA: the kernels, no read of offs."""
    form, groups, out_shape, dtype = check(mat_a, mat_b, offs, bias, out_dtype)
    return _forward(mat_a, mat_b, offs, bias, dtype, form, groups, out_shape)


def grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    _, _, out_shape, dtype = check(mat_a, mat_b, offs, bias, out_dtype)
    return mat_a.new_empty(out_shape, dtype=dtype)


# --- autograd --------------------------------------------------------------

def _arguments(values) -> tuple:
    """The op's five arguments from what the dispatcher passed (it drops
    trailing defaults)."""
    return (*values, None, None, None)[:5]


def _setup_context(ctx, inputs, output):
    mat_a, mat_b, offs, bias, _ = _arguments(inputs)
    ctx.save_for_backward(mat_a, mat_b, offs)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.arguments = len(inputs)


def _backward(ctx, grad_out):
    mat_a, mat_b, offs = ctx.saved_tensors
    want_a, want_b, _, want_bias, _ = _arguments(ctx.needs_input_grad)
    mask = [bool(want_a), bool(want_b), bool(want_bias) and ctx.bias_dtype is not None]
    grad_a, grad_b, grad_bias = torch.ops.pallas.grouped_mm_backward(
        grad_out, mat_a, mat_b, offs, ctx.bias_dtype is not None, mask)
    grads = (grad_a if mask[0] else None, grad_b if mask[1] else None, None,
             grad_bias.to(ctx.bias_dtype) if mask[2] else None, None)
    return grads[:ctx.arguments]


def _jvp(inputs, tangents):
    """The tangent, by linearity: grouped_mm(ta, b) + grouped_mm(a, tb) + tbias."""
    (mat_a, mat_b, offs, bias, out_dtype), (ta, tb, _, tbias, _) = (_arguments(inputs),
                                                                     _arguments(tangents))
    parts = [torch.ops.pallas.grouped_mm(x, y, offs, None, out_dtype)
             for x, y in ((ta, mat_b), (mat_a, tb)) if x is not None and y is not None]
    if tbias is not None:
        zero_a = mat_a.new_zeros(mat_a.shape)
        parts.append(torch.ops.pallas.grouped_mm(zero_a, mat_b, offs, tbias, out_dtype))
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def _flops(a_shape, b_shape, *args, out_shape, **kwargs) -> int:
    """A multiply and an add per output element and step of its K (the
    ragged forms: at most, rows of no group included)."""
    k = a_shape[-1] if len(a_shape) == 3 or len(b_shape) == 3 else a_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * b_shape[1] * k
    return 2 * math.prod(out_shape) * k


registration.define(
    OP, grouped_mm_implementation, fake=grouped_mm_fake,
    schema="(Tensor mat_a, Tensor mat_b, Tensor? offs=None, Tensor? bias=None, "
           "ScalarType? out_dtype=None) -> Tensor",
    backward=_backward, setup_context=_setup_context, jvp=_jvp,
    triton_traced=_traced_implementation, flops=_flops,
)


def _check_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask):
    form, groups, out_shape, _ = check(mat_a, mat_b, offs, None, None)
    if tuple(grad_out.shape) != tuple(out_shape):
        raise ValueError(f"pallas::grouped_mm_backward: grad_out.shape={tuple(grad_out.shape)} "
                         f"must be the output's shape {tuple(out_shape)}")
    if len(output_mask) != 3:
        raise ValueError(f"pallas::grouped_mm_backward: output_mask={list(output_mask)} must "
                         "have 3 entries (mat_a, mat_b, bias)")
    return form, groups, out_shape


def _transposed_gradients(form: Form, mat_b) -> tuple[bool, bool]:
    """Whether dA and dB come out as transposed views (the layout their
    kernel writes): dB of weights stored (G, N, K), dA of the 2-D x 2-D
    form, dB of the 3-D x 2-D form."""
    if form is Form.CONTRACTION:
        return True, False
    if form is Form.COLUMNS:
        return False, True
    return False, bool(mat_b.mT.is_contiguous())


def _new(like: torch.Tensor, transposed: bool, fill_zeros: bool) -> torch.Tensor:
    """A tensor of like's shape and dtype, zero-filled or not, laid out as
    the transposed view of a contiguous one where `transposed`."""
    make = like.new_zeros if fill_zeros else like.new_empty
    return make(like.mT.shape).mT if transposed else make(like.shape)


def _gradients(grad_out, mat_a, mat_b, offs, has_bias, output_mask, form, groups):
    """(dA, dB, dbias), None where not asked for; dbias float32."""
    want_a, want_b, want_bias = output_mask
    dtype = mat_a.dtype
    dy = grad_out.to(dtype)  # one rounding of a float32 output's gradient
    a_t, b_t = _transposed_gradients(form, mat_b)
    grad_a = grad_b = grad_bias = None
    empty = groups == 0 or mat_a.numel() == 0 or mat_b.numel() == 0 or dy.numel() == 0
    if empty:
        grad_a = _new(mat_a, a_t, True) if want_a else None
        grad_b = _new(mat_b, b_t, True) if want_b else None
    elif form is Form.ROWS or form is Form.BATCHED:
        rows_a = mat_a.reshape(-1, mat_a.shape[-1])
        dy_rows = dy.reshape(-1, dy.shape[-1])
        ends = (_ends(offs) if form is Form.ROWS
                else _uniform_ends(groups, mat_a.shape[1], mat_a.device))
        if want_a:
            grad_a = ragged_rows(dy_rows, mat_b.mT, ends, None, dtype).reshape(mat_a.shape)
        if want_b:  # weights stored (G, N, K): dW in their layout, dB its transpose
            grad_b = (ragged_contraction(dy_rows, rows_a, ends, dtype).mT if b_t
                      else ragged_contraction(rows_a, dy_rows, ends, dtype))
    elif form is Form.CONTRACTION:
        # out[g] = A[:, K_g] @ B[K_g]: dA^T[K_g] = B[K_g] @ dY[g]^T, dB[K_g] = A[:, K_g]^T @ dY[g].
        ends = _ends(offs)
        if want_a:
            grad_a = ragged_rows(mat_b, dy.mT, ends, None, dtype).mT
        if want_b:
            grad_b = ragged_rows(mat_a.mT, dy, ends, None, dtype)
    else:  # COLUMNS: out[:, N_g] = A[g] @ B[:, N_g]
        ends = _ends(offs)
        if want_a:  # dA[g] = dY[:, N_g] @ B[:, N_g]^T
            grad_a = ragged_contraction(dy.mT, mat_b.mT, ends, dtype)
        if want_b:  # dB^T[N_g] = dY^T[N_g] @ A[g]
            grad_b = ragged_rows(dy.mT, mat_a, ends, None, dtype).mT
    if want_bias and has_bias:
        if form is Form.CONTRACTION:
            grad_bias = grad_out.float().sum(1)
        else:
            ends = (_ends(offs) if form is Form.ROWS
                    else _uniform_ends(groups, mat_a.shape[1], mat_a.device))
            grad_bias = _group_sums(grad_out.reshape(-1, grad_out.shape[-1]), ends, groups)
    return grad_a, grad_b, grad_bias


def _group_sums(rows: torch.Tensor, ends: torch.Tensor, groups: int) -> torch.Tensor:
    """Each group's rows summed in float32, (G, N); rows past the last group
    dropped (selected away, so NaN there stays there)."""
    group = _group_of_rows(ends, rows.shape[0])
    sums = rows.new_zeros((groups + 1, rows.shape[1]), dtype=torch.float32)
    kept = torch.where((group < groups).unsqueeze(1), rows.float(), 0.0)
    return sums.index_add_(0, group, kept).narrow(0, 0, groups)


def _filled(grad_a, grad_b, grad_bias, mat_a, mat_b):
    """The op returns three tensors: empty ones where a gradient was not
    asked for."""
    return (mat_a.new_empty(0) if grad_a is None else grad_a,
            mat_b.new_empty(0) if grad_b is None else grad_b,
            mat_a.new_empty(0, dtype=torch.float32) if grad_bias is None else grad_bias)


def backward_implementation(grad_out: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor,
                            offs: torch.Tensor | None, has_bias: bool, output_mask: list[bool]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    form, groups, _ = _check_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask)
    return _filled(*_gradients(grad_out, mat_a, mat_b, offs, has_bias, output_mask, form,
                               groups), mat_a, mat_b)


def _backward_fake(grad_out, mat_a, mat_b, offs, has_bias, output_mask):
    form, groups, out_shape = _check_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask)
    want_a, want_b, want_bias = output_mask
    a_t, b_t = _transposed_gradients(form, mat_b)
    grad_bias = (grad_out.new_empty((groups, out_shape[-1]), dtype=torch.float32)
                 if want_bias and has_bias else None)
    return _filled(_new(mat_a, a_t, False) if want_a else None,
                   _new(mat_b, b_t, False) if want_b else None, grad_bias, mat_a, mat_b)


registration.define(
    "pallas::grouped_mm_backward", backward_implementation, fake=_backward_fake,
    schema="(Tensor grad_out, Tensor mat_a, Tensor mat_b, Tensor? offs, bool has_bias, "
           "bool[] output_mask) -> (Tensor, Tensor, Tensor)",
)


# torch.ops.pallas.grouped_mm, skipping the dispatcher on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.grouped_mm.default)


def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None,
               bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.nn.functional.grouped_mm` on every device and dtype, with
    int64 offs, a (G, N) bias and out_dtype=float32 for 16-bit inputs,
    differentiable in mat_a, mat_b and bias (see the module's docstring)."""
    return _call(mat_a, mat_b, offs, bias, out_dtype)


def grouped_mm_backward(grad_out, mat_a, mat_b, offs=None, has_bias=False,
                        output_mask=(True, True, True)):
    """(dA, dB, dbias) of grouped_mm (empty tensors where output_mask says
    no; dbias float32, empty without a bias)."""
    return torch.ops.pallas.grouped_mm_backward(grad_out, mat_a, mat_b, offs, has_bias,
                                                list(output_mask))


def torch_grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    """torch's own: F.grouped_mm (no bias on CPU)."""
    return torch.nn.functional.grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)


def reference(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """Every form by its definition, one group at a time, in float64; rows
    (2-D x 3-D) and columns (3-D x 2-D) past offs[-1] zero."""
    a, b = mat_a.cpu().double(), mat_b.cpu().double()
    bias = None if bias is None else bias.cpu().double()
    form = _form(a, b)
    if form is Form.BATCHED:
        out = a @ b
        return out if bias is None else out + bias.unsqueeze(1)
    bounds = [0, *offs.tolist()]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    if form is Form.ROWS:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(pieces):
            out[s:e] = a[s:e] @ b[g] + (0 if bias is None else bias[g])
        return out
    if form is Form.CONTRACTION:
        out = torch.stack([a[:, s:e] @ b[s:e] for s, e in pieces]) if pieces else \
            a.new_zeros(0, a.shape[0], b.shape[1])
        return out if bias is None else out + bias.unsqueeze(1)
    out = a.new_zeros(a.shape[1], b.shape[1])
    for g, (s, e) in enumerate(pieces):
        out[:, s:e] = a[g] @ b[:, s:e]
    return out


def error_bound(mat_a, ref, k: int, out_dtype=None) -> torch.Tensor:
    """float32 accumulation over k terms, then one rounding to the output's
    dtype, relative to the magnitudes summed (|a| @ |b| is bounded by
    sqrt(k) times typical values of random inputs: 4 sqrt(k) |ref| + k eps)."""
    dtype = _out_dtype(mat_a, out_dtype)
    return dtypes.ROUNDING[dtype] * ref.abs() + (4 * k * 2.0**-24 + 1e-6) * (ref.abs() + k ** 0.5)


def _random_offs(rows: int, sizes, device) -> torch.Tensor:
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged bfloat16 experts forward (an empty group, rows past the
    last), weights as transformers passes them (a transposed view), with a
    bias; a float32 3-D x 3-D product; a float32 2-D x 2-D one."""
    found = []
    a = torch.randn(37, 24, device=device).to(torch.bfloat16)
    w = torch.randn(4, 20, 24, device=device).to(torch.bfloat16)  # (G, N, K)
    bias = torch.randn(4, 20, device=device).to(torch.bfloat16)
    offs = _random_offs(37, [9, 0, 17, 6], device)
    for t in (a, w, bias):
        t.requires_grad_(requires_grad)
    ref = reference(a.detach(), w.detach().mT, offs=offs, bias=bias.detach())
    found.append(registry.Example((a, w.mT), {"offs": offs, "bias": bias}, ref,
                                  error_bound(a, ref, 24)))
    a3 = torch.randn(3, 11, 13, device=device).requires_grad_(requires_grad)
    b3 = torch.randn(3, 13, 7, device=device).requires_grad_(requires_grad)
    ref = reference(a3.detach(), b3.detach())
    found.append(registry.Example((a3, b3), {}, ref, error_bound(a3, ref, 13)))
    a2 = torch.randn(9, 30, device=device).requires_grad_(requires_grad)
    b2 = torch.randn(30, 5, device=device).requires_grad_(requires_grad)
    offs2 = _random_offs(30, [7, 0, 19], device)
    ref = reference(a2.detach(), b2.detach(), offs=offs2)
    found.append(registry.Example((a2, b2), {"offs": offs2}, ref, error_bound(a2, ref, 19)))
    return found


registry.register(registry.OpInfo(
    name=NAME,
    kernels={
        "tpu": "torch_pallas.kernels.tpu.grouped_mm",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.grouped_mm",
        "triton": "torch_pallas.kernels.triton.grouped_mm",
    },
    function=grouped_mm,
    torch_function=torch_grouped_mm,
    examples=examples,
))


def reference_gradients(grad_out, mat_a, mat_b, offs=None, has_bias=False, output_mask=None):
    """(dA, dB, dbias) in float64 (dbias empty without a bias)."""
    a, b = (t.detach().cpu().double().requires_grad_() for t in (mat_a, mat_b))
    offs = None if offs is None else offs.cpu()
    _, groups, out_shape, _ = check(mat_a, mat_b, offs, None, None)
    bias = (torch.zeros(groups, out_shape[-1], dtype=torch.float64, requires_grad=True)
            if has_bias else None)
    out = reference(a, b, offs=offs, bias=bias)
    wrt = (a, b) + ((bias,) if has_bias else ())
    grads = torch.autograd.grad(out, wrt, grad_out.cpu().double())
    return grads[0], grads[1], grads[2] if has_bias else torch.zeros(0, dtype=torch.float64)


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 experts forward with a bias, its
    incoming gradient NaN on the rows past the last group."""
    a = torch.randn(29, 16, device=device).to(torch.float16)
    b = torch.randn(3, 16, 12, device=device).to(torch.float16)
    offs = _random_offs(29, [0, 13, 10], device)
    dy = torch.randn(29, 12, device=device).to(torch.float16)
    dy[23:] = float("nan")
    clean = dy.clone()
    clean[23:] = 0
    expected = reference_gradients(clean, a, b, offs, True)
    expected = (expected[0], expected[1], expected[2])
    bounds = tuple(error_bound(a, e, 29) * 4 for e in expected)
    return [registry.Example((dy, a, b, offs, True, [True, True, True]), {}, expected, bounds)]


registry.register(registry.OpInfo(
    name=f"{NAME}_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.grouped_mm_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.grouped_mm_backward",
        "triton": "torch_pallas.kernels.triton.grouped_mm_backward",
    },
    function=grouped_mm_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
