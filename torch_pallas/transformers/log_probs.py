"""`token_log_probs(model, input_ids, ...)`: a transformers causal LM's
log-probabilities of its own tokens (and, on request, each position's
entropy) without the (tokens x vocabulary) logits, on the fused op
`torch_pallas.token_log_probs` (ops/token_log_probs.py).

It computes what TRL's GRPOTrainer computes for one batch
(`_get_per_token_logps_and_entropies`), with K = logits_to_keep:

    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=K + 1).logits
    logits = logits[:, :-1, :][:, -K:] / temperature
    log_probs = log_softmax(logits.float(), -1).gather(-1, ids[:, -K:, None])[..., 0]
    entropy = -(softmax(logits) * log_softmax(logits)).sum(-1)

which holds (B, K, V) logits and their softmax. Here:
1. the decoder that the model's forward calls for its hidden states
   (`model.model` for Llama and its relatives, `model.transformer` for
   GPT-2, `model.model.decoder` for OPT) runs on input_ids and
   attention_mask, as TRL's call runs it (no cache);
2. of its final hidden states (B, L, H), the K positions L-K-1 .. L-2,
   which predict the kept tokens, go in the LM head's dtype (autocast's
   where autocast is on, as F.linear would) with the head's weight and
   bias to the op, which makes the logits in chunks of rows, softcaps them
   where the forward does (`config.final_logit_softcapping`: Gemma 2 and
   3, VaultGemma, NanoChat), divides them by the temperature and reduces
   each row to its log-probability and entropy.
The LM head module itself is never called (forward hooks on it do not
run); gradients reach every parameter through the op (input, weight,
bias) and the decoder.

How a model makes its logits from its decoder is read from its class's
forward (its source, once per class): the decoder it calls, how it reads
the hidden states, whether it softcaps. Whatever else a forward does
there is refused with a ValueError naming the class, the statement and
the attributes it reads, never reproduced approximately or ignored:
- a logit scale (Cohere's `self.logit_scale`, Granite's
  `self.config.logits_scaling`, Falcon-H1's `self.model.lm_head_multiplier`,
  HyperCLOVAX's). Folding it into the weight would build a scaled copy of
  the weight at every call; the caller is better told;
- hidden states scaled before the head (MiniCPM3, Inkling), other
  softcaps (RecurrentGemma, Inkling2), a head that is not the output
  embeddings' Linear layer on the decoder's output (ModernBERT's decoder
  after the head, BERT-style prediction heads), a decoder called with
  inputs the forward makes itself or without input_ids and attention_mask
  by name (RWKV, CPM-Ant, xLSTM).
Models without output embeddings (a bare decoder), heads that are not a
Linear layer (or apply's drop-in), and sharded models (FSDP2's
`fully_shard`, a DTensor head: their hooks run around forwards that are
not called here) are refused too.

Imports: `torch_pallas.ops` (the op, when called; its argument checks)
and `torch_pallas.nn` (its Linear, a head `apply` replaced); never
transformers, whose models it reads.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import sys
import textwrap

import torch

from torch_pallas import nn as pallas_nn
from torch_pallas.ops import checks as op_checks

WHERE = "torch_pallas.transformers.token_log_probs"
# The LM heads whose forward is `F.linear(x, weight, bias)` (apply's
# drop-in computes the same product on the Pallas matmul).
LINEAR_HEADS = (torch.nn.Linear, pallas_nn.Linear)
# Calls on the LM head's output (or input) that change no value.
NEUTRAL_METHODS = ("float", "contiguous")
FLOAT32 = ("torch.float32", "torch.float")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a causal LM class's forward makes its logits, as token_log_probs
    reproduces it: the decoder it calls (an attribute path from the model),
    how it reads the final hidden states from the decoder's output (an
    attribute name or an index), and whether it softcaps the logits with
    `config.final_logit_softcapping`."""

    decoder: tuple[str, ...]
    hidden_states: str | int
    softcap: bool


def token_log_probs(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, *,
                    logits_to_keep: int | None = None, temperature: float = 1.0,
                    return_entropy: bool = False):
    """float32 (B, K) log-probabilities of `input_ids[:, -K:]` under
    `model` (a transformers causal LM) given the tokens before each, at
    `temperature`; with `return_entropy=True` the tuple (log_probs,
    entropy), the entropy of each of those K positions' distributions.
    K = logits_to_keep, all but the first token when None.

    TRL's GRPOTrainer's `_get_per_token_logps_and_entropies` for one batch
    (this module's docstring), without the logits: the model's decoder runs
    on input_ids with attention_mask (passed as given: padding as the model
    treats it), and the fused op takes the LM head's weight and bias.
    Differentiable in every parameter. Raises ValueError for a model whose
    logits are more than its head's product (and Gemma's softcap), and for
    bad arguments.
    """
    keep = _checked_keep(input_ids, attention_mask, logits_to_keep, temperature,
                         return_entropy)
    head, plan = _head_and_plan(model)
    from torch_pallas.ops.token_log_probs import token_log_probs as pallas_token_log_probs

    length = input_ids.shape[1]
    hidden = _final_hidden_states(model, plan, input_ids, attention_mask)
    # position i predicts token i + 1: the K positions before the last
    hidden = hidden[:, length - keep - 1:length - 1]
    weight, bias = head.weight, head.bias
    if torch.is_autocast_enabled(weight.device.type):  # the head's product as F.linear's: cast
        dtype = torch.get_autocast_dtype(weight.device.type)
        weight, bias = weight.to(dtype), bias if bias is None else bias.to(dtype)
    hidden = hidden.to(device=weight.device, dtype=weight.dtype)
    target = input_ids[:, length - keep:].to(device=weight.device, dtype=torch.long)
    softcap = model.config.final_logit_softcapping if plan.softcap else None
    out = pallas_token_log_probs(hidden.reshape(-1, hidden.shape[-1]), weight,
                                 target.reshape(-1), bias, temperature=float(temperature),
                                 return_entropy=return_entropy, softcap=softcap)
    if return_entropy:
        log_probs, entropy = out
        return log_probs.reshape(target.shape), entropy.reshape(target.shape)
    return out.reshape(target.shape)


def _checked_keep(input_ids, attention_mask, logits_to_keep, temperature,
                  return_entropy) -> int:
    """K, the number of tokens scored, once the arguments are checked."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{WHERE}: input_ids must be a torch.Tensor, got "
                        f"{type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or (
            input_ids.dtype == torch.bool):
        raise TypeError(f"{WHERE}: input_ids must hold integer token ids, got dtype "
                        f"{input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"{WHERE}: input_ids must be 2-D (batch, length), got shape "
                         f"{tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    if length < 2:
        raise ValueError(f"{WHERE}: input_ids must hold at least 2 tokens a row (a token "
                         f"and one before it to predict it), got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                           and attention_mask.shape == input_ids.shape):
        got = (tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"{WHERE}: attention_mask must be None or a tensor of input_ids' "
                         f"shape {tuple(input_ids.shape)}, got {got}")
    if logits_to_keep is None:
        keep = length - 1
    elif isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, numbers.Integral):
        raise TypeError(f"{WHERE}: logits_to_keep must be an int or None, got "
                        f"{logits_to_keep!r}")
    elif not 1 <= logits_to_keep <= length - 1:
        raise ValueError(f"{WHERE}: logits_to_keep must be in [1, {length - 1}] (input_ids "
                         f"has {length} tokens a row), got {logits_to_keep}")
    else:
        keep = int(logits_to_keep)
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"{WHERE}: temperature must be a real number, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{WHERE}: temperature must be finite and > 0, got {temperature!r}")
    if not isinstance(return_entropy, bool):
        raise TypeError(f"{WHERE}: return_entropy must be True or False, got "
                        f"{return_entropy!r}")
    return keep


def refusal(model) -> str | None:
    """Why token_log_probs refuses `model` (the ValueError's message), or
    None where it serves it: a check before any compute."""
    try:
        _head_and_plan(model)
    except ValueError as refused:
        return str(refused)
    return None


def _head_and_plan(model) -> tuple[torch.nn.Module, Plan]:
    """The model's LM head and its class's Plan, or a ValueError saying why
    there is none."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WHERE}: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    name = type(model).__name__
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise ValueError(f"{WHERE}: {name} has no output embeddings (get_output_embeddings() "
                         "gives None): a causal LM with its LM head is needed")
    if type(head) not in LINEAR_HEADS:
        raise ValueError(f"{WHERE}: {name}'s output embeddings are a {type(head).__name__}, "
                         "not a Linear layer whose weight and bias make the logits")
    attribute = next((child for child, module in model.named_children() if module is head),
                     None)
    if attribute is None:
        raise ValueError(f"{WHERE}: {name}'s output embeddings (get_output_embeddings()) are "
                         "not one of its own attributes, so its forward does not call them "
                         "on the decoder's output itself")
    fsdp = sys.modules.get("torch.distributed.fsdp")  # loaded by whoever sharded the model
    if (fsdp is not None and isinstance(model, fsdp.FSDPModule)) or op_checks.is_dtensor(
            head.weight):
        raise ValueError(f"{WHERE}: {name} is sharded (fully_shard or tensor parallelism: its "
                         "LM head's weight is gathered or laid out by hooks around the model's "
                         "and the head's forwards, which token_log_probs does not call)")
    plan = read_forward(type(model), attribute)
    if isinstance(plan, str):
        raise ValueError(f"{WHERE}: {name}'s forward {plan}; token_log_probs computes the "
                         "LM head's product alone (and config.final_logit_softcapping): "
                         "score this model from its own logits")
    if not isinstance(_decoder(model, plan), torch.nn.Module):
        raise ValueError(f"{WHERE}: {name}'s forward reads its hidden states from "
                         f"self.{'.'.join(plan.decoder)}(...), which is not a module")
    return head, plan


def _decoder(model, plan: Plan):
    decoder = model
    for attribute in plan.decoder:
        decoder = getattr(decoder, attribute, None)
    return decoder


def _final_hidden_states(model, plan: Plan, input_ids, attention_mask) -> torch.Tensor:
    """(B, L, H): the decoder the forward calls, called on the batch."""
    decoder = _decoder(model, plan)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if "use_cache" in inspect.signature(decoder.forward).parameters:
        kwargs["use_cache"] = False  # nothing is generated: no key/value cache to fill
    outputs = decoder(**kwargs)
    if isinstance(plan.hidden_states, str) and not isinstance(outputs, tuple):
        hidden = getattr(outputs, plan.hidden_states)
    else:
        hidden = outputs[0 if isinstance(plan.hidden_states, str) else plan.hidden_states]
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise RuntimeError(f"{WHERE}: {type(model).__name__}'s decoder gave hidden states of "
                           f"shape {tuple(hidden.shape)}, not one per token of input_ids "
                           f"{tuple(input_ids.shape)}")
    return hidden


# --- reading a causal LM's forward ---------------------------------------------------

@functools.cache
def read_forward(cls: type, head: str) -> Plan | str:
    """The Plan of `cls.forward` (under its decorators), whose LM head is
    the attribute `head`, or what it does that token_log_probs does not
    (a phrase, for the error)."""
    forward = inspect.unwrap(cls.forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        return "has no source to read (how it makes its logits is unknown)"
    return plan_of(source, head)


def plan_of(source: str, head: str) -> Plan | str:
    """`read_forward` on the source of a forward (a `def`)."""
    function = ast.parse(source).body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "is not a function"
    arguments = function.args
    parameters = {a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                  arguments.vararg, arguments.kwarg) if a is not None}
    body = function.body
    at = next((i for i, statement in enumerate(body)
               if any(_calls_self(node, head) for node in ast.walk(statement))), None)
    if at is None:
        return f"does not call self.{head} (its output embeddings) itself"
    called = _head_call(body[at], head)
    if called is None:
        return _changes("makes its logits as", body[at], head)
    logits, argument = called
    if isinstance(argument, ast.Name):
        traced = _trace_hidden(body[:at], argument.id, head)
    else:  # self.lm_head(outputs[0])
        read = _decoder_output(argument)
        traced = (*read, at) if read is not None else _changes("makes its logits as", body[at],
                                                                head)
    if isinstance(traced, str):
        return traced
    outputs, read, start = traced
    decoder = _decoder_call(body[:start], outputs, parameters)
    if isinstance(decoder, str):
        return decoder
    softcap = False
    for statement in body[at + 1:]:
        if _is_final_softcap(statement, logits) and not softcap:
            softcap = True
        elif _only_with_labels(statement):
            continue  # token_log_probs, as TRL, passes no labels
        elif _rebinds(statement, logits) or _gives_other_logits(statement, logits):
            return _changes("changes its logits after the LM head:", statement, head)
    return Plan(decoder, read, softcap)


def _self_attribute(node) -> tuple[str, ...] | None:
    """("a", "b") for the expression `self.a.b`, else None."""
    path = []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "self" and path:
        return tuple(reversed(path))
    return None


def _calls_self(node, attribute: str) -> bool:
    return isinstance(node, ast.Call) and _self_attribute(node.func) == (attribute,)


def _strip_neutral(node):
    """`x` for `x.float()`, `x.contiguous()`, `x.to(torch.float32)` (any
    number of them): what the fused op's float32 output already is."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        passed = [*node.args, *(k.value for k in node.keywords)]
        if node.func.attr in NEUTRAL_METHODS and not passed:
            node = node.func.value
        elif node.func.attr == "to" and len(passed) == 1 and ast.unparse(passed[0]) in FLOAT32:
            node = node.func.value
        else:
            break
    return node


def _strip_selection(node, head: str):
    """`x` for `x[:, positions, :]` (the positions token_log_probs takes
    itself) and `x.to(self.head.weight.dtype)` or `.device` (the op takes
    the hidden states in the head's dtype, on its device)."""
    while True:
        if isinstance(node, ast.Subscript) and _positions_only(node.slice):
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "to" and all(
                  _self_attribute(a) in ((head, "weight", "dtype"), (head, "weight", "device"))
                  for a in (*node.args, *(k.value for k in node.keywords)))):
            node = node.func.value
        else:
            return node


def _head_call(statement, head: str):
    """(logits name, the head's input) for `logits = self.head(input)`,
    `_strip_neutral` and `_strip_selection` applied, else None."""
    if not (isinstance(statement, (ast.Assign, ast.AnnAssign))
            and len(_targets(statement)) == 1 and isinstance(_targets(statement)[0], ast.Name)):
        return None
    call = _strip_neutral(statement.value)
    if not (_calls_self(call, head) and len(call.args) == 1 and not call.keywords):
        return None
    return _targets(statement)[0].id, _strip_selection(call.args[0], head)


def _positions_only(index) -> bool:
    """`[:, positions, :]` or `[:, positions]`: a selection along the sequence."""
    if not (isinstance(index, ast.Tuple) and len(index.elts) in (2, 3)):
        return False
    whole = [e for i, e in enumerate(index.elts) if i != 1]
    return all(isinstance(e, ast.Slice) and e.lower is e.upper is e.step is None for e in whole)


def _targets(statement) -> list:
    if isinstance(statement, ast.Assign):
        return statement.targets
    if isinstance(statement, (ast.AugAssign, ast.AnnAssign)):
        return [statement.target]
    return []


def _names_bound(target) -> set[str]:
    """The names an assignment target binds or writes into (`x`, `x[i]`,
    `x.a`, tuples of them)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        return _names_bound(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_names_bound(e) for e in target.elts))
    return set()


def _rebinds(statement, name: str) -> bool:
    """Whether `statement` assigns `name`, writes into it or changes it in
    place (`x.mul_(...)`)."""
    for node in ast.walk(statement):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = _targets(node)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.NamedExpr)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars]
        else:
            targets = []
        if any(name in _names_bound(t) for t in targets):
            return True
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name
                and node.func.attr.endswith("_") and not node.func.attr.startswith("_")):
            return True
    return False


def _gives_other_logits(statement, logits: str) -> bool:
    """Whether `statement` passes something other than `logits` as an
    output's `logits=`."""
    return any(isinstance(node, ast.keyword) and node.arg == "logits"
               and not (isinstance(node.value, ast.Name) and node.value.id == logits)
               for node in ast.walk(statement))


def _changes(what: str, statement, head: str) -> str:
    """The refusal's phrase: the statement and the model's attributes it reads."""
    code = " ".join(ast.unparse(statement).split())
    if len(code) > 160:
        code = code[:157] + "..."
    read = sorted({".".join(path) for node in ast.walk(statement)
                   if (path := _self_attribute(node)) is not None and path[0] != head
                   and not isinstance(node.ctx, ast.Store)})
    # the longest chains only: self.config.logits_scaling, not self.config too
    read = [r for r in read if not any(o.startswith(r + ".") for o in read)]
    reads = f", reading {', '.join('self.' + r for r in read)}" if read else ""
    return f"{what} `{code}`{reads}"


def _trace_hidden(before: list, hidden: str, head: str):
    """From the head's input back to the decoder's output: (outputs name,
    how the hidden states are read from it, the index of the statement
    reading them), or a refusal. Between them only `_keeps_values`
    statements may touch the hidden states, alone or under an `if`."""
    for index in range(len(before) - 1, -1, -1):
        statement = before[index]
        if not _rebinds(statement, hidden) or _keeps_values(statement, hidden, head):
            continue
        if isinstance(statement, ast.If) and not statement.orelse and all(
                _keeps_values(inner, hidden, head) for inner in statement.body
                if _rebinds(inner, hidden)):
            continue  # GPT-2's model parallelism, a slice when the whole sequence came
        if _assigns_only(statement, hidden):
            value = statement.value
            if _calls_slice_logits_to_keep(value):
                value = value.args[0]
            read = _decoder_output(_strip_selection(value, head))
            if read is not None:
                return (*read, index)
        return _changes("computes its LM head's input as", statement, head)
    return f"calls self.{head} on {hidden}, which it does not read from a decoder's output"


def _assigns_only(statement, name: str) -> bool:
    """`name = ...` (or `name: T = ...`), nothing else bound."""
    return (isinstance(statement, (ast.Assign, ast.AnnAssign)) and statement.value is not None
            and [_names_bound(t) for t in _targets(statement)] == [{name}]
            and isinstance(_targets(statement)[0], ast.Name))


def _calls_slice_logits_to_keep(node) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "slice_logits_to_keep" and len(node.args) >= 1)


def _keeps_values(statement, hidden: str, head: str) -> bool:
    """`hidden = slice_logits_to_keep(hidden, ...)` or `hidden =
    hidden.to(self.head.weight.device)`: the same values, some positions."""
    if not _assigns_only(statement, hidden):
        return False
    value = statement.value
    if _calls_slice_logits_to_keep(value):
        value = value.args[0]
    value = _strip_selection(value, head)
    return isinstance(value, ast.Name) and value.id == hidden


def _decoder_output(node) -> tuple[str, str | int] | None:
    """(outputs name, "last_hidden_state" or 0) for `outputs.last_hidden_state`,
    `outputs[0]` or `outputs.last_hidden_state if return_dict else outputs[0]`."""
    if isinstance(node, ast.IfExp):
        either = {_decoder_output(node.body), _decoder_output(node.orelse)}
        names = {r[0] for r in either if r is not None}
        return (names.pop(), 0) if None not in either and len(names) == 1 else None
    if (isinstance(node, ast.Attribute) and node.attr == "last_hidden_state"
            and isinstance(node.value, ast.Name)):
        return node.value.id, "last_hidden_state"
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Constant) and node.slice.value == 0):
        return node.value.id, 0
    return None


def _decoder_call(before: list, outputs: str, parameters: set[str]):
    """The attribute path of the decoder in `outputs = self.decoder(...)`,
    called with the forward's own arguments (as token_log_probs calls it:
    input_ids and attention_mask as given, the rest their defaults), or a
    refusal."""
    for statement in reversed(before):
        if not _rebinds(statement, outputs):
            continue
        call = statement.value if isinstance(statement, (ast.Assign, ast.AnnAssign)) else None
        path = _self_attribute(call.func) if isinstance(call, ast.Call) else None
        if path is None or len(_targets(statement)) != 1:
            return _changes("computes its decoder's output as", statement, "")
        passed = [*call.args, *(k.value for k in call.keywords)]
        own = all(isinstance(v, ast.Constant)
                  or (isinstance(v, ast.Name) and v.id in parameters) for v in passed)
        named = {k.arg: k.value for k in call.keywords}
        if call.args:  # GPT-2 and others: the ids first, by position
            named.setdefault("input_ids", call.args[0])
        inputs = all(isinstance(named.get(n), ast.Name) and named[n].id == n
                     for n in ("input_ids", "attention_mask"))
        if not inputs:
            return _changes("does not pass its decoder input_ids and attention_mask by name:",
                            statement, "")
        if not own:
            return _changes("calls its decoder with inputs of its own:", statement, "")
        return path
    return f"reads its hidden states from {outputs}, which no decoder call makes"


def _only_with_labels(statement) -> bool:
    """`if labels is not None:` (no else): a block a call without labels skips."""
    test = getattr(statement, "test", None)
    return (isinstance(statement, ast.If) and not statement.orelse
            and isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot) and isinstance(test.left, ast.Name)
            and test.left.id == "labels" and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None)


def _is_final_softcap(statement, logits: str) -> bool:
    """Gemma's block: `if self.config.final_logit_softcapping is not None:`
    then `logits` = cap * tanh(logits / cap), the cap that config's."""
    if not (isinstance(statement, ast.If) and not statement.orelse):
        return False
    test = statement.test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
            and _self_attribute(test.left) == ("config", "final_logit_softcapping")):
        return False
    code = ast.unparse(statement.body)
    return ("tanh" in code and all(
        isinstance(s, (ast.Assign, ast.AnnAssign)) and [_names_bound(t) for t in _targets(s)]
        == [{logits}] for s in statement.body))
