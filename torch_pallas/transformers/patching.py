"""`torch_pallas.transformers.apply(model)`: a transformers model's layers
onto the Pallas training ops, in place, in one call (as Liger-Kernel's
`apply_liger_kernel_to_*` does, but on a model instance).

    model = AutoModelForCausalLM.from_config(config)
    print(torch_pallas.transformers.apply(model))  # what now runs on the ops

What it recognises, by what a module is and computes rather than by a list
of model names, so that every model built from the same transformers
modules is covered (Llama, Mistral, Qwen2, GPT-2 and their relatives):

| kind          | recognised as                                                  | then runs on                     |
|---------------|----------------------------------------------------------------|----------------------------------|
| attention     | modules that dispatch through transformers' AttentionInterface | attn_implementation="pallas"     |
| rms_norm      | torch.nn.RMSNorm; `*RMSNorm` modules whose output is Llama's,  | rms_norm, in that casting_mode   |
|               | Gemma's or F.rms_norm's casting bit for bit                    |                                  |
| layer_norm    | torch.nn.LayerNorm (the class itself, not subclasses)          | layer_norm                       |
| rotary        | attention modules calling their modeling file's rotate-half    | rotary_embedding                 |
|               | `apply_rotary_pos_emb`                                         |                                  |
| swiglu        | gated MLPs: `down_proj(act_fn(gate_proj(x)) * up_proj(x))`,    | swiglu                           |
|               | act_fn SiLU                                                    |                                  |
| experts       | MoE experts modules that dispatch through transformers'        | experts_implementation="pallas": |
|               | ExpertsInterface (transformers 5.x: Mixtral, Qwen2/3-MoE,      | grouped_mm, swiglu where the     |
|               | gpt-oss, ...)                                                  | gate is SiLU's                   |
| linear        | torch.nn.Linear, transformers' Conv1D                          | matmul (`nn.replace_linear`)     |
| cross_entropy | a causal LM whose loss is transformers' ForCausalLMLoss on its | linear_cross_entropy             |
|               | linear output embeddings (the LM head)                         |                                  |

A model's own module classes (its RMSNorm, its MLP, its rotary function)
are checked once per class on a small random input against the
composition they are replaced by, and left alone (listed in the report)
when they compute something else: an RMSNorm rounding as none of the
casting modes do, a GELU MLP, an interleaved rotary embedding, attention
with sinks. (A partial rotary embedding, cos narrower than the heads, is
handed to transformers' function call by call.) The checks run on CPU
copies with weights drawn anew, so modules on the meta device are judged
as any others.

How each is patched, on this model only:
- attention: `register()` and `model.set_attn_implementation("pallas")`
  (the model's config; config.json is written as before);
- experts: `register()` and `model.set_experts_implementation("pallas")`
  (likewise), unless an experts module holds weights grouped_mm does not
  take (quantized ones): then the model's experts keep their
  implementation as a whole. transformers 4.x has no experts interface:
  nothing is switched and the report says so;
- torch.nn.RMSNorm, torch.nn.LayerNorm, Linear, Conv1D: the module's class
  becomes torch_pallas.nn's drop-in subclass (as `replace_linear` does);
- a model's own RMSNorm and MLP classes, its attention modules (rotary) and
  the LM head and model (cross_entropy): the module's `forward`, set on the
  instance (a `Bound` function: `copy.deepcopy` binds the copy's to the
  copy, and `torch.save(model)` loads back patched);
- rotary: transformers' attention modules call the module-level function
  `apply_rotary_pos_emb` of their modeling file. That name, in that file,
  becomes (once per process and file) a dispatcher that calls
  `rotary_embedding` while a patched attention module's forward runs on
  the same thread (its forward sets a thread-local flag around the
  original) and transformers' own function otherwise: another model of the
  same family that was not patched keeps computing as before.
- cross_entropy: in training mode with `labels`, the model's forward runs
  with its LM head passing the hidden states through and its
  `loss_function` computing the loss from them with `linear_cross_entropy`
  (label shift, `ignore_index`, `shift_labels` and `num_items_in_batch` as
  ForCausalLMLoss does), so the (tokens x vocabulary) logits never exist;
  the output's `logits` is then None (as with Liger-Kernel: a Trainer with
  `label_smoothing_factor`, which reads the logits, needs
  `cross_entropy=False`). In eval mode, or without labels, the logits come
  back as before.

Parameters, buffers and the state dict are left as they are (the same
tensors, the same keys), so `save_pretrained` writes what it wrote before
and an optimizer already holding the parameters keeps working. To undo,
reload the model (`from_pretrained`, or a fresh instance and its state
dict): nothing here is reverted in place.

Imports: the ops (`torch_pallas.ops`) and `torch_pallas.nn` (its drop-ins
and `replace_linear`); transformers only inside `apply`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import sys
import textwrap
import threading
import types
import typing
import warnings

import torch

from torch_pallas import nn as pallas_nn
# Named pallas_* here: apply's keywords (rms_norm=, swiglu=) carry the ops' names.
from torch_pallas.ops import checks as op_checks
from torch_pallas.ops.linear_cross_entropy import linear_cross_entropy as pallas_linear_cross_entropy
from torch_pallas.ops.rms_norm import rms_norm as pallas_rms_norm
from torch_pallas.ops.rotary_embedding import rotary_embedding as pallas_rotary_embedding
from torch_pallas.ops.rotary_embedding import torch_rotary_embedding
from torch_pallas.ops.swiglu import swiglu as pallas_swiglu
from torch_pallas.transformers import attention as pallas_attention
from torch_pallas.transformers import experts as pallas_experts

WHERE = "torch_pallas.transformers.apply"
KINDS = ("attention", "rms_norm", "layer_norm", "rotary", "swiglu", "linear", "cross_entropy")
# The mixture-of-experts kinds, reported after the kinds every model may have.
MOE_KINDS = ("experts",)
REPORTED = (*KINDS, *MOE_KINDS)


@dataclasses.dataclass
class Report:
    """What `apply` left running on the Pallas ops, counted per kind (None:
    the kind was switched off), and what it recognised but left alone, and
    why. Modules already patched by an earlier `apply` count again."""

    model: str
    attention: int | None = None  # attention modules on attn_implementation="pallas"
    rms_norm: int | None = None  # RMSNorm modules
    layer_norm: int | None = None  # torch.nn.LayerNorm modules
    rotary: int | None = None  # attention modules whose rotary embedding runs on the op
    swiglu: int | None = None  # gated MLPs
    linear: int | None = None  # Linear and Conv1D layers on the Pallas matmul
    cross_entropy: int | None = None  # 1: the LM head and loss fused in training
    experts: int | None = None  # MoE experts modules on experts_implementation="pallas"
    left_alone: list[str] = dataclasses.field(default_factory=list)

    WHAT: typing.ClassVar[dict[str, str]] = {
        "attention": 'attention modules on attn_implementation="pallas"',
        "rms_norm": "RMSNorm modules on torch_pallas.rms_norm",
        "layer_norm": "LayerNorm modules on torch_pallas.layer_norm",
        "rotary": "attention modules' rotary embeddings on torch_pallas.rotary_embedding",
        "swiglu": "gated MLPs on torch_pallas.swiglu",
        "linear": "Linear/Conv1D layers on torch_pallas.matmul",
        "cross_entropy": "LM head + loss on torch_pallas.linear_cross_entropy (training, labels)",
        "experts": 'MoE experts modules on experts_implementation="pallas" (grouped_mm)',
    }

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) or 0 for kind in REPORTED)

    def __str__(self) -> str:
        lines = [f"{WHERE}({self.model}), in place:"]
        for kind in REPORTED:
            count = getattr(self, kind)
            what = "off" if count is None else f"{count:3d}  {self.WHAT[kind]}"
            lines.append(f"  {kind:<14}{what}")
        lines += [f"  left alone: {item}" for item in self.left_alone]
        return "\n".join(lines)


def apply(model: torch.nn.Module, *, attention: bool = True, rms_norm: bool = True,
          layer_norm: bool = True, rotary: bool = True, swiglu: bool = True,
          linear: bool = True, cross_entropy: bool = True, experts: bool = True,
          verbose: bool = False) -> Report:
    """Puts `model` (a transformers model, or any module holding their
    layers) on the Pallas training ops IN PLACE and returns a `Report` of
    what now runs on them. Each keyword switches one kind off (the table in
    this module's docstring says what each covers); `verbose=True` prints
    the report. Warns (UserWarning) when it recognises nothing.

    Values, losses and gradients stay the model's own within the dtype's
    rounding; parameters, buffers and the state dict are untouched (the
    same tensors), so `save_pretrained` writes what it wrote before. There
    is no undo in place: reload the model (`from_pretrained`, or a fresh
    instance and its state dict) to have it unpatched.
    """
    flags = dict(attention=attention, rms_norm=rms_norm, layer_norm=layer_norm, rotary=rotary,
                 swiglu=swiglu, linear=linear, cross_entropy=cross_entropy, experts=experts,
                 verbose=verbose)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WHERE}: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{WHERE}: {name} must be True or False, got {value!r}")

    pallas_attention.require_transformers()
    _check_not_distributed(model)

    report, checks = Report(type(model).__name__), _Checks()
    # Each kind's modules are checked against torch's composition as they are
    # patched; Linear layers go last, so that those checks run on torch's products.
    steps = (("attention", _attention), ("rms_norm", _rms_norms), ("layer_norm", _layer_norms),
             ("rotary", _rotary), ("swiglu", _gated_mlps), ("experts", _experts),
             ("cross_entropy", _fused_loss), ("linear", _linears))
    for kind, patch in steps:
        if flags[kind]:
            setattr(report, kind, patch(model, checks))
    report.left_alone = checks.left_alone
    if verbose:
        print(report)
    if report.total == 0:
        asked = [kind for kind in REPORTED if flags[kind]]
        warnings.warn(f"{WHERE}: recognised nothing to put on the Pallas ops in "
                      f"{type(model).__name__} (looked for: {', '.join(asked) or 'nothing'}); "
                      "it runs as before", UserWarning, stacklevel=2)
    return report


# --- shared helpers ------------------------------------------------------------

class Bound:
    """A function of `apply`'s bound to one module, set on that instance
    (its forward, a model's loss_function): `BOUND[name](type(module),
    *options)`, called with the module first (options: what `apply` chose
    for that module, an RMSNorm's casting mode). Pickled and deep-copied as
    (module, name, *options), so a copy's is bound to the copy and
    `torch.save(model)` loads back patched; `inspect.signature` sees the
    function's (transformers reads a model's forward's)."""

    def __init__(self, module: torch.nn.Module, name: str, *options):
        self.module, self.name, self.options = module, name, options
        self.function = BOUND[name](type(module), *options)

    def __call__(self, *args, **kwargs):
        return self.function(self.module, *args, **kwargs)

    def __reduce__(self):
        return Bound, (self.module, self.name, *self.options)

    @property
    def __signature__(self) -> inspect.Signature:
        signature = inspect.signature(self.function)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


def patched_as(module: torch.nn.Module) -> str | None:
    """What `apply` set `module`'s forward to (a name of BOUND), if anything."""
    forward = vars(module).get("forward")
    return forward.name if isinstance(forward, Bound) else None


def _bind(module: torch.nn.Module, attribute: str, name: str, *options) -> None:
    setattr(module, attribute, Bound(module, name, *options))


def _innermost_forward(cls: type):
    """`cls.forward` under its decorators (functools.wraps' `__wrapped__`):
    the function whose code and globals are the modeling file's."""
    return inspect.unwrap(cls.forward)


def _calls(cls: type, name: str) -> bool:
    """Whether `cls.forward` reads the global `name` (calls it, as written
    in its modeling file)."""
    code = getattr(_innermost_forward(cls), "__code__", None)
    return code is not None and name in code.co_names


def _agree(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal within the dtype's rounding, relative to the values' size (a
    probe's check, not a test's)."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape):
        return False
    tolerance = 1e-4 if got.dtype in (torch.float32, torch.float64) else 2e-2
    return torch.allclose(got.float(), expected.float(), rtol=tolerance,
                          atol=tolerance * expected.abs().max().item())


def _cpu_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` on the CPU for a probe to draw weights into; one
    on the meta device (a model built there) gets memory of its own, so
    its class is judged as any other's."""
    probe = copy.deepcopy(module)
    if any(p.is_meta for p in probe.parameters()):
        probe = probe.to_empty(device="cpu")
    return probe.cpu()


def _probe(module: torch.nn.Module, own, ours) -> bool:
    """`own()` (the module's computation) and `ours()` (what replaces it)
    agree, computed in eval mode without gradients."""
    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            return _agree(ours(), own())
    finally:
        module.train(training)


class _Checks:
    """What `apply` learns of a model's modules: each kind of module (a
    class, or the modeling file its forward reads) checked once, on the
    first module of that kind, and the modules left alone, with why."""

    def __init__(self):
        self.left_alone: list[str] = []
        self._verdicts: dict = {}

    def leave_alone(self, name: str, module: torch.nn.Module, why: str) -> None:
        self.left_alone.append(f"{name or '(the model)'} ({type(module).__name__}): {why}")

    def passes(self, key, check, name: str, module: torch.nn.Module, why: str) -> bool:
        """Whether `check()`'s verdict for `key` (computed once; kept for
        `verdict`) is true; a module failing it is reported (the first of
        its kind) as left alone because `why`."""
        if key not in self._verdicts:
            self._verdicts[key] = check()
            if not self._verdicts[key]:
                self.leave_alone(name, module, why)
        return bool(self._verdicts[key])

    def verdict(self, key):
        return self._verdicts[key]


# --- attention -----------------------------------------------------------------

def _attention(model, checks: _Checks) -> int:
    """attn_implementation="pallas" for the modules that dispatch through
    transformers' AttentionInterface (they read `config._attn_implementation`),
    unless one of them passes its attention function something the Pallas
    attention does not compute (`attention.UNSUPPORTED`: gpt-oss's sinks, a
    set softcap): the implementation is the model's, so the model's
    attention is then left alone as a whole."""
    layers = [(name, m) for name, m in model.named_modules()
              if _calls(type(m), "ALL_ATTENTION_FUNCTIONS")]
    if not (layers and _switchable(model, checks, layers, "attention modules",
                                   "set_attn_implementation", _attention_refused)):
        return 0
    pallas_attention.register()
    model.set_attn_implementation(pallas_attention.NAME)
    return len(layers)


def _switchable(model, checks: _Checks, layers: list, what: str, setter: str, refused) -> bool:
    """Whether `model` can put these `layers` ((name, module) pairs, its
    `what`) on "pallas" with its `setter`, one implementation for them all:
    it has the setter and `refused(module)` (why not, or None) passes each.
    Otherwise the first refusal is reported and the layers keep their
    implementation as a whole."""
    if not callable(getattr(model, setter, None)):
        checks.leave_alone("", model, f"{len(layers)} {what}, but the model has no {setter} "
                           "(pass a transformers PreTrainedModel)")
        return False
    for name, m in layers:
        why = refused(m)
        if why is not None:
            checks.leave_alone(name, m, f"{why}; the model's {len(layers)} {what} keep their "
                               "implementation")
            return False
    return True


def _attention_refused(module: torch.nn.Module) -> str | None:
    why = pallas_attention.unsupported(_attention_keywords(module))
    return why and f"its attention passes {why}, which the Pallas attention does not compute"


def _attention_keywords(module: torch.nn.Module) -> dict:
    """The keywords `module`'s forward passes its attention function, with
    their values where the forward reads them from the module (`self.sinks`)
    or writes them out, as written in its modeling file; a keyword whose
    value only the call knows is taken as set (Ellipsis)."""
    forward = _innermost_forward(type(module))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):  # no source: every keyword named in the code is set
        code = getattr(forward, "__code__", None)
        names = [c for c in getattr(code, "co_consts", ()) if isinstance(c, tuple)]
        return {name: ... for names_ in names for name in names_ if isinstance(name, str)}
    keywords = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "attention_interface"):
            keywords.update((k.arg, _value_in(module, k.value)) for k in node.keywords if k.arg)
    return keywords


def _value_in(module: torch.nn.Module, node: ast.expr):
    """A keyword's value as the forward computes it, where it is a constant
    or an attribute of the module (`self.config.x`); Ellipsis otherwise."""
    if isinstance(node, ast.Constant):
        return node.value
    path = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and path):
        return ...
    value = module
    for attribute in reversed(path):
        value = getattr(value, attribute, None)
    return value


# --- RMSNorm and LayerNorm -----------------------------------------------------

# The RMSNorm casting modes (pallas::rms_norm's casting_mode), each as the
# modules that use it write it, most specific first: a model's RMSNorm runs
# on the first whose output equals the module's bit for bit.
RMS_NORM_CASTINGS = {
    # Llama, Mistral, Qwen2/3 and the many modules copied from them
    "llama": lambda weight, normed, x: weight * normed.to(x.dtype),
    # Gemma, Gemma 2, Gemma 3
    "gemma": lambda weight, normed, x: (normed * (1.0 + weight.float())).to(x.dtype),
    # F.rms_norm's single rounding (OLMo 2's `(weight * normed).to(x.dtype)`)
    "none": lambda weight, normed, x: (weight.float() * normed).to(x.dtype),
}


def _rms_norm_epsilon(module: torch.nn.Module) -> float | None:
    """The epsilon of a module shaped like transformers' RMSNorm: a class
    named *RMSNorm holding one 1-D `weight` and a float `variance_epsilon`
    (Llama's) or `eps` (Gemma's), nothing else; None for anything else."""
    weight = getattr(module, "weight", None)
    eps = _epsilon_of(module)
    shaped = (type(module).__name__.lower().endswith("rmsnorm")
              and isinstance(weight, torch.nn.Parameter) and weight.dim() == 1
              and isinstance(eps, float) and len(list(module.parameters())) == 1
              and not list(module.children()))
    return eps if shaped else None


def _epsilon_of(module: torch.nn.Module):
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


@functools.cache
def _rms_norm_forward(cls: type, casting_mode: str):
    """An RMSNorm module's forward on rms_norm in `casting_mode`: one kernel
    call, the module's roundings inside it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return pallas_rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight,
                               _epsilon_of(self), casting_mode=casting_mode)

    forward.__doc__ = f"{cls.__name__}'s forward on torch_pallas.rms_norm ({casting_mode!r} casting)"
    return forward


def _rms_norm_casting(module: torch.nn.Module, eps: float) -> str | None:
    """The casting mode whose composition gives `module`'s output bit for
    bit (None: none does), on a CPU copy with a random weight (a fresh
    model's are ones or zeros, which would hide a forward that ignores or
    offsets them), in float32 and bfloat16 (where the modes' roundings
    differ)."""
    probe = _cpu_copy(module)
    with torch.no_grad():
        probe.weight.uniform_(-1.5, 1.5)
    n = probe.weight.shape[0]
    inputs = [torch.randn(4, 8, n, dtype=dtype) * 3 for dtype in (torch.float32, torch.bfloat16)]

    def normed(x):  # the modules' own float32 normalisation, written as they write it
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    probe.eval()
    with torch.no_grad():
        own = [type(probe).forward(probe, x) for x in inputs]
        for mode, casting in RMS_NORM_CASTINGS.items():
            if all(isinstance(o, torch.Tensor) and o.dtype == c.dtype and torch.equal(o, c)
                   for o, c in zip(own, (casting(probe.weight, normed(x), x) for x in inputs))):
                return mode
    return None


def _rms_norms(model, checks: _Checks) -> int:
    count = 0
    for name, m in model.named_modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = pallas_nn.RMSNorm
        elif not (isinstance(m, pallas_nn.RMSNorm) or patched_as(m) == "rms_norm"):
            eps = _rms_norm_epsilon(m)
            if eps is None or not checks.passes(
                    type(m), lambda: _rms_norm_casting(m, eps), name, m,
                    "an RMSNorm whose output is none of the casting modes' (Llama's "
                    "weight * normed.to(input dtype), Gemma's (normed * (1 + weight)).to(input "
                    "dtype), F.rms_norm's single rounding)"):
                continue
            _bind(m, "forward", "rms_norm", checks.verdict(type(m)))
        count += 1
    return count


def _layer_norms(model, checks: _Checks) -> int:
    count = 0
    for m in model.modules():
        if type(m) is torch.nn.LayerNorm:
            m.__class__ = pallas_nn.LayerNorm
        elif not isinstance(m, pallas_nn.LayerNorm):
            continue
        count += 1
    return count


# --- rotary embeddings -----------------------------------------------------------

ROTARY = "apply_rotary_pos_emb"
# True while a patched attention module's forward runs on this thread: the
# dispatchers below then call the Pallas op.
_rotary_on = threading.local()


def _rotary_dispatcher(original):
    """What a modeling file's `apply_rotary_pos_emb` becomes: `original`
    (transformers' own, whatever it is wrapped in), unless a patched
    attention module is running.

    transformers 5 with the `kernels` distribution makes the name an
    `nn.Module` (`@use_kernel_forward_from_hub`) that routes each call to
    the calling attention module's private copy (`@use_kernelized_func` on
    the class), which `kernels.kernelize` may point at a hub kernel. The
    dispatcher is then one more module of that class with its forward
    ours, so that it stands in front of the routing (a patched module's
    calls never reach it: no hub kernel can route around the patch) and
    still is what `kernels` expects under the name (a model's private
    copies are made, deep-copied and unpickled as `type(name)()`)."""
    if isinstance(original, torch.nn.Module):
        dispatcher = type(original)()
        vars(dispatcher)["torch_pallas_original"] = original  # not a submodule
        dispatcher.forward = types.MethodType(_dispatch_rotary, dispatcher)
        return dispatcher

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        return _rotary_or_original(original, q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.torch_pallas_original = original
    return apply_rotary_pos_emb


def _dispatch_rotary(self, q, k, cos, sin, *args, **kwargs):
    """The module dispatcher's forward (see _rotary_dispatcher)."""
    return _rotary_or_original(self.torch_pallas_original, q, k, cos, sin, *args, **kwargs)


def _rotary_or_original(original, q, k, cos, sin, *args, **kwargs):
    """The Pallas op for what `_is_rotate_half` checked (q, k, cos, sin and
    `unsqueeze_dim` by keyword); transformers' own for anything else: a
    partial rotary (cos narrower than the heads), arguments it did not
    check (transformers 4's unused `position_ids`)."""
    if (getattr(_rotary_on, "value", False) and not args and kwargs.keys() <= {"unsqueeze_dim"}
            and cos.shape[-1] == q.shape[-1]):
        return pallas_rotary_embedding(q, k, cos, sin, kwargs.get("unsqueeze_dim", 1))
    return original(q, k, cos, sin, *args, **kwargs)


@functools.cache
def _with_pallas_rotary(cls: type):
    """`cls.forward` with the Pallas rotary embedding switched on around it
    (its signature kept, for the callers that inspect it)."""
    forward = cls.forward

    @functools.wraps(forward)
    def forward_with_pallas_rotary(self, *args, **kwargs):
        before = getattr(_rotary_on, "value", False)
        _rotary_on.value = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            _rotary_on.value = before

    return forward_with_pallas_rotary


def _is_rotate_half(function) -> bool:
    """`function(q, k, cos, sin, unsqueeze_dim=...)` computes the
    rotate-half embedding (Llama's), checked on random grouped-head inputs
    with the heads at dimension 1 and at 2, and in bfloat16 with float32
    angles, where the result's dtype says how it rounds (Llama's promotes;
    OLMo 2's rounds back to q's dtype, which the op does not). Judged by
    what it returns, not by its signature: transformers 5 hands out the
    function wrapped in an `nn.Module` whose forward takes `*args,
    **kwargs`, and transformers 4's takes an unused `position_ids` before
    `unsqueeze_dim`."""
    if not callable(function):
        return False
    # q and k (4 and 2 heads, 3 tokens) for each place of the heads, and dtypes.
    cases = (((2, 4, 3, 8), (2, 2, 3, 8), 1, torch.float32),
             ((2, 3, 4, 8), (2, 3, 2, 8), 2, torch.float32),
             ((2, 4, 3, 8), (2, 2, 3, 8), 1, torch.bfloat16))
    for q_shape, k_shape, unsqueeze_dim, dtype in cases:
        q, k = torch.randn(q_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype)
        cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
        with torch.no_grad():
            try:
                got = function(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
            except (TypeError, RuntimeError):  # another signature, or shapes it reads otherwise
                return False
            expected = torch_rotary_embedding(q, k, cos, sin, unsqueeze_dim)
        if not (isinstance(got, tuple) and len(got) == 2
                and all(_agree(g, e) and g.dtype == e.dtype for g, e in zip(got, expected))):
            return False
    return True


def _install_rotary_dispatcher(namespace: dict) -> bool:
    """The dispatcher in a modeling file's namespace (once) if its
    `apply_rotary_pos_emb` is the rotate-half embedding; whether it is."""
    current = namespace.get(ROTARY)
    original = getattr(current, "torch_pallas_original", current)
    if not _is_rotate_half(original):
        return False
    if current is original:
        namespace[ROTARY] = _rotary_dispatcher(original)
    return True


def _rotary(model, checks: _Checks) -> int:
    count = 0
    for name, m in model.named_modules():
        cls = type(m)
        if not _calls(cls, ROTARY):
            continue
        if patched_as(m) != "rotary":
            namespace = _innermost_forward(cls).__globals__  # where its forward looks the name up
            if not checks.passes(id(namespace), lambda: _install_rotary_dispatcher(namespace),
                                 name, m, f"its {namespace.get('__name__')}.{ROTARY} is not "
                                 "the rotate-half embedding of Llama"):
                continue
            _bind(m, "forward", "rotary")
        count += 1
    return count


# --- gated MLPs ------------------------------------------------------------------

def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(pallas_swiglu(self.gate_proj(x), self.up_proj(x)))


def _computes_swiglu_mlp(module: torch.nn.Module) -> bool:
    """On a CPU copy whose projections are drawn anew so that the gate's
    outputs are of order one (a fresh model's small weights keep them near
    zero, where GELU and SiLU agree to within the tolerance: Gemma's MLP)."""
    weight = getattr(module.gate_proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return False
    probe = _cpu_copy(module)
    with torch.no_grad():
        for projection in (probe.gate_proj, probe.up_proj, probe.down_proj):
            for parameter in projection.parameters():
                bound = 3 / parameter.shape[-1] ** 0.5
                parameter.uniform_(-bound, bound)
    x = torch.randn(2, 3, weight.shape[1], dtype=weight.dtype)

    def swiglu_mlp():
        silu = torch.nn.functional.silu
        return probe.down_proj(silu(probe.gate_proj(x)) * probe.up_proj(x))

    return _probe(probe, lambda: type(probe).forward(probe, x), swiglu_mlp)


def _gated_mlps(model, checks: _Checks) -> int:
    count = 0
    for name, m in model.named_modules():
        if not all(isinstance(getattr(m, p, None), torch.nn.Module)
                   for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            continue
        if patched_as(m) != "swiglu":
            if not checks.passes(type(m), lambda: _computes_swiglu_mlp(m), name, m,
                                 "a gated MLP whose forward is not "
                                 "down_proj(silu(gate_proj(x)) * up_proj(x))"):
                continue
            _bind(m, "forward", "swiglu")
        count += 1
    return count


# --- MoE experts -------------------------------------------------------------------

def _dispatches_experts(cls: type) -> bool:
    """Whether `cls.forward` (or a function it wraps) picks its computation
    by `config._experts_implementation`: transformers'
    `@use_experts_implementation` experts classes."""
    function = cls.forward
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is not None and "_experts_implementation" in code.co_names:
            return True
        function = getattr(function, "__wrapped__", None)
    return False


def _experts_weights_refused(module: torch.nn.Module) -> str | None:
    """What in an experts module grouped_mm does not take (None: nothing):
    weights that are not (experts, ., .) tensors of its dtypes (quantized
    experts)."""
    names = ["gate_up_proj" if pallas_experts.flag(module, "has_gate") else "up_proj", "down_proj"]
    for name in names:
        weight = getattr(module, name, None)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 3
                and weight.dtype in pallas_experts.DTYPES):
            what = (f"a {weight.dim()}-D {weight.dtype} tensor" if isinstance(weight, torch.Tensor)
                    else type(weight).__name__)
            return f"its {name} is {what}, not 3-D float32, float16 or bfloat16 weights"
    return None


def _experts(model, checks: _Checks) -> int:
    """experts_implementation="pallas" for the experts modules that dispatch
    through transformers' ExpertsInterface (they read
    `config._experts_implementation`); left alone as a whole, as attention
    is, when one of them holds weights grouped_mm does not take, and on a
    transformers without the interface (4.x)."""
    if pallas_experts.experts_interface() is None:
        moe = [(name, m) for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] == "experts"]
        if moe:
            import transformers

            name, m = moe[0]
            checks.leave_alone(name, m, f"transformers {transformers.__version__} has no experts "
                               "interface that takes another implementation (transformers."
                               "integrations.moe; 5.0's models take its own three alone): the "
                               f"experts of its {len(moe)} MoE layers stay on torch")
        return 0
    layers = [(name, m) for name, m in model.named_modules() if _dispatches_experts(type(m))]
    if not (layers and _switchable(model, checks, layers, "experts modules",
                                   "set_experts_implementation", _experts_weights_refused)):
        return 0
    pallas_experts.register()
    model.set_experts_implementation(pallas_experts.NAME)
    count = 0
    for name, m in layers:
        implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if implementation == pallas_experts.NAME:
            count += 1
        else:
            checks.leave_alone(name, m, f"its config's experts_implementation stayed "
                               f"{implementation!r} (set_experts_implementation did not reach it)")
    return count


# --- Linear and Conv1D -------------------------------------------------------------

def _linears(model, checks: _Checks) -> int:
    with warnings.catch_warnings():  # apply warns itself when it finds nothing at all
        warnings.simplefilter("ignore", UserWarning)
        pallas_nn.replace_linear(model)
    return len(pallas_nn.converted(model))


# --- the LM head and its loss --------------------------------------------------------

FUSING = "_torch_pallas_fusing"  # on the LM head: True while the model's forward fuses
HIDDEN = "_torch_pallas_hidden"  # on the LM head: the hidden states it passed through
PASSED = "_torch_pallas_passed"  # on the LM head: its output after its forward hooks
LOSS_METHOD = "torch_pallas_fused_loss"  # on the LM head: the fused loss from its parameters


def _lm_head_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """The LM head: its own forward, or, while the model fuses its loss,
    the hidden states themselves, kept for the loss function."""
    if getattr(self, FUSING, False):
        setattr(self, HIDDEN, hidden_states)
        return hidden_states
    return type(self).forward(self, hidden_states)


def _fused_causal_lm_loss(self, logits, labels, vocab_size: int, num_items_in_batch=None,
                          ignore_index: int = -100, shift_labels=None, **kwargs):
    """The model's `loss_function`: transformers' ForCausalLMLoss, computed
    by `linear_cross_entropy` from the LM head's input while the model
    fuses (its label shift, `ignore_index`, `shift_labels`, and
    `num_items_in_batch`: the sum over the tokens divided by it)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = self.get_output_embeddings()
    hidden = getattr(head, HIDDEN, None)
    if hidden is None:  # real logits: eval mode with labels, or not fusing
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                               shift_labels, **kwargs)
    if _passed_through(logits, hidden):
        source = logits  # (an alias: a backward hook on the head then sees its gradient)
    elif logits is getattr(head, PASSED, None) and op_checks.is_dtensor(head.weight):
        source = hidden  # tensor parallelism's hooks laid the output out anew (Colwise: split)
    else:
        raise RuntimeError(
            f"{WHERE}: {type(self).__name__}'s forward changes the LM head's output before its "
            "loss (a softcap or scale, say), so the fused loss cannot stand in for it; apply "
            "with cross_entropy=False")
    if shift_labels is None:  # tokens < n predict n, as ForCausalLMLoss shifts them
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = _head_loss(head)(source, shift_labels, ignore_index, reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _record_output(head, inputs, output):
    setattr(head, PASSED, output)


def _passed_through(logits, hidden: torch.Tensor) -> bool:
    """Whether the model's "logits" are the hidden states the fusing LM head
    passed through: the same tensor, or an alias of it that a module hook
    made (a full backward hook's, torch's CommDebugMode's), which the loss
    then reads so that the hook sees its gradient. (A forward hook that
    returns anything else changes the logits: the fused loss is refused,
    except for tensor parallelism's, which only lay them out anew.)"""
    if logits is hidden:
        return True
    return (type(logits) is torch.Tensor and type(hidden) is torch.Tensor
            and logits.shape == hidden.shape and logits.stride() == hidden.stride()
            and logits.data_ptr() == hidden.data_ptr())


def _check_not_distributed(model: torch.nn.Module) -> None:
    """apply checks each module it patches by running it on plain tensors,
    which parameters already sharded (DTensors) refuse: it must come first."""
    for name, parameter in model.named_parameters():
        if op_checks.is_dtensor(parameter):
            raise RuntimeError(
                f"{WHERE}: {name} is a DTensor (placements {tuple(parameter.placements)}): call "
                "apply before fully_shard or parallelize_module, on the whole model")


def _lm_head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                  reduction: str) -> torch.Tensor:
    """The LM head's part of the fused loss, a method of the head: its
    weight and bias with the hidden states it passed through."""
    return pallas_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.weight,
                                       labels.reshape(-1).to(hidden.device), self.bias,
                                       ignore_index=ignore_index, reduction=reduction)


def _head_loss(head: torch.nn.Module):
    """The head's LOSS_METHOD. Under FSDP2 (`fully_shard` on the head, in a
    group that reshards after its forward) the head's parameters are
    sharded again once its pass-through forward returns: the method is
    then registered as a forward of the head
    (`register_fsdp_forward_method`), so that FSDP gathers the weight for
    it and reduce-scatters its gradient, as for the head's forward."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded by whoever sharded the model
    if (fsdp is not None and isinstance(head, fsdp.FSDPModule)
            and isinstance(vars(head).get(LOSS_METHOD), Bound)):
        fsdp.register_fsdp_forward_method(head, LOSS_METHOD)
    return getattr(head, LOSS_METHOD)


@functools.cache
def _fusing_forward(cls: type):
    """`cls.forward` (a causal LM's) with, in training mode with labels, the
    LM head passing its input through to the fused loss; the output then
    has no logits."""
    forward = cls.forward
    names = list(inspect.signature(forward).parameters)
    labels_at = names.index("labels") - 1  # among the positional arguments after self

    @functools.wraps(forward)
    def forward_fusing_the_loss(self, *args, **kwargs):
        labels = kwargs.get("labels", args[labels_at] if len(args) > labels_at else None)
        if not (self.training and labels is not None):
            return forward(self, *args, **kwargs)
        head = self.get_output_embeddings()
        setattr(head, FUSING, True)
        # Last of the head's forward hooks: what the model receives as its
        # logits once every hook has run (tensor parallelism's re-layout, the
        # one case the loss reads it: a sharded head). Only then, since
        # torch.compile cannot trace a hook registered inside its graph.
        recording = (head.register_forward_hook(_record_output)
                     if op_checks.is_dtensor(head.weight) else None)
        try:
            outputs = forward(self, *args, **kwargs)
        finally:
            if recording is not None:
                recording.remove()
            setattr(head, FUSING, False)
            setattr(head, HIDDEN, None)
            setattr(head, PASSED, None)
        return _without_logits(outputs)

    return forward_fusing_the_loss


def _without_logits(outputs):
    """A causal LM's output with its logits (the hidden states, here) gone:
    the field None, or, for return_dict=False, the tuple without them (as
    transformers' to_tuple leaves out a None field)."""
    if isinstance(outputs, tuple):  # (loss, logits, ...)
        return outputs[:1] + outputs[2:]
    return type(outputs)(**{key: value for key, value in outputs.items() if key != "logits"})


def _fused_loss(model, checks: _Checks) -> int:
    """The LM head and loss of a causal LM onto linear_cross_entropy."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    loss_function = getattr(model, "loss_function", None) if head is not None else None
    if isinstance(loss_function, Bound):
        return 1  # an earlier apply
    if type(head) not in (torch.nn.Linear, pallas_nn.Linear):
        return 0
    from transformers.loss.loss_utils import ForCausalLMLoss

    why = None
    if loss_function is not ForCausalLMLoss:
        why = f"its loss_function is {getattr(loss_function, '__name__', loss_function)}, not ForCausalLMLoss"
    elif "labels" not in inspect.signature(type(model).forward).parameters:
        why = "its forward takes no labels"
    elif getattr(getattr(model, "config", None), "final_logit_softcapping", None) is not None:
        why = "it softcaps its logits before the loss"
    if why is not None:
        checks.leave_alone("", model, f"LM head and loss: {why}")
        return 0
    _bind(head, "forward", "lm_head")
    _bind(head, LOSS_METHOD, "lm_head_loss")
    _bind(model, "forward", "cross_entropy")
    _bind(model, "loss_function", "loss_function")
    return 1


# The functions `apply` binds to module instances, by the name a pickle
# records: each made for the module's class.
BOUND = {
    "rms_norm": _rms_norm_forward,
    "rotary": _with_pallas_rotary,
    "swiglu": lambda cls: _swiglu_mlp_forward,
    "lm_head": lambda cls: _lm_head_forward,
    "lm_head_loss": lambda cls: _lm_head_loss,
    "cross_entropy": _fusing_forward,
    "loss_function": lambda cls: _fused_causal_lm_loss,
}
