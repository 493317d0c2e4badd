"""pallas::grouped_mm under DTensor (torch_pallas/distributed/grouped_mm.py)
on a 2-process mesh (gloo on loopback, one start for every case, as
tests/test_dtensor.py starts its processes): each split of each form of
the op, in float32 and bfloat16, on ragged groups with an empty one and
(2-D x 3-D) rows past the last group.

For each case the worker splits fresh random tensors with the case's
placements, calls torch_pallas.grouped_mm and takes the gradients of a
weighted sum of the result; the parent checks that
- a split the rule allows runs shard-local (no collective inside the call,
  torch's CommDebugMode) and gives the expected placement, its gradients
  too where the case names them;
- a split the rule cannot express (the groups, or the dimension offs
  slices) is redistributed, never refused, and still right;
- the values (full_tensor) and the gradients of mat_a, mat_b and bias
  equal the op's float64 definition on the whole tensors
  (`ops.grouped_mm.reference`): within float32 rounding, or for bfloat16
  within a few roundings (a Partial result is rounded on each rank, then
  summed).
"""

from __future__ import annotations

import traceback
import zlib
from typing import NamedTuple

import pytest
import torch

import torch_pallas
from helpers import computed_once
from test_distributed import on_gloo_mesh
from test_dtensor import _placement, _relative_error
from torch_pallas.ops.grouped_mm import reference

WORLD = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# max |error| / max |reference|: float32 rounding; bfloat16's 2**-8 three times
# (each rank's Partial share and their sum), with room
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# Group sizes: an empty group, none a multiple of anything; the 24 rows (2-D
# x 3-D), K (2-D x 2-D) or columns (3-D x 2-D) offs slices end 3 past the
# last group. The forms' shapes are chosen so that their kernels are the
# same few (2-D x 3-D's three at each split), each built once per process:
# every form is the kernels of ragged rows and of the contraction over them
# (ops/grouped_mm.py).
SIZES = (5, 0, 9, 7)
ROWS = ((24, 7), (4, 7, 9), (4, 9))
BATCHED = ((4, 6, 7), (4, 7, 9), (4, 9))
CONTRACTION = ((7, 24), (24, 9), (4, 9))
COLUMNS = ((4, 7, 9), (9, 24), None)
NO_BIAS = slice(0, 2)


class Case(NamedTuple):
    shapes: tuple  # mat_a, mat_b, bias (None: no bias)
    offs: bool
    placements: tuple  # mat_a, mat_b, bias: "S<dim>", "R", "P" (Partial)
    result: str  # the output's placement; "R" where redistributed
    redistributed: bool = False
    grads: tuple | None = None  # the gradients' placements, where checked


CASES = {
    # 2-D x 3-D: tokens (24, 7) by experts (4, 7, 9), offs over the tokens
    "rows: columns split (tensor parallel)": Case(
        ROWS, True, ("R", "S2", "S1"), "S1", grads=("P", "S2", "S1")),
    "rows: contraction split, bias added once": Case(
        ROWS, True, ("S1", "S1", "R"), "P", grads=("S1", "S1", "R")),
    "rows: mat_a Partial": Case(ROWS, True, ("P", "R", "R"), "P"),
    "rows: mat_b Partial": Case(ROWS[NO_BIAS] + (None,), True, ("R", "P", None), "P"),
    "rows: experts split": Case(ROWS, True, ("R", "S0", "S0"), "R", redistributed=True),
    "rows: tokens split": Case(ROWS[NO_BIAS] + (None,), True, ("S0", "R", None), "R",
                               redistributed=True),
    # 3-D x 3-D: (4, 6, 7) @ (4, 7, 9), no offs
    "batched: experts split (expert parallel)": Case(
        BATCHED, False, ("S0", "S0", "S0"), "S0", grads=("S0", "S0", "S0")),
    "batched: rows split": Case(BATCHED, False, ("S1", "R", "R"), "S1", grads=("S1", "P", "P")),
    "batched: columns split": Case(BATCHED, False, ("R", "S2", "S1"), "S2"),
    "batched: contraction split": Case(BATCHED, False, ("S2", "S1", "R"), "P"),
    # 2-D x 2-D: (7, 24) and (24, 9), offs over the shared 24 -> (4, 7, 9)
    "contraction: rows split": Case(CONTRACTION, True, ("S0", "R", "R"), "S1",
                                    grads=("S0", "P", "P")),
    "contraction: columns split": Case(CONTRACTION, True, ("R", "S1", "S1"), "S2",
                                       grads=("P", "S1", "S1")),
    "contraction: groups' dimension split": Case(
        CONTRACTION[NO_BIAS] + (None,), True, ("S1", "S0", None), "R", redistributed=True),
    # 3-D x 2-D: (4, 7, 9) and (9, 24), offs over the 24 columns -> (7, 24)
    "columns: rows split": Case(COLUMNS, True, ("S1", "R", None), "S0", grads=("S1", "P")),
    "columns: contraction split": Case(COLUMNS, True, ("S2", "S0", None), "P",
                                       grads=("S2", "S0")),
    "columns: groups' columns split": Case(COLUMNS, True, ("R", "S1", None), "R",
                                           redistributed=True),
}
RUNS = [(name, dtype) for name in CASES for dtype in DTYPES]


def _offs(case: Case) -> torch.Tensor | None:
    if not case.offs:
        return None
    return torch.tensor(SIZES).cumsum(0).to(torch.int32)


def _shares(t) -> list[torch.Tensor]:
    """Each rank's share of a Partial t, in t's dtype (their exact sum in
    float64 is the tensor the reference takes)."""
    return [(t.float() * share).to(t.dtype) for share in (0.25, 0.75)]


def _distribute(t, mesh, name, rank):
    from torch.distributed.tensor import DTensor, distribute_tensor
    if name == "P":
        return DTensor.from_local(_shares(t)[rank], mesh, [_placement(name)])
    return distribute_tensor(t, mesh, [_placement(name)])


def _run(case: Case, dtype: torch.dtype, rank: int, mesh, seed: int) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    torch.manual_seed(seed)  # the same on both ranks
    full = [None if shape is None else torch.randn(shape).to(dtype) for shape in case.shapes]
    offs = _offs(case)
    split = [None if t is None else _distribute(t, mesh, p, rank).requires_grad_()
             for t, p in zip(full, case.placements)]
    split_offs = None if offs is None else distribute_tensor(offs, mesh, [Replicate()])
    with CommDebugMode() as comms:
        out = torch_pallas.grouped_mm(split[0], split[1], offs=split_offs, bias=split[2])
    found = {"placement": [str(p) for p in out.placements],
             "collectives": comms.get_total_counts(), "dtype": out.dtype}
    value = out.full_tensor()
    weights = torch.linspace(0.5, 1.5, value.numel()).reshape(value.shape)  # fixed, unequal
    wanted = [t for t in split if t is not None]
    grads = torch.autograd.grad((value.float() * weights).sum(), wanted)
    found["grad_placements"] = [[str(p) for p in g.placements] for g in grads]
    exact = [None if t is None else (sum(s.double() for s in _shares(t)) if p == "P"
                                     else t.double()).requires_grad_()
             for t, p in zip(full, case.placements)]
    expected = reference(exact[0], exact[1], offs=offs, bias=exact[2])
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(),
                                         [t for t in exact if t is not None])
    found["value_error"] = _relative_error(value, expected)
    found["grad_errors"] = [_relative_error(g.full_tensor(), e)
                            for g, e in zip(grads, expected_grads)]
    return found


# The backward op on the same DTensors (the columns split) asking for other
# gradients in turn: (output_mask, has_bias).
MASKS = (((False, True, False), False), ((True, True, True), True), ((True, False, False), False),
         ((False, False, True), True))


def _masks(rank, mesh, seed) -> dict:
    """Each call's results: their global shapes and, for those asked for,
    their relative errors against the op on the whole tensors."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    torch.manual_seed(seed)
    a, b, _ = (torch.randn(shape) for shape in ROWS)
    grad_out, offs = torch.randn(ROWS[0][0], ROWS[1][2]), _offs(CASES[RUNS[0][0]])
    split = [distribute_tensor(t, mesh, [_placement(p)])
             for t, p in ((grad_out, "S1"), (a, "R"), (b, "S2"), (offs, "R"))]
    found = {}
    for mask, has_bias in MASKS:
        whole = torch.ops.pallas.grouped_mm_backward(grad_out, a, b, offs, has_bias, list(mask))
        got = torch.ops.pallas.grouped_mm_backward(*split, has_bias, list(mask))
        found[mask, has_bias] = {
            "shapes": [tuple(g.shape) for g in got], "expected": [tuple(w.shape) for w in whole],
            "errors": [_relative_error(g.full_tensor(), w) for g, w in zip(got, whole)
                       if w.numel()]}
    return found


def _guarded(rank, mesh, name, dtype) -> dict:
    seed = zlib.crc32(f"{name} {dtype}".encode())
    try:
        if name == "output_mask":
            return _masks(rank, mesh, seed)
        return _run(CASES[name], DTYPES[dtype], rank, mesh, seed)
    except Exception:  # noqa: BLE001 (reported per case by the parent)
        return {"error": traceback.format_exc()}


def _collect(rank, mesh):
    return {run: _guarded(rank, mesh, *run) for run in RUNS + [("output_mask", "")]}


@pytest.fixture(scope="module")
def results(tmp_path_factory, worker_id):
    """Every run's findings (rank 0's), or its traceback, found once a run."""
    found = computed_once(tmp_path_factory, worker_id, "dtensor_grouped_mm", lambda: on_gloo_mesh(
        _collect, WORLD, tmp_path_factory.mktemp("dtensor_grouped_mm")))
    for name, dtype in RUNS:
        found.setdefault((name, dtype), {"error": "no result"})
    return found


def _found(results, name, dtype):
    assert "error" not in results[name, dtype], results[name, dtype].get("error")
    return results[name, dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_placements_and_collectives(results, name, dtype):
    """Shard-local in the expected placement where the rule allows the
    split; redistributed (collectives inside the call) where it cannot."""
    case, found = CASES[name], _found(results, name, dtype)
    assert found["placement"] == [str(_placement(case.result))], found
    if case.redistributed:
        assert found["collectives"] > 0, found
    else:
        assert found["collectives"] == 0, found
    if case.grads is not None:
        assert found["grad_placements"] == [[str(_placement(p))] for p in case.grads], found
    assert found["dtype"] == DTYPES[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_values_and_gradients_equal_the_definition(results, name, dtype):
    found = _found(results, name, dtype)
    wanted = sum(shape is not None for shape in CASES[name].shapes)
    assert len(found["grad_errors"]) == wanted, found
    tolerance = TOLERANCE[DTYPES[dtype]]
    assert found["value_error"] < tolerance, found
    assert max(found["grad_errors"]) < tolerance, found


def test_the_backward_is_decided_per_output_mask_and_bias(results):
    """DTensor caches a rule's decision and the results' shapes by the
    arguments; the backward op's gradients asked for (and the bias) decide
    its results' shapes: a call after one asking for others gets its own."""
    found = _found(results, "output_mask", "")
    for (mask, has_bias), call in found.items():
        assert call["shapes"] == call["expected"], (mask, has_bias, call)
        assert len(call["errors"]) == sum(mask[:2]) + (mask[2] and has_bias), call
        assert max(call["errors"]) < 1e-5, (mask, has_bias, call)
