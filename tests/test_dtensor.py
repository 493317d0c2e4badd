"""Each Pallas op under DTensor, case by case, on a 2-process mesh (gloo on
loopback, started as tests/test_distributed.py starts its processes; one
start runs every case).

For each case the worker splits fresh random tensors with the case's
placements and calls the Pallas op and, on the same DTensors, torch's own
op (or the composition of torch ops it replaces). The parent checks that
- the Pallas op runs shard-local: no collective inside its call (read by
  torch's CommDebugMode) where the inputs' placements are ones its rule
  allows, and its results come out in the expected placements, the ones
  torch's op gives where torch's op runs on those DTensors;
- the values (full_tensor) and the gradients of every input that requires
  one equal torch's on the whole tensors in one process;
- a placement the rule does not allow is redistributed, never refused
  (the fused loss smoothing soft-capped logits over a vocabulary-split
  weight, attention with dropout).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import computed_once
from test_distributed import on_gloo_mesh
from torch_pallas.ops import varlen_attention
from torch_pallas.ops.linear_cross_entropy import torch_linear_cross_entropy
from torch_pallas.ops.token_log_probs import torch_token_log_probs
from torch_pallas.ops.rotary_embedding import torch_rotary_embedding  # transformers' composition

WORLD = 2


def _lce_reference(x, w, t, **kwargs):
    return F.cross_entropy(F.linear(x, w).float(), t, **kwargs)


def _targets(rows, vocab):
    t = torch.randint(0, vocab, (rows,))
    t[1] = -100  # one ignored token
    return t


def _dropout_reference(q, k, v):
    return torch_pallas.attention(q, k, v, dropout_p=0.3)  # same seed: same mask


def _sdpa_extras(q, k, v, sinks):
    """SDPA's math with a (3, 0) window, softcap 4 and sinks (torch ops)."""
    k, v = (t.repeat_interleave(2, 1) for t in (k, v))
    scores = 4.0 * torch.tanh((q @ k.mT) / q.shape[-1] ** 0.5 / 4.0)
    i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])
    scores = scores.masked_fill(~((j <= i) & (j >= i - 3)), float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v


class Case(NamedTuple):
    pallas: Callable
    torch: Callable  # torch's op, or the torch ops the Pallas one replaces
    inputs: list  # shapes, or (shape or maker, requires grad)
    placements: list  # "S<dim>", "R", "P" (Partial)
    results: list  # the results' placements
    collectives: int = 0  # inside the call (a split "mean"'s token count)
    # torch's op on the DTensors too (torch's CPU SDPA has no DTensor
    # strategy: with a mask DTensor takes minutes to find that out)
    torch_on_dtensors: bool = True
    # torch's op may replicate its operands first and answer Replicate where
    # ours stays shard-local: torch 2.14's nll_loss has no sharded strategy
    # for reduction="mean" (2.13 had one, Partial, and refused uneven shards)
    torch_may_replicate: bool = False


CASES = {
    "matmul rows": Case(torch_pallas.matmul, torch.matmul, [(6, 8), (8, 10)], ["S0", "R"], ["S0"]),
    "matmul columns": Case(torch_pallas.matmul, torch.matmul, [(6, 8), (8, 10)], ["R", "S1"],
                           ["S1"]),
    "matmul contracted": Case(torch_pallas.matmul, torch.matmul, [(6, 8), (8, 10)],
                              ["S1", "S0"], ["P"]),
    "matmul batch": Case(torch_pallas.matmul, torch.matmul, [(4, 6, 8), (4, 8, 10)],
                         ["S0", "S0"], ["S0"]),
    "matmul sequence @ weight": Case(torch_pallas.matmul, torch.matmul, [(3, 7, 8), (8, 10)],
                                     ["S1", "R"], ["S1"]),
    "matmul partial": Case(torch_pallas.matmul, torch.matmul, [(5, 8), (8, 6)], ["P", "R"],
                           ["P"]),
    "linear colwise": Case(torch_pallas.linear, F.linear, [(3, 5, 8), (10, 8)], ["R", "S0"],
                           ["S2"]),
    "linear rowwise": Case(torch_pallas.linear, F.linear, [(3, 5, 8), (10, 8)], ["S2", "S1"],
                           ["P"]),
    "add broadcast": Case(torch_pallas.add, torch.add, [(6, 8), (8,)], ["S1", "S0"], ["S1"]),
    "add partial": Case(torch_pallas.add, torch.add, [(6, 8), (6, 8)], ["P", "P"], ["P"]),
    "swiglu": Case(torch_pallas.swiglu, lambda g, u: F.silu(g) * u, [(3, 7, 8), (3, 7, 8)],
                   ["S1", "S1"], ["S1"]),
    "rms_norm sequence": Case(lambda x, w: torch_pallas.rms_norm(x, (16,), w),
                              lambda x, w: F.rms_norm(x, (16,), w), [(2, 7, 16), (16,)],
                              ["S1", "R"], ["S1"]),
    "rms_norm gemma sequence": Case(
        lambda x, w: torch_pallas.rms_norm(x, (16,), w, casting_mode="gemma"),
        lambda x, w: F.rms_norm(x, (16,)) * (1 + w), [(2, 7, 16), (16,)], ["S1", "R"], ["S1"]),
    "rms_norm two dims": Case(lambda x: torch_pallas.rms_norm(x, (3, 8)),
                              lambda x: F.rms_norm(x, (3, 8)), [(5, 3, 8)], ["S0"], ["S0"]),
    "layer_norm batch": Case(lambda x, w, b: torch_pallas.layer_norm(x, (16,), w, b),
                             lambda x, w, b: F.layer_norm(x, (16,), w, b),
                             [(3, 5, 16), (16,), (16,)], ["S0", "R", "R"], ["S0"]),
    "rotary heads": Case(torch_pallas.rotary_embedding, torch_rotary_embedding,
                         [(2, 4, 7, 8), (2, 2, 7, 8), ((2, 7, 8), False), ((2, 7, 8), False)],
                         ["S1", "S1", "R", "R"], ["S1", "S1"]),
    "rotary sequence": Case(torch_pallas.rotary_embedding, torch_rotary_embedding,
                            [(2, 4, 7, 8), (2, 2, 7, 8), ((2, 7, 8), False), ((2, 7, 8), False)],
                            ["S2", "S2", "S1", "S1"], ["S2", "S2"]),
    "rotary angle gradients": Case(torch_pallas.rotary_embedding, torch_rotary_embedding,
                                   [(2, 4, 7, 8), (2, 2, 7, 8), (2, 7, 8), (2, 7, 8)],
                                   ["S1", "S1", "R", "R"], ["S1", "S1"]),
    "attention heads causal gqa": Case(
        lambda q, k, v: torch_pallas.attention(q, k, v, is_causal=True, enable_gqa=True),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        [(2, 4, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8)], ["S1", "S1", "S1"], ["S1"],
        torch_on_dtensors=False),
    "attention batch masked": Case(
        lambda q, k, v, m: torch_pallas.attention(q, k, v, m),
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m),
        [(4, 2, 5, 8), (4, 2, 9, 8), (4, 2, 9, 8), ((4, 1, 5, 9), False)],
        ["S0", "S0", "S0", "S0"], ["S0"], torch_on_dtensors=False),
    # sinks split with the heads, cu_seq whole
    "varlen_attention heads window sinks": Case(
        lambda q, k, v, cu, s: torch_pallas.varlen_attention(
            q, k, v, cu, cu, 6, 6, window_size=(2, 0), enable_gqa=True, sinks=s, softcap=5.0),
        lambda q, k, v, cu, s: varlen_attention.reference(
            q, k, v, cu, cu, window_size=(2, 0), enable_gqa=True, sinks=s, softcap=5.0,
            dtype=q.dtype),
        [(11, 4, 8), (11, 2, 8), (11, 2, 8),
         (lambda: torch.tensor([0, 5, 5, 11], dtype=torch.int32), False), (4,)],
        ["S1", "S1", "S1", "R", "S0"], ["S1"], torch_on_dtensors=False),
    "attention heads window softcap sinks": Case(
        lambda q, k, v, s: torch_pallas.attention(q, k, v, window_size=(3, 0), softcap=4.0,
                                                  sinks=s, enable_gqa=True),
        lambda q, k, v, s: _sdpa_extras(q, k, v, s),
        [(2, 4, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8), (4,)], ["S1", "S1", "S1", "S0"], ["S1"],
        torch_on_dtensors=False),
    # the loss Partial over the ranks' tokens, divided by their count (one
    # all-reduce of a scalar)
    "linear_cross_entropy tokens mean": Case(
        torch_pallas.linear_cross_entropy, _lce_reference,
        [(9, 8), (11, 8), (lambda: _targets(9, 11), False)], ["S0", "R", "S0"], ["P"],
        collectives=1, torch_may_replicate=True),
    "linear_cross_entropy tokens sum smoothed": Case(
        lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="sum",
                                                          label_smoothing=0.1),
        lambda x, w, t: _lce_reference(x, w, t, reduction="sum", label_smoothing=0.1),
        [(9, 8), (11, 8), (lambda: _targets(9, 11), False)], ["S0", "R", "S0"], ["P"]),
    "linear_cross_entropy tokens none": Case(  # (4, 3) tokens: DTensor flattens even splits only
        lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="none"),
        lambda x, w, t: _lce_reference(x.flatten(0, 1), w, t.flatten(), reduction="none"
                                       ).reshape(t.shape),
        [(4, 3, 8), (11, 8), (lambda: _targets(12, 11).reshape(4, 3), False)],
        ["S0", "R", "S0"], ["S0"]),
    "linear_logsumexp tokens": Case(
        lambda x, w: torch.ops.pallas.linear_logsumexp(x, w, None, None),
        lambda x, w: torch.logsumexp(F.linear(x, w).float(), -1),
        [(9, 8), (11, 8)], ["S0", "R"], ["S0"]),
    # a ColwiseParallel LM head: each rank's vocabulary shard (11 classes:
    # 6 and 5), the rows' log-sum-exps gathered and their target logits
    # summed (the two collectives), never the weight or the logits
    "linear_cross_entropy vocabulary mean": Case(
        torch_pallas.linear_cross_entropy, _lce_reference,
        [(9, 8), (11, 8), (lambda: _targets(9, 11), False)], ["R", "S0", "R"], ["R"],
        collectives=2),
    "linear_cross_entropy vocabulary sum smoothed bias": Case(
        lambda x, w, t, b: torch_pallas.linear_cross_entropy(x, w, t, b, reduction="sum",
                                                             label_smoothing=0.1),
        lambda x, w, t, b: torch_linear_cross_entropy(x, w, t, b, reduction="sum",
                                                      label_smoothing=0.1),
        [(9, 8), (13, 8), (lambda: _targets(9, 13), False), (13,)], ["R", "S0", "R", "S0"],
        ["R"], collectives=2),
    "linear_cross_entropy vocabulary none softcap": Case(
        lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="none", softcap=3.0),
        lambda x, w, t: torch_linear_cross_entropy(x, w, t, reduction="none", softcap=3.0),
        [(3, 3, 8), (11, 8), (lambda: _targets(9, 11).reshape(3, 3), False)], ["R", "S0", "R"],
        ["R"], collectives=2),
    # per-token log-probs and entropy: the tokens split, and a ColwiseParallel
    # LM head (each rank's (lse, E) gathered, the target logits summed)
    "token_log_probs tokens": Case(
        lambda x, w, t: torch_pallas.token_log_probs(x, w, t, temperature=0.7,
                                                     return_entropy=True),
        lambda x, w, t: torch_token_log_probs(x, w, t, temperature=0.7, return_entropy=True),
        [(9, 8), (11, 8), (lambda: _targets(9, 11), False)], ["S0", "R", "S0"], ["S0", "S0"],
        torch_on_dtensors=False),
    "token_log_probs vocabulary bias softcap": Case(
        lambda x, w, t, b: torch_pallas.token_log_probs(x, w, t, b, temperature=0.7,
                                                        return_entropy=True, softcap=3.0),
        lambda x, w, t, b: torch_token_log_probs(x, w, t, b, temperature=0.7,
                                                 return_entropy=True, softcap=3.0),
        [(3, 3, 8), (13, 8), (lambda: _targets(9, 13).reshape(3, 3), False), (13,)],
        ["R", "S0", "R", "S0"], ["R", "R"], collectives=2, torch_on_dtensors=False),
}
# Placements a rule does not allow: DTensor redistributes them first.
REDISTRIBUTED = {
    # the smoothing term of capped logits needs every logit: the weight gathered
    "linear_cross_entropy vocabulary smoothed softcap": Case(
        lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, label_smoothing=0.1,
                                                          softcap=3.0),
        lambda x, w, t: torch_linear_cross_entropy(x, w, t, label_smoothing=0.1, softcap=3.0),
        [(9, 8), (11, 8), (lambda: _targets(9, 11), False)], ["R", "S0", "R"], ["R"]),
    "attention dropout heads": Case(
        lambda q, k, v: torch_pallas.attention(q, k, v, dropout_p=0.3),
        _dropout_reference, [(2, 4, 7, 8), (2, 4, 7, 8), (2, 4, 7, 8)], ["S1", "S1", "S1"],
        ["R"], torch_on_dtensors=False),
}
ALL = {**CASES, **REDISTRIBUTED}


def _placement(name):
    from torch.distributed.tensor import Partial, Replicate, Shard
    if name == "R":
        return Replicate()
    if name == "P":
        return Partial()
    return Shard(int(name[1:]))


def _inputs(makers):
    made = []
    for maker in makers:
        shape, grad = maker if isinstance(maker[-1], bool) else (maker, True)
        t = shape() if callable(shape) else torch.randn(shape)
        made.append(t.requires_grad_(grad))
    return made


def _distribute(t, mesh, name, rank):
    from torch.distributed.tensor import DTensor, distribute_tensor
    if name == "P":  # a Partial DTensor: the ranks' local tensors sum to t
        local = t.detach() * (0.25 if rank == 0 else 0.75)
        return DTensor.from_local(local, mesh, [_placement(name)]).requires_grad_(t.requires_grad)
    return distribute_tensor(t.detach(), mesh, [_placement(name)]).requires_grad_(t.requires_grad)


def _results(out):
    return out if isinstance(out, tuple) else (out,)


def _weights(outs):
    """Fixed, unequal weights for a scalar loss over every result."""
    return [torch.linspace(0.5, 1.5, o.numel()).reshape(o.shape) for o in outs]


def _run_case(name, rank, mesh):
    from torch.distributed.tensor.debug import CommDebugMode
    case = ALL[name]
    torch.manual_seed(7)
    full = _inputs(case.inputs)
    split = [_distribute(t, mesh, p, rank) for t, p in zip(full, case.placements)]
    wanted = [i for i, t in enumerate(full) if t.requires_grad]
    seed = 11
    torch.manual_seed(seed)
    with CommDebugMode() as comms:
        outs = _results(case.pallas(*split))
    found = {"placements": [[str(p) for p in o.placements] for o in outs],
             "local_shapes": [tuple(o.to_local().shape) for o in outs],
             "collectives": comms.get_total_counts()}
    values = [o.full_tensor() for o in outs]
    weights = _weights(values)
    grads = torch.autograd.grad(sum((v.float() * w).sum() for v, w in zip(values, weights)),
                                [split[i] for i in wanted])
    found["grad_placements"] = [[str(p) for p in g.placements] for g in grads]
    torch.manual_seed(seed)
    expected = _results(case.torch(*full))
    expected_grads = torch.autograd.grad(
        sum((e.float() * w).sum() for e, w in zip(expected, weights)), [full[i] for i in wanted])
    found["value_errors"] = [_relative_error(v, e) for v, e in zip(values, expected)]
    found["grad_errors"] = [_relative_error(g.full_tensor(), e)
                            for g, e in zip(grads, expected_grads)]
    found["torch_placements"] = None
    try:  # torch's own op on the same DTensors, where DTensor runs it
        if not case.torch_on_dtensors:
            return found
        torch.manual_seed(seed)
        theirs = _results(case.torch(*split))
        found["torch_placements"] = [[str(p) for p in o.placements] for o in theirs]
    except Exception as error:  # noqa: BLE001 (torch's op, not ours: recorded)
        found["torch_placements"] = f"{type(error).__name__}: {str(error)[:200]}"
    return found


def _relative_error(got, expected):
    got, expected = got.detach().double(), expected.detach().double()
    return ((got - expected).abs().max() / (expected.abs().max() + 1e-30)).item()


def _collect(rank, mesh):
    found = {}
    for name in ALL:
        try:
            found[name] = _run_case(name, rank, mesh)
        except Exception:  # noqa: BLE001 (reported per case by the parent)
            found[name] = {"error": traceback.format_exc()}
    return found


@pytest.fixture(scope="module")
def results(tmp_path_factory, worker_id):
    return computed_once(tmp_path_factory, worker_id, "dtensor", lambda: on_gloo_mesh(
        _collect, WORLD, tmp_path_factory.mktemp("dtensor")))


def _case(results, name):
    found = results[name]
    assert "error" not in found, found.get("error")
    return found


def _names(placements):
    return [[str(_placement(p))] for p in placements]


@pytest.mark.parametrize("name", CASES)
def test_runs_shard_local_in_torchs_placements(results, name):
    found = _case(results, name)
    assert found["placements"] == _names(CASES[name].results), found
    assert found["collectives"] == CASES[name].collectives, found
    theirs = found["torch_placements"]
    if isinstance(theirs, list) and not (
            CASES[name].torch_may_replicate and all(p == ["R"] for p in theirs)):
        assert found["placements"] == theirs, found


@pytest.mark.parametrize("name", ALL)
def test_values_and_gradients_equal_torchs(results, name):
    found = _case(results, name)
    assert found["grad_placements"], "every case has an input that requires grad"
    assert max(found["value_errors"]) < 1e-5, found
    assert max(found["grad_errors"]) < 1e-5, found


@pytest.mark.parametrize("name", REDISTRIBUTED)
def test_placements_a_rule_does_not_allow_are_redistributed(results, name):
    found = _case(results, name)
    assert found["placements"] == _names(REDISTRIBUTED[name].results), found
    assert found["collectives"] > 0, found


def test_local_shards_have_the_split_shapes(results):
    """A sequence-split Linear input reaches the kernel as each rank's half."""
    assert results["matmul sequence @ weight"]["local_shapes"] == [(3, 4, 10)]
    assert results["rms_norm sequence"]["local_shapes"] == [(2, 4, 16)]
    assert results["attention heads causal gqa"]["local_shapes"] == [(2, 2, 7, 8)]
    assert math.prod(results["linear colwise"]["local_shapes"][0]) == 3 * 5 * 5


def test_parameter_gradients_are_partial_sums_where_the_rows_split(results):
    """A weight's gradient sums over the rows: where they split, each rank
    holds its rows' share (Partial), reduced when read, as torch's norms'."""
    assert results["rms_norm sequence"]["grad_placements"] == [["S(1)"], ["P(sum)"]]
    assert results["layer_norm batch"]["grad_placements"] == [["S(0)"], ["P(sum)"], ["P(sum)"]]
    assert results["rotary angle gradients"]["grad_placements"][2:] == [["P(sum)"], ["P(sum)"]]
    assert results["linear_cross_entropy tokens none"]["grad_placements"] == [["S(0)"],
                                                                             ["P(sum)"]]


def test_a_vocabulary_split_weight_keeps_its_gradient_split(results):
    """Each rank's share of the input's gradient is Partial (its classes'
    part); the weight's and the bias's gradients stay on their shards."""
    found = results["linear_cross_entropy vocabulary sum smoothed bias"]
    assert found["grad_placements"] == [["P(sum)"], ["S(0)"], ["S(0)"]], found


REGISTRATION = """
import sys
{first}
assert "torch.distributed.tensor" in sys.modules or "torch_pallas" in sys.modules
{second}
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
a = distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
out = torch_pallas.matmul(a, distribute_tensor(torch.randn(3, 2), mesh, [Replicate()]))
print(out.placements)
dist.destroy_process_group()
"""
LONE_IMPORT = ("import sys, torch_pallas; "
               "assert 'torch.distributed.tensor' not in sys.modules, 'imported DTensor'")


@pytest.mark.parametrize("first,second", [
    ("import torch_pallas", "import torch.distributed.tensor"),
    ("import torch.distributed.tensor", "import torch_pallas"),
], ids=["torch_pallas first", "DTensor first"])
def test_the_rules_register_whichever_is_imported_first(first, second):
    """The rules register when DTensor loads, after torch_pallas or before
    it; torch_pallas alone does not import DTensor (a second)."""
    import subprocess
    import sys
    if first == "import torch_pallas":
        subprocess.run([sys.executable, "-c", LONE_IMPORT], check=True)
    run = subprocess.run([sys.executable, "-c", REGISTRATION.format(first=first, second=second)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(Shard(dim=0),)" in run.stdout, run.stdout  # rows split, as the rule allows
