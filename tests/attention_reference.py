"""Canonical attention calls (kernels/attention_shapes.py) on random inputs,
their float64 reference, and the error a kernel may show: what the kernel
tests of every family share.

The reference is torch's own scaled_dot_product_attention in float64 (GQA
through enable_gqa, the additive mask, causal as a -inf mask so that both may
apply), differentiated by torch's autograd; with dropout, SDPA's math with
the kernels' keep mask (ops/attention.py, dropout_reference and
dropout_keep). A kernel's error may be at most twice torch's own error in
the same dtype, plus a small absolute floor (after flash-attention's tests).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from torch_pallas.ops import attention as attention_op
from torch_pallas.ops import attention_spans

# The absolute floor per dtype, for values of order 1.
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclasses.dataclass
class Case:
    """One canonical call: q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev),
    an optional additive mask (Bm, Hm, L, S), causal, scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float
    dropout_p: float = 0.0
    seed: torch.Tensor | None = None  # the dropout's, with dropout_p > 0
    spans: torch.Tensor | None = None  # (L, 2) int32: each row's [start, end) of keys
    softcap: float = 0.0  # > 0: scores capped, c * tanh(s / c)
    span_width: int = 0  # > 0: the kernels' hint that no span is wider
    window: tuple[int, int] | None = None  # the window (left, right) the spans are exactly

    @property
    def keys(self) -> torch.Tensor | None:
        """The rows' dropout keys (B, Hq, L) the op would hand the kernels."""
        if self.dropout_p <= 0:
            return None
        b, hq, l = self.q.shape[:3]
        return attention_op.dropout_row_keys(self.seed, b * hq, l).reshape(b, hq, l)

    @property
    def keep(self) -> torch.Tensor:
        return attention_op.dropout_keep(self.seed, (*self.q.shape[:3], self.k.shape[2]),
                                         self.dropout_p)

    @property
    def key_spans(self) -> torch.Tensor | None:
        """The spans' transpose (S, 2), which the backward kernels take."""
        return None if self.spans is None else attention_spans.key_spans(self.spans,
                                                                         self.k.shape[2])

    @property
    def extra(self) -> tuple:
        """The forward's operands after the fixed ones: [mask][, spans][,
        dropout keys]."""
        return tuple(t for t in (self.mask, self.spans, self.keys) if t is not None)

    @property
    def backward_extra(self) -> tuple:
        """The backward's: [mask][, spans, key_spans][, dropout keys]."""
        return tuple(t for t in (self.mask, self.spans, self.key_spans, self.keys)
                     if t is not None)

    @property
    def inputs(self) -> tuple:
        return (self.q, self.k, self.v) + self.extra

    @property
    def params(self) -> dict:
        """The kernels' static parameters for this call."""
        params = dict(scale=self.scale, causal=self.causal)
        if self.spans is not None:
            params["spans"] = True
            if self.span_width:
                params["span_width"] = self.span_width
            if self.window is not None:
                params["window"] = self.window
        if self.softcap > 0:
            params["softcap"] = self.softcap
        return params | ({"dropout_p": self.dropout_p} if self.dropout_p > 0 else {})


def make_case(b=2, hq=4, hkv=2, l=37, s=45, e=32, ev=None, dtype=torch.float32, *,
              causal=False, mask=None, scale=None, mask_dtype=None, dropout_p=0.0,
              generator=None, window=None, sequences=None, softcap=0.0) -> Case:
    """Random inputs. mask: None, "full" (B, Hq, L, S), "batch" (B, 1, L, S),
    "heads" (1, Hq, L, S), "shared" (1, 1, L, S), each random with about a
    quarter of the entries -inf (and, for "padding", whole key columns
    masked per batch), or "empty_rows" (some query rows fully masked).
    dropout_p > 0: a random dropout seed.
    window (left, right): spans of a sliding window aligned top-left (with
    causal: folded into it, and causal False, as the op layer does);
    sequences [(Lq, Lk), ...]: packed sequences (b must be 1, l and s at
    least their sums; rows and keys past them unused), each with the window
    (default (-1, -1); causal: (left, 0)) aligned bottom-right.
    softcap > 0: capped scores. With a window bounded on both sides, the
    case carries its width as the kernels' span_width hint; a window
    without sequences, itself as their `window` parameter."""
    ev = e if ev is None else ev

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    q, k, v = randn(b, hq, l, e), randn(b, hkv, s, e), randn(b, hkv, s, ev)
    additive = None
    if mask is not None:
        shape = {"full": (b, hq, l, s), "batch": (b, 1, l, s), "heads": (1, hq, l, s),
                 "shared": (1, 1, l, s), "empty_rows": (b, 1, l, s)}[mask]
        additive = torch.randn(shape, generator=generator)
        hidden = torch.rand(shape, generator=generator) < 0.25
        if mask == "empty_rows":
            hidden[:, :, ::3, :] = True  # every third query row sees nothing
        additive = additive.masked_fill(hidden, float("-inf")).to(mask_dtype or dtype)
    scale = (1.0 / e**0.5) if scale is None else scale
    seed = torch.randint(0, 2**32, (), generator=generator) if dropout_p > 0 else None
    spans = None
    if window is not None or sequences is not None:
        left, right = window or (-1, -1)
        if causal:
            right, causal = (0 if right < 0 else min(right, 0)), False
        if sequences is None:
            spans = attention_spans.window_spans(l, s, left, right, "cpu")
        else:
            cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                          for n in zip(*sequences))
            spans = attention_spans.sequence_spans(cu_q, cu_k, l, left, right)
    width = 0
    if window is not None and window[0] >= 0 and right >= 0:
        width = window[0] + right + 1
    exact = (left, right) if window is not None and sequences is None else None
    return Case(q, k, v, additive, causal, scale, dropout_p, seed, spans, softcap, width, exact)


def reference_mask(case: Case, dtype=torch.float64) -> torch.Tensor | None:
    """The case's mask, causal rule and spans as one additive mask."""
    l, s = case.q.shape[-2], case.k.shape[-2]
    mask = None if case.mask is None else case.mask.to(dtype)
    hidden = None
    if case.causal:
        hidden = ~torch.ones(l, s, dtype=torch.bool).tril()
    if case.spans is not None:
        outside = ~attention_spans.visible(case.spans, s)
        hidden = outside if hidden is None else hidden | outside
    if hidden is not None:
        rule = torch.zeros(l, s, dtype=dtype).masked_fill(hidden, float("-inf"))
        mask = rule if mask is None else mask + rule
    return mask


def _scores(case: Case, q, k):
    """scale * q kᵀ, capped with a softcap, plus the mask: (B, Hq, L, S)."""
    group = case.q.shape[1] // case.k.shape[1]
    scores = (q @ k.repeat_interleave(group, dim=1).mT) * case.scale
    if case.softcap > 0:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    mask = reference_mask(case, scores.dtype)
    return scores if mask is None else scores + mask


def _sdpa(case: Case, q, k, v, dtype):
    gqa = case.q.shape[1] != case.k.shape[1]
    if case.softcap > 0:  # SDPA has no softcap: its math on the capped scores
        scores = _scores(case, q, k)
        empty = (scores == float("-inf")).all(-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        if case.dropout_p > 0:
            p = p * case.keep * attention_op.dropout_scale(case.dropout_p)
        return p @ v.repeat_interleave(case.q.shape[1] // case.k.shape[1], dim=1)
    if case.dropout_p > 0:  # SDPA's math with the kernels' mask
        return attention_op.dropout_reference(q, k, v, reference_mask(case, dtype),
                                              case.dropout_p, case.keep, scale=case.scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=reference_mask(case, dtype), scale=case.scale, enable_gqa=gqa)


def reference(case: Case, do: torch.Tensor | None = None):
    """(o, lse) in float64, and with `do`, (dq, dk, dv) too."""
    q, k, v = (t.detach().double().requires_grad_(do is not None)
               for t in (case.q, case.k, case.v))
    o = _sdpa(case, q, k, v, torch.float64)
    lse = torch.logsumexp(_scores(case, q, k), dim=-1).detach()
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows with no visible key
    o = torch.nan_to_num(o, nan=0.0)  # torch's math path: NaN rows where all is masked
    if do is None:
        return o.detach(), lse
    grads = torch.autograd.grad(o, (q, k, v), do.double())
    return o.detach(), lse, tuple(torch.nan_to_num(g, nan=0.0) for g in grads)


def torch_error(case: Case, do: torch.Tensor | None = None):
    """|torch's SDPA in the case's dtype - the float64 reference|: o's, and
    with `do` also dq's, dk's, dv's (for bounds)."""
    q, k, v = (t.detach().clone().requires_grad_(do is not None) for t in (case.q, case.k, case.v))
    o = torch.nan_to_num(_sdpa(case, q, k, v, case.q.dtype), nan=0.0)
    ref = reference(case, do)
    errors = [(o.detach().double() - ref[0]).abs()]
    if do is not None:
        grads = torch.autograd.grad(o, (q, k, v), do)
        errors += [(g.double() - r).abs() for g, r in zip(grads, ref[2])]
    return ref, errors


def bound(torch_err: torch.Tensor, dtype, magnitude=1.0) -> torch.Tensor:
    """What a kernel's error may be: twice torch's own, plus the floor."""
    return 2 * torch_err + ATOL[dtype] * magnitude


def run_kernel(kernel_module: str, backend_name: str, inputs, *, detect_races: bool = False,
               **params):
    """Runs one kernel file's KERNEL (e.g. "torch_pallas.kernels.tpu.attention")
    as backend `backend_name` runs it, on torch CPU tensors; returns its
    outputs as torch tensors (a tuple). With `detect_races` on a simulation
    backend, a race raises RaceDetectedError."""
    import functools

    from torch_pallas.base import dtypes
    from torch_pallas.runtime import backends, bridge, registry, simulators

    backend = backends.get(backend_name)
    spec = registry._load(kernel_module)
    avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in inputs)
    device = torch.device("cpu")
    execution = backend.execution(device=device, takes_inputs=True, detect_races=detect_races)
    if backend.family == "triton":
        config = spec.config(backend.name, avals, params, None)
        out = spec.run(*inputs, **params, config=config, **execution)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)
    import jax

    config = spec.config(backend.name, avals, params, backends.jax_device(device))
    kernel = jax.jit(functools.partial(spec.run, **params, config=config, **execution))
    arrays = [bridge.to_kernel_argument(t.contiguous()) for t in inputs]
    if backend.simulated:
        out = simulators.run(backend, kernel, arrays, detect_races=detect_races,
                             describe=lambda: f"{kernel_module} on {backend_name}")
    else:
        out = kernel(*arrays)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(bridge.to_torch(a) for a in out)
