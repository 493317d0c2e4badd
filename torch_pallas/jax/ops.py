"""The JAX-side forms of the elementwise, row and matrix ops: functions of
JAX arrays with the torch ops' semantics, forward through the ops' TPU
kernels and gradients through their backward kernels (`jax.custom_vjp`:
never autodiff through a Pallas kernel), jit-traceable.

Each takes what the torch op's kernels take (calls.run with the same
parameters), so a value here is the torch op's value on the same backend.
"""

from __future__ import annotations

import functools

from torch_pallas.base import jax_env
from torch_pallas.jax import calls
from torch_pallas.kernels.rms_norm_casting import Casting

jax = jax_env.jax()
jnp = jax.numpy

FLOATS = ("float32", "float16", "bfloat16")


def _float_dtype(op: str, name: str, x) -> None:
    if jnp.dtype(x.dtype).name not in FLOATS:
        raise TypeError(f"{op}: {name} has dtype {jnp.dtype(x.dtype).name}; "
                        f"expected one of {', '.join(FLOATS)}")


def _same_dtype(op: str, names: tuple[str, str], x, y) -> None:
    if x.dtype != y.dtype:
        raise TypeError(f"{op}: {names[0]} has dtype {jnp.dtype(x.dtype).name}, {names[1]} "
                        f"{jnp.dtype(y.dtype).name}; they must be the same")


def _summed_to(g, shape):
    """A broadcast result's gradient summed back to an operand's shape."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(i + lead for i, s in enumerate(shape)
                                      if s == 1 and g.shape[i + lead] != 1)
    return g.sum(axes).reshape(shape) if axes else g


# --- fill, iota, add -----------------------------------------------------------

def _kernel_dtype(op: str, dtype) -> str:
    """dtype's name, refusing a 64-bit one while JAX's 64-bit mode is off
    (JAX would narrow it to 32 bits)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise TypeError(f"{op}: dtype={dtype.name} needs JAX's 64-bit mode "
                        "(jax.config.update('jax_enable_x64', True)); ask for a 32-bit dtype")
    return dtype.name


def fill(shape, value, dtype="float32"):
    """An array of `shape` holding `value`, written by the fill kernel."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    return calls.run("fill", shape=shape, value=value,
                     dtype=_kernel_dtype("torch_pallas.jax.fill", dtype))


def iota(n: int, dtype="int32"):
    """[0, 1, ..., n - 1], written by the iota kernel."""
    return calls.run("iota", n=int(n), dtype=_kernel_dtype("torch_pallas.jax.iota", dtype))


def add(x, y):
    """x + y for arrays of one dtype (a float one, or int32), broadcast as
    jnp.add does; differentiable in float x and y."""
    op = "torch_pallas.jax.add"
    _same_dtype(op, ("x", "y"), x, y)
    if jnp.dtype(x.dtype).name == "int32":
        return _add_kernel(x, y)
    _float_dtype(op, "x", x)
    return _add(x, y)


def _add_kernel(x, y):
    return calls.run("add", x, y, out_shape=tuple(jnp.broadcast_shapes(x.shape, y.shape)))


@jax.custom_vjp
def _add(x, y):
    return _add_kernel(x, y)


def _add_forward(x, y):
    return _add_kernel(x, y), (x.shape, y.shape)


def _add_backward(shapes, g):
    return tuple(_summed_to(g, shape) for shape in shapes)


_add.defvjp(_add_forward, _add_backward)


# --- matmul --------------------------------------------------------------------

def matmul(a, b):
    """a @ b with jnp.matmul's semantics (1-D operands, broadcast batch
    dimensions), accumulated in float32 and returned in the operands'
    dtype; float32 multiplied in full."""
    op = "torch_pallas.jax.matmul"
    _same_dtype(op, ("a", "b"), a, b)
    _float_dtype(op, "a", a)
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"{op}: a and b need a dimension or more, got a.shape={a.shape}, "
                         f"b.shape={b.shape}")
    if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise ValueError(f"{op}: a.shape={a.shape} and b.shape={b.shape} do not multiply")
    if a.ndim == 1:
        return matmul(a[None], b)[..., 0, :] if b.ndim > 1 else matmul(a[None], b[:, None])[0, 0]
    if b.ndim == 1:
        return _matmul(a, b[:, None])[..., 0]
    return _matmul(a, b)


def _operands(a, b):
    """(a3, b3, output shape): a and b as the kernel's (B, M, K) and
    (B or 1, K, N), a's batch folded into its rows where b is a matrix."""
    m, n = a.shape[-2], b.shape[-1]
    if b.ndim == 2:
        return a.reshape(1, -1, a.shape[-1]), b[None], (*a.shape[:-1], n)
    batch = tuple(jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    a3 = jnp.broadcast_to(a, (*batch, *a.shape[-2:])).reshape(-1, m, a.shape[-1])
    b3 = jnp.broadcast_to(b, (*batch, *b.shape[-2:])).reshape(-1, b.shape[-2], n)
    return a3, b3, (*batch, m, n)


def _product(a3, b3, transpose_a=False, transpose_b=False):
    return calls.run("matmul", a3, b3, transpose_a=transpose_a, transpose_b=transpose_b)


@jax.custom_vjp
def _matmul(a, b):
    a3, b3, shape = _operands(a, b)
    return _product(a3, b3).reshape(shape)


def _matmul_forward(a, b):
    return _matmul(a, b), (a, b)


def _matmul_backward(saved, g):
    a, b = saved
    a3, b3, _ = _operands(a, b)
    g3 = g.reshape(a3.shape[0], a3.shape[1], b3.shape[2]).astype(a.dtype)
    da = _product(g3, b3, transpose_b=True)  # g @ bᵀ
    db = _product(a3, g3, transpose_a=True)  # aᵀ @ g
    if b.ndim == 2:
        return da.reshape(a.shape), db[0]
    batch = g.shape[:-2]
    da = _summed_to(da.reshape(*batch, *a.shape[-2:]), a.shape)
    db = _summed_to(db.reshape(*batch, *b.shape[-2:]), b.shape)
    return da, db


_matmul.defvjp(_matmul_forward, _matmul_backward)


# --- grouped_mm ------------------------------------------------------------------

def grouped_mm(lhs, rhs, group_ends, bias=None, *, out_dtype=None):
    """Each group's rows of lhs (M, K) times its matrix of rhs (G, K, N):
    rows group_ends[g - 1] <= r < group_ends[g] use rhs[g] (group_ends (G,)
    cumulative, non-decreasing; rows past group_ends[-1] are zero), as
    torch's F.grouped_mm with offs, float32 accumulation, the result in
    `out_dtype` (lhs's dtype by default; float32 for 16-bit inputs), with
    each group's row of `bias` (G, N) added. Differentiable in lhs, rhs and
    bias."""
    op = "torch_pallas.jax.grouped_mm"
    _same_dtype(op, ("lhs", "rhs"), lhs, rhs)
    _float_dtype(op, "lhs", lhs)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_ends.ndim != 1:
        raise ValueError(f"{op}: takes lhs (M, K), rhs (G, K, N) and group_ends (G,); got "
                         f"{lhs.shape}, {rhs.shape}, {group_ends.shape}")
    if lhs.shape[1] != rhs.shape[1] or rhs.shape[0] != group_ends.shape[0]:
        raise ValueError(f"{op}: lhs.shape={lhs.shape}, rhs.shape={rhs.shape} and "
                         f"group_ends.shape={group_ends.shape} must share K and G")
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype).name
    if out_dtype not in (jnp.dtype(lhs.dtype).name, "float32"):
        raise TypeError(f"{op}: out_dtype={out_dtype} must be lhs's dtype or float32")
    if bias is not None and (bias.shape != (rhs.shape[0], rhs.shape[2])
                             or bias.dtype not in (lhs.dtype, jnp.dtype(out_dtype))):
        raise ValueError(f"{op}: bias must be (G, N) = {(rhs.shape[0], rhs.shape[2])} in lhs's "
                         f"or the output's dtype; got {bias.shape} {jnp.dtype(bias.dtype).name}")
    return _grouped_mm(lhs, rhs, group_ends.astype(jnp.int32), bias, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_mm(lhs, rhs, ends, bias, out_dtype):
    extra = () if bias is None else (bias.astype(jnp.float32),)
    return calls.run("grouped_mm", lhs, rhs, ends, *extra, transpose_rhs=False,
                     out_dtype=out_dtype)


def _grouped_mm_forward(lhs, rhs, ends, bias, out_dtype):
    return _grouped_mm(lhs, rhs, ends, bias, out_dtype), (lhs, rhs, ends, bias)


def _grouped_mm_backward(out_dtype, saved, g):
    lhs, rhs, ends, bias = saved
    dtype = jnp.dtype(lhs.dtype).name
    dy = g.astype(lhs.dtype)  # one rounding of a float32 output's gradient
    d_lhs = calls.run("grouped_mm", dy, rhs, ends, transpose_rhs=True, out_dtype=dtype)
    d_rhs = calls.run("grouped_mm_backward", lhs, dy, ends, out_dtype=dtype)
    d_bias = None
    if bias is not None:  # each group's rows of g summed; rows past ends[-1] in none
        group = jnp.searchsorted(ends, jnp.arange(g.shape[0], dtype=jnp.int32), side="right")
        d_bias = jax.ops.segment_sum(g.astype(jnp.float32), group, num_segments=ends.shape[0])
        d_bias = d_bias.astype(bias.dtype)
    return d_lhs, d_rhs, None, d_bias


_grouped_mm.defvjp(_grouped_mm_forward, _grouped_mm_backward)


# --- rms_norm and layer_norm, over the last dimension ----------------------------

CASTINGS = {casting.value: casting for casting in Casting}


def rms_norm(x, weight=None, eps=None, *, casting_mode="none"):
    """RMS norm over x's last dimension, as torch_pallas.rms_norm with
    normalized_shape (x.shape[-1],): statistics in float32, `casting_mode`
    "none" (F.rms_norm), "llama" or "gemma" (see torch_pallas.rms_norm),
    `eps` None is the dtype's machine epsilon. Differentiable in x and
    weight."""
    op = "torch_pallas.jax.rms_norm"
    _float_dtype(op, "x", x)
    casting = CASTINGS.get(casting_mode) if isinstance(casting_mode, str) else None
    if casting is None:
        raise ValueError(f"{op}: casting_mode={casting_mode!r} is not a casting mode; choose "
                         f"one of {', '.join(map(repr, CASTINGS))}")
    if casting.offsets_weight and weight is None:
        raise ValueError(f"{op}: casting_mode={casting_mode!r} needs a weight; got weight=None")
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"{op}: weight.shape={weight.shape} must be ({x.shape[-1]},)")
    eps = float(jnp.finfo(x.dtype).eps if eps is None else eps)
    return rms_norm_forward(x, weight, eps, casting)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm_forward(x, weight, eps: float, casting: Casting):
    """pallas::rms_norm_forward: (out, rstd) over x's last dimension, rstd
    (...) float32; differentiable in x and weight through out."""
    inputs = (x,) if weight is None else (x, weight)
    return tuple(calls.run("rms_norm", *inputs, eps=eps, casting=casting))


def _rms_norm_vjp_forward(x, weight, eps, casting):
    out, rstd = rms_norm_forward(x, weight, eps, casting)
    return (out, rstd), (x, weight, rstd)


def rms_norm_backward(g, x, rstd, weight, casting: Casting):
    """pallas::rms_norm_backward: (dx, dw) from out's gradient, dw in the
    weight's dtype (empty float32 without a weight)."""
    n = x.shape[-1]
    inputs = (g.reshape(-1, n), x.reshape(-1, n), rstd.reshape(-1))
    dx, dw = calls.run("rms_norm_backward", *inputs, *(() if weight is None else (weight,)),
                       casting=casting)
    return dx.reshape(x.shape), dw


def _rms_norm_vjp_backward(eps, casting, saved, g):
    x, weight, rstd = saved
    dx, dw = rms_norm_backward(g[0], x, rstd, weight, casting)
    return dx, None if weight is None else dw


rms_norm_forward.defvjp(_rms_norm_vjp_forward, _rms_norm_vjp_backward)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """Layer norm over x's last dimension, as F.layer_norm with
    normalized_shape (x.shape[-1],): statistics in float32, the result in
    x's dtype. Differentiable in x, weight and bias."""
    op = "torch_pallas.jax.layer_norm"
    _float_dtype(op, "x", x)
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (n,):
            raise ValueError(f"{op}: {name}.shape={p.shape} must be ({n},)")
    return layer_norm_forward(x, jnp.ones((n,), x.dtype) if weight is None else weight,
                              jnp.zeros((n,), x.dtype) if bias is None else bias, float(eps))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm_forward(x, weight, bias, eps: float):
    """pallas::layer_norm_forward: (out, mean, rstd) over x's last
    dimension, mean and rstd (...) float32; differentiable through out."""
    return tuple(calls.run("layer_norm", x, weight, bias, eps=eps))


def _layer_norm_vjp_forward(x, weight, bias, eps):
    out, mean, rstd = layer_norm_forward(x, weight, bias, eps)
    return (out, mean, rstd), (x, weight, bias, mean, rstd)


def layer_norm_backward(g, x, mean, rstd, weight):
    """pallas::layer_norm_backward: (dx, dw, db), dw and db float32."""
    n = x.shape[-1]
    dx, dw, db = calls.run("layer_norm_backward", g.reshape(-1, n), x.reshape(-1, n),
                           mean.reshape(-1), rstd.reshape(-1), weight)
    return dx.reshape(x.shape), dw, db


def _layer_norm_vjp_backward(eps, saved, g):
    x, weight, bias, mean, rstd = saved
    dx, dw, db = layer_norm_backward(g[0], x, mean, rstd, weight)
    return dx, dw.astype(weight.dtype), db.astype(bias.dtype)


layer_norm_forward.defvjp(_layer_norm_vjp_forward, _layer_norm_vjp_backward)


# --- swiglu and rotary embeddings ------------------------------------------------

@jax.custom_vjp
def swiglu(gate, up):
    """silu(gate) * up for arrays of one shape and float dtype."""
    op = "torch_pallas.jax.swiglu"
    _same_dtype(op, ("gate", "up"), gate, up)
    _float_dtype(op, "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate.shape={gate.shape} and up.shape={up.shape} must be equal")
    return calls.run("swiglu", gate, up)


def _swiglu_forward(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_backward(saved, g):
    return tuple(calls.run("swiglu_backward", g, *saved))


swiglu.defvjp(_swiglu_forward, _swiglu_backward)


def rotary_embedding(q, k, cos, sin):
    """(q_embed, k_embed) = (x * cos + rotate_half(x) * sin for x in q, k),
    transformers' apply_rotary_pos_emb with unsqueeze_dim=1: q (B, Hq, L, D),
    k (B, Hk, L, D), cos and sin broadcastable to (B, L, D); the results
    in the dtype q and cos promote to. Differentiable in all four."""
    op = "torch_pallas.jax.rotary_embedding"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _float_dtype(op, name, t)
    _same_dtype(op, ("q", "k"), q, k)
    _same_dtype(op, ("cos", "sin"), cos, sin)
    if q.ndim != 4 or k.ndim != 4 or q.shape[::2] != k.shape[::2] or q.shape[-1] % 2:
        raise ValueError(f"{op}: q (B, Hq, L, D) and k (B, Hk, L, D), D even; got "
                         f"q.shape={q.shape}, k.shape={k.shape}")
    angles = (q.shape[0], q.shape[2], q.shape[3])
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos.shape={cos.shape} and sin.shape={sin.shape} must be equal")
    try:
        jnp.broadcast_shapes(cos.shape, angles)
    except ValueError:
        raise ValueError(f"{op}: cos.shape={cos.shape} must broadcast to (B, L, D) = "
                         f"{angles}") from None
    # broadcast_to's own gradient sums the angles' gradients back to cos's shape
    return _rotary(q, k, jnp.broadcast_to(cos, angles), jnp.broadcast_to(sin, angles))


@jax.custom_vjp
def _rotary(q, k, cos, sin):
    return tuple(calls.run("rotary_embedding", q, k, cos, sin))


def _rotary_forward(q, k, cos, sin):
    return _rotary(q, k, cos, sin), (q, k, cos, sin)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate((-x[..., half:], x[..., :half]), axis=-1)


def _rotary_backward(saved, g):
    q, k, cos, sin = saved
    gq, gk = g
    dq, dk = calls.run("rotary_embedding_backward", gq, gk, cos, sin)
    # d cos = Σ_heads g * x, d sin = Σ_heads g * rotate_half(x), in float32
    f32 = jnp.float32
    d_cos = sum((gx.astype(f32) * x.astype(f32)).sum(1) for gx, x in ((gq, q), (gk, k)))
    d_sin = sum((gx.astype(f32) * _rotate_half(x).astype(f32)).sum(1)
                for gx, x in ((gq, q), (gk, k)))
    return (dq.astype(q.dtype), dk.astype(k.dtype),
            d_cos.astype(cos.dtype), d_sin.astype(sin.dtype))


_rotary.defvjp(_rotary_forward, _rotary_backward)
