"""torch_pallas's ops in torchax models: torch tensors backed by JAX arrays
(device "jax"), run eagerly or compiled by `torchax.compile` (jax.jit).

torchax runs a torch op it knows through a JAX implementation; the ops
here it does not know, and their CPU kernels cannot take its tensors.
`register()` gives it each public op (`torch.ops.pallas.*`, and
`attention_forward`, which transformers' padding-free path calls): the op's
JAX-side form (torch_pallas.jax, the same kernels), through torchax's
public `Environment.override_op_definition`, wrapped in a
torch.autograd.Function around `jax.vjp` of the form, so that torch's
autograd (eager `loss.backward()`) and JAX's (`jax.grad` of a compiled
model) both reach the ops' backward kernels through the forms'
`jax.custom_vjp`. (torchax's own `interop.j2t_autograd` would hand the
function torch tensors: it passes it through `call_jax`, whose argument
conversion turns a callable into a torch-side one.)

    import torchax, torch_pallas.torchax
    torch_pallas.torchax.register()          # torchax.default_env()
    with torchax.default_env():
        model.to("jax"); loss = model(**batch).loss; loss.backward()

What the JAX-side forms do not take is refused with the op's name and the
argument: a dense attention mask (a padded batch's is served as packed
sequences: transformers' pallas attention sends it so) or dropout, rotary angles unsqueezed elsewhere
than before the heads or the sequence.

torchax 0.0.13 imports only on torch < 2.13 (it names an aten overload
torch 2.13 removed); `register()` then raises ImportError saying so, and
torch_pallas itself imports as ever.

Imports: `torch_pallas.jax` and the op files' casting table; torchax
inside `register`.
"""

from __future__ import annotations

import importlib
import inspect
import math

import torch

from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.ops import attention_spans

_registered: set[int] = set()  # id() of the environments registered


def _jax():
    import torch_pallas.jax as forms

    return forms


def _refuse(op: str, problem: str):
    raise NotImplementedError(f"{op}: under torchax {problem}")


# --- each op's JAX implementation, in the torch op's signature ---------------

def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
              enable_gqa=False, window_size=(-1, -1), softcap=0.0, sinks=None):
    op = "pallas::attention"
    if attn_mask is not None:
        _refuse(op, "attn_mask is not supported: the kernels' dense mask has no JAX-side "
                f"form ({attention_spans.PADDING_SERVED})")
    if dropout_p:
        _refuse(op, f"dropout_p={dropout_p} is not supported (only 0)")
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"{op}: query has {query.shape[-3]} heads and key {key.shape[-3]}; "
                         "grouped query heads need enable_gqa=True")
    return _jax().attention(query, key, value, is_causal=is_causal, scale=scale,
                            window_size=window_size, softcap=softcap, sinks=sinks)


def attention_forward(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=None, window_left=-1,
                      window_right=-1, softcap=0.0, sinks=None, cu_seq_q=None, cu_seq_k=None,
                      max_q=0, max_k=0):
    op = "pallas::attention_forward"
    if mask is not None:
        _refuse(op, "mask is not supported: the kernels' dense mask has no JAX-side form "
                f"({attention_spans.PADDING_SERVED})")
    if dropout_p:
        _refuse(op, f"dropout_p={dropout_p} is not supported (only 0)")
    # the module (torch_pallas.jax's `attention` attribute is the function)
    forms = importlib.import_module("torch_pallas.jax.attention")
    static = forms.Static(float(scale), bool(is_causal), int(window_left), int(window_right),
                          float(softcap))
    return forms.attention_forward(q, k, v, sinks, cu_seq_q, cu_seq_k, static)


def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                     window_size=(-1, -1), enable_gqa=False, softcap=0.0, sinks=None):
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"pallas::varlen_attention: query has {query.shape[1]} heads and key "
                         f"{key.shape[1]}; grouped query heads need enable_gqa=True")
    return _jax().varlen_attention(query, key, value, cu_seq_q, cu_seq_k, scale=scale,
                                   window_size=window_size, softcap=softcap, sinks=sinks)


def _rows(input, normalized_shape, *params):
    """input with its normalized dimensions merged into one, and the
    parameters flattened to match."""
    n = math.prod(normalized_shape)
    lead = input.shape[:input.ndim - len(normalized_shape)]
    return (input.reshape(*lead, n), *(None if p is None else p.reshape(n) for p in params))


def rms_norm(input, normalized_shape, weight=None, eps=None, casting_mode="none"):
    x, w = _rows(input, normalized_shape, weight)
    return _jax().rms_norm(x, w, eps, casting_mode=casting_mode).reshape(input.shape)


def rms_norm_forward(x, weight, eps, casting_mode="none"):
    return _jax().ops.rms_norm_forward(x, weight, float(eps), Casting(casting_mode))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, w, b = _rows(input, normalized_shape, weight, bias)
    return _jax().layer_norm(x, w, b, eps).reshape(input.shape)


def layer_norm_forward(x, weight, bias, eps):
    return _jax().ops.layer_norm_forward(x, weight, bias, float(eps))


def matmul(a, b):
    return _jax().matmul(a, b)


def add(x, y):
    return _jax().add(x, y)


def swiglu(gate, up):
    return _jax().swiglu(gate, up)


def rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    """q, k (B, H, L, D) with unsqueeze_dim=1, or (B, L, H, D) with
    unsqueeze_dim=2 (turned to heads first and back); cos, sin (B, L, D)."""
    forms = _jax()
    if q.ndim == 4 and cos.ndim == 3 and unsqueeze_dim in (1, -3):
        return forms.rotary_embedding(q, k, cos, sin)
    if q.ndim == 4 and cos.ndim == 3 and unsqueeze_dim in (2, -2):
        jnp = forms.ops.jnp
        out = forms.rotary_embedding(*(jnp.swapaxes(t, 1, 2) for t in (q, k)), cos, sin)
        return tuple(jnp.swapaxes(t, 1, 2) for t in out)
    _refuse("pallas::rotary_embedding", f"q {tuple(q.shape)} and cos {tuple(cos.shape)} with "
            f"unsqueeze_dim={unsqueeze_dim} are not supported (4-D q and k, 3-D cos and sin, "
            "unsqueeze_dim 1 or 2)")


def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The rows form (2-D mat_a, 3-D mat_b, offs) and the batched one (3-D
    both, no offs: each batch a group of rows)."""
    forms = _jax()
    jnp = forms.ops.jnp
    if mat_a.ndim == 2 and mat_b.ndim == 3 and offs is not None:
        return forms.grouped_mm(mat_a, mat_b, offs, bias, out_dtype=out_dtype)
    if mat_a.ndim == 3 and mat_b.ndim == 3 and offs is None:
        g, m, k = mat_a.shape
        ends = jnp.arange(1, g + 1, dtype=jnp.int32) * m
        out = forms.grouped_mm(mat_a.reshape(g * m, k), mat_b, ends, bias, out_dtype=out_dtype)
        return out.reshape(g, m, -1)
    _refuse("pallas::grouped_mm", f"mat_a {tuple(mat_a.shape)} and mat_b {tuple(mat_b.shape)} "
            f"with offs {'given' if offs is not None else 'None'} are not supported (2-D x "
            "3-D with offs, or 3-D x 3-D without)")


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, softcap=None):
    return _jax().linear_cross_entropy(input, weight, target, bias, ignore_index=ignore_index,
                                       reduction=reduction, label_smoothing=label_smoothing,
                                       softcap=softcap)


def token_log_probs(input, weight, target, bias=None, *, temperature=1.0, ignore_index=-100,
                    return_entropy=False, softcap=None):
    """The torch op's two results: the entropy empty unless return_entropy."""
    forms = _jax()
    log_probs, entropy = forms.token_log_probs(input, weight, target, bias,
                                               temperature=temperature,
                                               ignore_index=ignore_index, return_entropy=True,
                                               softcap=softcap)
    return log_probs, entropy if return_entropy else forms.ops.jnp.zeros((0,), entropy.dtype)


def fill(size, value, *, dtype=None, device=None):
    """torch.full's default dtype where none is given: bool, int64 or float32
    by the value (int64 needs JAX's 64-bit mode, said by the form)."""
    if dtype is None:
        dtype = "bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else "float32"
    return _jax().fill(tuple(size), value, dtype)


def iota(n, *, dtype=None, device=None):
    return _jax().iota(int(n), "int64" if dtype is None else dtype)


IMPLEMENTATIONS = {
    "add": add, "attention": attention, "attention_forward": attention_forward,
    "fill": fill, "grouped_mm": grouped_mm, "iota": iota, "layer_norm": layer_norm,
    "layer_norm_forward": layer_norm_forward, "linear_cross_entropy": linear_cross_entropy,
    "matmul": matmul, "rms_norm": rms_norm, "rms_norm_forward": rms_norm_forward,
    "rotary_embedding": rotary_embedding, "swiglu": swiglu, "token_log_probs": token_log_probs,
    "varlen_attention": varlen_attention,
}


class _JaxVjp(torch.autograd.Function):
    """A JAX function of float tensors as a torch autograd node: forward and
    backward through jax.vjp (torchax's interop converting tensors)."""

    @staticmethod
    def forward(ctx, interop, function, *tensors):
        jax = _jax().ops.jax
        out, vjp = interop.call_jax(lambda *arrays: jax.vjp(function, *arrays), *tensors)
        ctx.interop, ctx.vjp = interop, vjp  # a pytree: its residuals torch_view'd
        ctx.several = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        grads_in = ctx.interop.call_jax(lambda vjp, g: vjp(g), ctx.vjp,
                                        grads if ctx.several else grads[0])
        return (None, None, *(g if need else None
                              for g, need in zip(grads_in, ctx.needs_input_grad[2:])))


def _differentiable(interop, implementation):
    """implementation (a JAX function in a torch op's signature) as a torch
    function: its float tensors differentiated (torch's autograd, or JAX's
    through torchax), every other argument a constant (tensors as arrays)."""
    signature = inspect.signature(implementation)

    def call(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        names = [n for n, v in bound.arguments.items()
                 if isinstance(v, torch.Tensor) and v.is_floating_point()]
        constants = interop.jax_view({n: v for n, v in bound.arguments.items() if n not in names})
        if not names:
            return interop.torch_view(implementation(**constants))

        def function(*arrays):
            return implementation(**constants, **dict(zip(names, arrays)))

        tensors = [bound.arguments[n] for n in names]
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            # JAX's own autodiff, if any (jax.grad of a torchax model, whose
            # tensors hold tracers), sees the forms' custom_vjp directly: it
            # cannot differentiate a vjp's forward rule again
            return interop.call_jax(function, *tensors)
        return _JaxVjp.apply(interop, function, *tensors)

    return call


def register(env=None):
    """Gives torchax environment `env` (torchax.default_env() when None)
    every op's JAX-side form (see the module's docstring); returns `env`.
    Idempotent. Raises ImportError where torchax does not import."""
    try:
        import torchax
        from torchax import interop
    except Exception as error:  # torchax 0.0.13 fails on torch 2.13 with an AttributeError
        raise ImportError(
            f"torch_pallas.torchax.register: torchax does not import here (torch "
            f"{torch.__version__}): {type(error).__name__}: {error}. torchax 0.0.13 imports on "
            "torch < 2.13 (pip install 'torch<2.13' torchax)") from error
    env = torchax.default_env() if env is None else env
    if id(env) not in _registered:
        for name, implementation in IMPLEMENTATIONS.items():
            op = getattr(torch.ops.pallas, name).default
            env.override_op_definition(op, _differentiable(interop, implementation))
        _registered.add(id(env))
    return env
