"""`experts_implementation="pallas"`: a transformers mixture of experts'
experts on `torch.ops.pallas.grouped_mm` (`experts_forward`), registered
by `register()` in transformers' `ExpertsInterface` (transformers 5.x;
older versions have no such interface and nothing is registered).

transformers calls an experts function as `fn(module, hidden_states,
top_k_index, top_k_weights)`: hidden_states (T, H), each token's k experts
and routing weights (T, k). The function here does what transformers'
"grouped_mm" experts do (transformers/integrations/moe.py), on the Pallas
op instead of `F.grouped_mm` (aten::_grouped_mm) or transformers' own
fallback loop:

1. the (token, k) pairs sorted by expert (stable), each pair's token row
   gathered; `offs` the int32 cumulative sum of the per-expert counts, one
   entry per expert, empty experts included. Expert ids >= num_experts
   (the sentinels of expert parallelism) sort to the tail, past offs[-1],
   where grouped_mm computes nothing and passes no gradient back;
2. gate_up (or up) projection: `grouped_mm(x, W)` with the module's
   weights read in place (stored (G, N, K), passed as their transposed
   view; `is_transposed` (gpt-oss): stored (G, K, N), passed as they are)
   and the biases (`has_bias`) through grouped_mm's bias;
3. the gate: `pallas::swiglu(gate, up)` on the two halves where the module
   is transformers' default SiLU gate (`act_fn(gate) * up`, concatenated
   halves), else the module's own `_apply_gate` (gpt-oss: interleaved
   halves, clamped, `alpha`, `(up + 1)`), or `act_fn` without a gate;
4. down projection as in 2, then the module's `post_expert_norm` where it
   has one (`has_post_expert_norm`);
5. each pair's output times its routing weight, put back in the pairs'
   order and summed over k (in the product's dtype, as transformers'
   grouped_mm does), cast to hidden_states' dtype.

The flags (`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`)
are what transformers' `@use_experts_implementation` sets on the module;
older 5.x set fewer (5.0: `has_bias` and `is_transposed` alone;
`has_post_expert_norm` from 5.20), and a missing one reads as its default,
the behaviour of the versions without it (`FLAGS`).

Routing (the router, top-k, the weights) stays the model's own.

Imports: `torch_pallas.ops`; transformers itself only inside `register()`
and `experts_interface()`.
"""

from __future__ import annotations

import functools

import torch

# DTYPES: the weights' dtypes grouped_mm takes (apply leaves others alone)
from torch_pallas.ops.grouped_mm import DTYPES, grouped_mm
from torch_pallas.ops.swiglu import swiglu

NAME = "pallas"

# The experts flags transformers' `@use_experts_implementation` sets, with
# the value each has where a transformers sets no such attribute (the
# behaviour of the versions before it).
FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False,
         "has_post_expert_norm": False}


def flag(module: torch.nn.Module, name: str) -> bool:
    """The experts module's flag `name` (one of `FLAGS`), or its default
    where this transformers does not set it."""
    return getattr(module, name, FLAGS[name])


def experts_interface():
    """transformers' `ExpertsInterface` class, or None where this
    transformers has none (before 5.0) or its models take none of the
    names registered there (5.0 accepts its own three alone)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface if _models_take_registered_experts() else None


@functools.cache
def _models_take_registered_experts() -> bool:
    """Whether `set_experts_implementation` accepts a name registered in
    the interface (ours, registered for the question: what `register`
    does), asked of the check models run on it before they read anything
    of themselves (no model built)."""
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    try:
        PreTrainedModel.get_correct_experts_implementation(None, NAME)
    except ValueError:
        return False  # its own names alone
    except (AttributeError, TypeError):
        pass  # past the name's check, reading the model it was not given
    return True


def register() -> bool:
    """Registers experts_implementation="pallas" with transformers
    (idempotent); whether this transformers has the experts interface to
    register it in."""
    interface = experts_interface()
    if interface is None:
        return False
    interface.register(NAME, experts_forward)
    return True


def _projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                offs: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """x (S, K) through each expert's weight, rows grouped by offs: weights
    stored (G, K, N) when `is_transposed`, else (G, N, K) (read through the
    transposed view, not copied)."""
    mat_b = weight if is_transposed else weight.mT
    return grouped_mm(x.to(weight.dtype), mat_b, offs=offs, bias=bias)


def _default_gate():
    """transformers' default `_apply_gate` (`act_fn(gate) * up` on the two
    concatenated halves), or None where this transformers has another.

    Imported from transformers.integrations.moe by name: torch.compile
    traces this, and Dynamo (torch 2.11) refuses an import whose result is
    a ModuleType subclass, as `from transformers.integrations import moe`
    gives (transformers.integrations is a _LazyModule)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    return _default_apply_gate


_SILU: dict[type, bool] = {}  # _is_silu's answers


def _is_silu(activation_type: type) -> bool:
    """Whether a parameterless activation module of this type computes
    F.silu (transformers' SiLUActivation, torch.nn.SiLU), checked once a
    type on random values. Under torch.compile the answer is a constant:
    read from `_SILU`, or computed outside the graph (Dynamo 2.11 traced
    through a functools.cache into the check's allclose, a value read, and
    fullgraph failed)."""
    known = _SILU.get(activation_type)
    if known is None:
        known = _SILU[activation_type] = _computes_silu(activation_type)
    return known


@torch.compiler.assume_constant_result
def _computes_silu(activation_type: type) -> bool:
    x = torch.randn(257, dtype=torch.float64) * 4
    try:
        with torch.no_grad():
            got = activation_type()(x)
    except TypeError:  # a constructor that needs arguments
        return False
    return isinstance(got, torch.Tensor) and torch.allclose(got, torch.nn.functional.silu(x),
                                                           rtol=1e-12, atol=1e-12)


def swiglu_gated(module: torch.nn.Module) -> bool:
    """Whether `module`'s gate is transformers' default gate with a SiLU
    activation, which pallas::swiglu computes in one kernel."""
    default = _default_gate()
    activation = getattr(module, "act_fn", None)
    return (default is not None and "_apply_gate" not in vars(module)
            and getattr(type(module), "_apply_gate", None) is default
            and isinstance(activation, torch.nn.Module)
            and not any(True for _ in activation.parameters())
            and _is_silu(type(activation)))


def _activate(module: torch.nn.Module, projected: torch.Tensor) -> torch.Tensor:
    if not flag(module, "has_gate"):
        return module.act_fn(projected)
    if swiglu_gated(module):
        gate, up = projected.chunk(2, dim=-1)
        return swiglu(gate, up)
    return module._apply_gate(projected)


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's computation on pallas::grouped_mm
    (the module's docstring says how): hidden_states (T, H), top_k_index
    and top_k_weights (T, k) -> (T, H) in hidden_states' dtype."""
    num_experts = self.num_experts
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)

    # 1. pairs by expert; sentinels (>= num_experts) last, outside every group
    sorted_ids, order = torch.sort(expert_ids, stable=True)
    rows = hidden_states[order // top_k]
    # each expert's end among the sorted pairs: the pairs below the next id
    # (no bincount, whose output size is data under jax.jit, where torchax
    # runs a compiled model)
    next_ids = torch.arange(1, num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, next_ids).to(torch.int32)
    sentinels = None
    if getattr(self, "_is_expert_parallel", False):
        sentinels = (sorted_ids >= num_experts).unsqueeze(-1)
    weights = top_k_weights.reshape(-1)[order]

    # 2.-4. the experts' two projections and the gate between them
    has_gate, has_bias = flag(self, "has_gate"), flag(self, "has_bias")
    transposed = flag(self, "is_transposed")
    up_weight = self.gate_up_proj if has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if has_gate else self.up_proj_bias) if has_bias else None
    projected = _projection(rows, up_weight, up_bias, offs, transposed)
    projected = _activate(self, projected)
    down_bias = self.down_proj_bias if has_bias else None
    out = _projection(projected, self.down_proj, down_bias, offs, transposed)
    if flag(self, "has_post_expert_norm"):
        out = self.post_expert_norm(out)

    # 5. weighted, back in the pairs' order, summed over each token's k
    weighted = out * weights.unsqueeze(-1)
    if sentinels is not None:  # rows no expert here computed: nothing, not even a NaN, leaks
        weighted = weighted.masked_fill(sentinels, 0.0)
    unsorted = torch.index_copy(torch.empty_like(weighted), 0, order, weighted)
    return unsorted.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
