"""torch.ops.pallas.rotary_embedding(q, k, cos, sin, unsqueeze_dim=1) ->
(q_embed, k_embed): transformers' `apply_rotary_pos_emb` (the rotate-half
convention) fused, q and k rotated by one kernel call, in float32, rounded
once:

    q_embed = q * cos.unsqueeze(unsqueeze_dim) + rotate_half(q) * sin.unsqueeze(unsqueeze_dim)

and k_embed alike, rotate_half(x) = cat(-x2, x1) of x's halves x1, x2.

q and k may have different head counts (grouped kv heads), otherwise one
shape; the head dimension is the one cos.unsqueeze(unsqueeze_dim) adds
(dimension 1 of transformers' (B, H, S, D) q; 2 for (B, S, H, D)), and cos
and sin broadcast to q along every other (a batch of 1 included). The
result has the dtype q and cos promote to, as torch's composition gives
(a float32 cos with a bfloat16 q: float32).

The op views q and k as (N1, H, N2, D) and the angles as (N1, N2, D), one
row per token shared by its heads: heads outside the tokens in memory
(contiguous q: N1 batches of N2 tokens), or inside them (q from a
transformers layer's `proj(x).view(B, S, H, D).transpose(1, 2)`: N1 tokens,
N2 = 1), read in place either way and the results laid out as q is; other
layouts are copied. cos and sin are small (no head axis): broadcast, they
are made contiguous.

`pallas::rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim,
q=None, k=None) -> (dq, dk, dcos, dsin)`: dq and dk are the transposed
rotation, dx = (g1 c1 + g2 s2, g2 c2 - g1 s1) per halves, one kernel call
for both; given q and k (the forward saves them only when cos or sin
require grad), dcos and dsin are the sums over heads of g * x and of
g * rotate_half(x), reduced to cos's shape, by torch in float32 inside the
op (empty without q and k).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::rotary_embedding"
BACKWARD_OP = "pallas::rotary_embedding_backward"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call views its tensors: `head_axis` is q's head dimension,
    q's leading dimensions before it multiply to `a`, those between it and
    D to `m`; `heads_inner` when q lies in memory with each token's heads
    together (then N1 = a * m tokens, N2 = 1; else N1 = a, N2 = m)."""

    head_axis: int
    a: int
    m: int
    heads_inner: bool

    @property
    def tokens(self) -> tuple:
        """(N1, N2)."""
        return (self.a * self.m, 1) if self.heads_inner else (self.a, self.m)

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        """q, k or a gradient as (N1, H, N2, D): a view where x lies so."""
        (n1, n2), heads, d = self.tokens, x.shape[self.head_axis], x.shape[-1]
        if self.heads_inner:
            return x.movedim(self.head_axis, -2).contiguous().view(n1, heads, n2, d)
        if x.shape == (n1, heads, n2, d) and x.is_contiguous():
            return x  # as the kernel reads it (a decode step's q and k): no view to make
        return x.contiguous().view(n1, heads, n2, d)

    def result(self, out: torch.Tensor, shape) -> torch.Tensor:
        """A kernel's (N1, H, N2, D) result as a tensor of `shape`, laid out
        as the operand was read."""
        if self.heads_inner:
            moved = (*shape[:self.head_axis], *shape[self.head_axis + 1:-1],
                     shape[self.head_axis], shape[-1])
            return out.view(moved).movedim(-2, self.head_axis)
        return checks.shaped(out, shape)

    def empty(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """What `result` makes of a kernel's result for `like` (q, k or a
        gradient), as an empty tensor: the fake's, its strides computed
        (cheaper for symbolic sizes than the views that give them)."""
        dims = like.dim()
        order = list(range(dims))
        if self.heads_inner:
            order = [*order[:self.head_axis], *order[self.head_axis + 1:-1], self.head_axis,
                     dims - 1]
        strides, step = [0] * dims, 1
        for dim in reversed(order):
            strides[dim] = step
            step = step * like.shape[dim]
        return like.new_empty_strided(like.shape, strides, dtype=dtype)

    def angles(self, table: torch.Tensor, shape) -> torch.Tensor:
        """cos or sin as (N1, N2, D), contiguous: unsqueezed at the head
        axis, broadcast to `shape` (q's) without its heads."""
        if table.shape == (*self.tokens, shape[-1]) and table.is_contiguous():
            # Unsqueezing and expanding to as many elements, then reshaping
            # to its own shape, keeps every element where it is.
            return table
        unsqueezed = table.reshape(broadcast_shape(table, self.head_axis, len(shape)))
        expanded = unsqueezed.expand(*shape[:self.head_axis], 1, *shape[self.head_axis + 1:])
        return expanded.reshape(*self.tokens, shape[-1]).contiguous()


def broadcast_shape(table: torch.Tensor, head_axis: int, dims: int) -> tuple:
    """cos's (or sin's) shape once unsqueezed at the head axis and padded
    with leading 1s to q's `dims` dimensions, as broadcasting sees it."""
    shape = (1,) * (dims - table.dim() - 1) + tuple(table.shape)
    return (*shape[:head_axis], 1, *shape[head_axis:])


def _position(unsqueeze_dim, cos) -> int:
    """Where cos.unsqueeze(unsqueeze_dim) puts its new dimension. A
    compiled graph's unsqueeze_dim (a SymInt under dynamic shapes) is made
    a constant: the dimension decides the layout."""
    unsqueeze_dim = int(unsqueeze_dim)
    return unsqueeze_dim + cos.dim() + 1 if unsqueeze_dim < 0 else unsqueeze_dim


def _plan(op: str, names: tuple[str, str], q, k, cos, sin, unsqueeze_dim) -> Plan:
    """Checks a call's arguments (q and k named `names`) and plans it."""
    for name, t in zip((*names, "cos", "sin"), (q, k, cos, sin)):
        checks.tensor(op, name, t)
        checks.dtype_in(op, name, t.dtype, DTYPES)
    checks.same_dtype(op, q, k, names=names)
    checks.same_dtype(op, cos, sin, names=("cos", "sin"))
    for name, t in zip((names[1], "cos", "sin"), (k, cos, sin)):
        checks.same_device(op, q, t, names=(names[0], name))
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, (int, torch.SymInt)):
        raise TypeError(f"{op}: unsqueeze_dim must be an int, got {unsqueeze_dim!r}")
    if cos.shape != sin.shape:
        raise checks.RefusedLikeTorch(
            f"{op}: cos.shape={tuple(cos.shape)} and sin.shape={tuple(sin.shape)} must be equal")
    dims = q.dim()
    if not 1 <= cos.dim() <= dims - 1:
        raise checks.RefusedLikeTorch(
            f"{op}: cos.dim()={cos.dim()} must be between 1 and {names[0]}.dim() - 1 = "
            f"{dims - 1} (cos.unsqueeze(unsqueeze_dim) broadcasts to {names[0]}); got "
            f"{names[0]}.shape={tuple(q.shape)}, cos.shape={tuple(cos.shape)}")
    position = _position(unsqueeze_dim, cos)
    if not 0 <= position < cos.dim():
        raise checks.RefusedLikeTorch(
            f"{op}: unsqueeze_dim={unsqueeze_dim} must name a dimension of cos.unsqueeze(...) "
            f"before the last (the heads' axis; cos.dim()={cos.dim()}: from "
            f"{-cos.dim() - 1} to {cos.dim() - 1})")
    head_axis = position + dims - cos.dim() - 1  # cos padded to q's dimensions
    if k.dim() != dims or any(a != b for i, (a, b) in enumerate(zip(q.shape, k.shape))
                              if i != head_axis):
        raise checks.RefusedLikeTorch(
            f"{op}: {names[0]}.shape={tuple(q.shape)} and {names[1]}.shape={tuple(k.shape)} "
            f"must be equal but for the heads (dimension {head_axis})")
    if q.shape[-1] % 2:
        raise checks.RefusedLikeTorch(
            f"{op}: {names[0]}.shape[-1]={q.shape[-1]} must be even (its halves rotate)")
    angles = broadcast_shape(cos, head_axis, dims)
    if any(c != 1 and c != s for c, s in zip(angles, q.shape)):
        raise checks.RefusedLikeTorch(
            f"{op}: cos.shape={tuple(cos.shape)} unsqueezed at unsqueeze_dim={unsqueeze_dim} "
            f"must broadcast to {names[0]}.shape={tuple(q.shape)} (each size 1 or "
            f"{names[0]}'s)")
    a = math.prod(q.shape[:head_axis])
    m = math.prod(q.shape[head_axis + 1:-1])
    heads_inner = (m != 1 and not q.is_contiguous()
                   and q.movedim(head_axis, -2).is_contiguous())
    return Plan(head_axis, a, m, heads_inner)


def _rotate(kernel: str, op: str, names, x, y, cos, sin, unsqueeze_dim):
    """The kernel's rotation of x and y (q and k, or their gradients)."""
    plan = _plan(op, names, x, y, cos, sin, unsqueeze_dim)
    dtype = torch.promote_types(x.dtype, cos.dtype)
    if x.numel() == 0 and y.numel() == 0:
        return x.new_empty(x.shape, dtype=dtype), y.new_empty(y.shape, dtype=dtype)
    # a kernel needs heads on both sides: an empty one takes the other's place
    xs = (x if x.numel() else y, y if y.numel() else x)
    outs = launch.run(kernel, x.device, (*(plan.operand(t) for t in xs),
                                         plan.angles(cos, x.shape), plan.angles(sin, x.shape)),
                      {})
    return tuple(plan.result(o, t.shape) if t.numel() else t.new_empty(t.shape, dtype=dtype)
                 for o, t in zip(outs, (x, y)))


def _fake(op: str, names, x, y, cos, sin, unsqueeze_dim):
    """Results as the kernels lay them out (fresh, in x's layout where it
    is read in place)."""
    plan = _plan(op, names, x, y, cos, sin, unsqueeze_dim)
    dtype = torch.promote_types(x.dtype, cos.dtype)
    return plan.empty(x, dtype), plan.empty(y, dtype)


def rotary_embedding_implementation(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                                    sin: torch.Tensor, unsqueeze_dim: int = 1
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate("rotary_embedding", OP, ("q", "k"), q, k, cos, sin, unsqueeze_dim)


def rotary_embedding_fake(q, k, cos, sin, unsqueeze_dim=1):
    return _fake(OP, ("q", "k"), q, k, cos, sin, unsqueeze_dim)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, *rest = inputs  # unsqueeze_dim left out where it is the default
    ctx.unsqueeze_dim = rest[0] if rest else 1
    ctx.dtypes = (q.dtype, k.dtype)
    # q and k are kept only for the angles' gradients
    angles_need_grad = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(*((q, k) if angles_need_grad else (None, None)), cos, sin)


def _backward(ctx, grad_q, grad_k):
    q, k, cos, sin = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if not any(needs[:4]):
        return None, None, None, None, None
    dq, dk, dcos, dsin = torch.ops.pallas.rotary_embedding_backward(
        grad_q, grad_k, cos, sin, ctx.unsqueeze_dim, q, k)
    return (dq.to(ctx.dtypes[0]) if needs[0] else None,
            dk.to(ctx.dtypes[1]) if needs[1] else None,
            dcos if needs[2] else None, dsin if needs[3] else None, None)


registration.define(OP, rotary_embedding_implementation, fake=rotary_embedding_fake,
                    backward=_backward, setup_context=_setup_context)


def _check_inputs(grad_q, grad_k, q, k) -> None:
    """The backward's q and k: both or neither, shaped as their gradients."""
    if (q is None) != (k is None):
        raise ValueError(f"{BACKWARD_OP}: q and k must be given together (for the angles' "
                         f"gradients) or not at all; got q={'a tensor' if q is not None else None}"
                         f", k={'a tensor' if k is not None else None}")
    for name, x, g in (("q", q, grad_q), ("k", k, grad_k)):
        if x is None:
            continue
        checks.tensor(BACKWARD_OP, name, x)
        checks.dtype_in(BACKWARD_OP, name, x.dtype, DTYPES)
        checks.same_device(BACKWARD_OP, g, x, names=(f"grad_{name}", name))
        if x.shape != g.shape:
            raise checks.RefusedLikeTorch(
                f"{BACKWARD_OP}: {name}.shape={tuple(x.shape)} must equal "
                f"grad_{name}.shape={tuple(g.shape)}")


def backward_implementation(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, unsqueeze_dim: int = 1,
                            q: torch.Tensor | None = None, k: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(grad_q, grad_k, q, k)
    dq, dk = _rotate("rotary_embedding_backward", BACKWARD_OP, ("grad_q", "grad_k"), grad_q,
                     grad_k, cos, sin, unsqueeze_dim)
    if q is None:
        return dq, dk, cos.new_empty((0,)), sin.new_empty((0,))
    return dq, dk, *angle_gradients(grad_q, grad_k, q, k, cos, unsqueeze_dim)


def _backward_fake(grad_q, grad_k, cos, sin, unsqueeze_dim=1, q=None, k=None):
    _check_inputs(grad_q, grad_k, q, k)
    dq, dk = _fake(BACKWARD_OP, ("grad_q", "grad_k"), grad_q, grad_k, cos, sin, unsqueeze_dim)
    angles_shape = (0,) if q is None else cos.shape
    return dq, dk, cos.new_empty(angles_shape), sin.new_empty(angles_shape)


# Within the op, the angles' gradients are torch's eager code on the CPU:
# compiled into a graph instead, each layout of q cost Inductor seconds of C++.
registration.define(BACKWARD_OP, backward_implementation, fake=_backward_fake)


def angle_gradients(grad_q, grad_k, q, k, cos, unsqueeze_dim):
    """(dcos, dsin) in cos's dtype and shape: the sums over heads (and over
    the dimensions cos broadcasts along) of g * x and g * rotate_half(x),
    in float32."""
    dims = q.dim()
    head_axis = _position(unsqueeze_dim, cos) + dims - cos.dim() - 1
    dcos = dsin = 0
    for g, x in ((grad_q, q), (grad_k, k)):
        g, x = g.float(), x.float()
        dcos = dcos + (g * x).sum(head_axis, keepdim=True)
        dsin = dsin + (g * rotate_half(x)).sum(head_axis, keepdim=True)
    shape = broadcast_shape(cos, head_axis, dims)
    return tuple(t.sum_to_size(shape).reshape(cos.shape).to(cos.dtype) for t in (dcos, dsin))


# torch.ops.pallas.rotary_embedding, skipping the dispatcher on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.rotary_embedding.default)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed): transformers' `apply_rotary_pos_emb(q, k, cos,
    sin, unsqueeze_dim=unsqueeze_dim)` fused (float32 inside, rounded
    once); differentiable in q, k, cos and sin."""
    return _call(q, k, cos, sin, unsqueeze_dim)


def rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim=1, q=None, k=None):
    """(dq, dk, dcos, dsin) of rotary_embedding: the transposed rotation of
    the gradients, in the dtype they and cos promote to; dcos and dsin from
    q and k when they are given, else empty."""
    return torch.ops.pallas.rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim,
                                                      q, k)


# --- torch's composition, references and examples -----------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def torch_rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    """torch's composition, transformers' `apply_rotary_pos_emb`, which the
    op replaces."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def reference(q, k, cos, sin, unsqueeze_dim=1) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_rotary_embedding(*(t.detach().cpu().double() for t in (q, k, cos, sin)),
                                  unsqueeze_dim)


def error_bound(x, cos, sin, ref, unsqueeze_dim=1, transpose=False, dtype=None) -> torch.Tensor:
    """Elementwise bound on |pallas - ref| for the rotation of x by cos and
    sin (or its transpose): two float32 products and a sum, relative to
    the products' size, then one rounding to `dtype` (by default the dtype
    x and cos promote to; an absolute term for float16's subnormals)."""
    rounding = dtypes.ROUNDING[dtype or torch.promote_types(x.dtype, cos.dtype)]
    x, cos, sin = (t.detach().cpu().double().abs() for t in (x, cos, sin))
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    # |x1 c1| + |x2 s1| beside |x2 c2| + |x1 s2| (transposed: |x2 s2|, |x1 s1|)
    crossed = swap_halves(x * sin) if transpose else swap_halves(x) * sin
    return (x * cos + crossed) * 4 * 2.0**-24 + ref.abs() * rounding + 1e-7


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, x1), dim=-1)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A bfloat16 call as transformers makes it (q (B, H, S, D), fewer kv
    heads, cos (1, S, D) for a batch of 2; D = 6, ragged), and a float32
    one with the heads after the tokens (unsqueeze_dim=2, D = 10), its
    angles requiring grad too."""
    found = []
    cases = (((2, 3, 5, 6), (2, 1, 5, 6), (1, 5, 6), 1, torch.bfloat16, False),
             ((2, 4, 2, 10), (2, 4, 1, 10), (2, 4, 10), 2, torch.float32, True))
    for q_shape, k_shape, angles_shape, dim, dtype, angles_grad in cases:
        q, k, cos, sin = (torch.randn(shape, device=device).to(dtype)
                          for shape in (q_shape, k_shape, angles_shape, angles_shape))
        for t in (q, k, cos, sin) if angles_grad else (q, k):
            t.requires_grad_(requires_grad)
        ref = reference(q, k, cos, sin, dim)
        bounds = tuple(error_bound(x, cos, sin, r, dim) for x, r in zip((q, k), ref))
        found.append(registry.Example((q, k, cos, sin, dim), {}, ref, bounds))
    return found


registry.register(registry.OpInfo(
    name="rotary_embedding",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.rotary_embedding",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.rotary_embedding",
        "triton": "torch_pallas.kernels.triton.rotary_embedding",
    },
    function=rotary_embedding,
    torch_function=torch_rotary_embedding,
    examples=examples,
))


def reference_gradients(grad_q, grad_k, cos, sin, unsqueeze_dim=1, q=None, k=None):
    """(dq, dk, dcos, dsin) in float64; dcos and dsin at q and k, empty
    without them. The rotation is linear in q and k: dq and dk are the
    same at any point (without q and k, taken at the gradients)."""
    point = (grad_q, grad_k) if q is None else (q, k)
    q64, k64, cos64, sin64 = (t.detach().cpu().double().requires_grad_()
                              for t in (*point, cos, sin))
    outs = torch_rotary_embedding(q64, k64, cos64, sin64, unsqueeze_dim)
    grads = torch.autograd.grad(outs, (q64, k64, cos64, sin64),
                                tuple(g.detach().cpu().double() for g in (grad_q, grad_k)))
    if q is None:
        empty = torch.zeros(0, dtype=torch.float64)
        return (*grads[:2], empty, empty)
    return grads


def angle_error_bounds(grad_q, grad_k, q, k, cos, unsqueeze_dim, dcos, dsin) -> tuple:
    """Elementwise bounds on |pallas - reference| for dcos and dsin: float32
    sums of as many products as heads and broadcast dimensions hold,
    relative to the sum of the products' sizes, then one rounding to cos's
    dtype."""
    g_q, g_k, x_q, x_k = (t.detach().cpu().double().abs() for t in (grad_q, grad_k, q, k))
    terms = (grad_q.numel() + grad_k.numel()) / cos.numel()
    bounds = []
    # dcos sums |g x|, dsin |g rotate_half(x)| = |g| swap_halves(|x|)
    for ref, (a, b) in ((dcos, (x_q, x_k)), (dsin, (swap_halves(x_q), swap_halves(x_k)))):
        magnitude, _ = angle_gradients(g_q, g_k, a, b, cos.double(), unsqueeze_dim)
        bounds.append(magnitude * (terms + 2) * 2.0**-24 + ref.abs() * dtypes.ROUNDING[cos.dtype]
                      + 1e-7)
    return tuple(bounds)


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 call (D = 34) with its q and k (the
    angles' gradients too), and of a float32 one with the heads after the
    tokens. None that require grad: the op has no backward of its own, and
    the same calls without would be run twice on every backend."""
    if requires_grad:
        return []
    found = []
    cases = (((1, 4, 7, 34), (1, 2, 7, 34), (1, 7, 34), 1, torch.float16, True),
             ((3, 2, 3, 6), (3, 2, 1, 6), (3, 2, 6), 2, torch.float32, False))
    for q_shape, k_shape, angles_shape, dim, dtype, angles in cases:
        grad_q, grad_k, cos, sin, q, k = (
            torch.randn(shape, device=device).to(dtype)
            for shape in (q_shape, k_shape, angles_shape, angles_shape, q_shape, k_shape))
        q, k = (q, k) if angles else (None, None)
        expected = reference_gradients(grad_q, grad_k, cos, sin, dim, q, k)
        bounds = tuple(error_bound(g, cos, sin, r, dim, transpose=True)
                       for g, r in zip((grad_q, grad_k), expected))
        bounds += (angle_error_bounds(grad_q, grad_k, q, k, cos, dim, *expected[2:])
                   if angles else (0.0, 0.0))
        found.append(registry.Example((grad_q, grad_k, cos, sin, dim, q, k), {}, expected,
                                      bounds))
    return found


registry.register(registry.OpInfo(
    name="rotary_embedding_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.rotary_embedding_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.rotary_embedding_backward",
        "triton": "torch_pallas.kernels.triton.rotary_embedding_backward",
    },
    function=rotary_embedding_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
