"""The matmul op's per-layout plans (ops/matmul.py): a call whose operands
have a layout seen before reuses what was worked out for it (the views the
kernel reads, the buckets, the parameters). Every call here gets fresh
random data, so a plan that kept a tensor rather than a recipe would give a
stale result; each is compared against float64."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas import shape_buckets
from torch_pallas.ops import matmul as matmul_op


@pytest.fixture(autouse=True)
def fresh_plans():
    """No sizes seen, no plans: an earlier test's sizes would start buckets
    at a first call here (the buckets' state advances: a second plan)."""
    shape_buckets.reset()
    matmul_op._PLANS.clear()
    yield
    shape_buckets.reset()


def _check(a, b):
    got = torch_pallas.matmul(a, b)
    want = a.double() @ b.double()
    assert got.shape == want.shape and got.dtype == a.dtype
    scale = a.double().abs() @ b.double().abs() + 1
    assert ((got.double() - want).abs() <= 1e-5 * scale).all()


def _fresh(make):
    """`make`'s operands twice, the second time on new random data."""
    return make(), make()


LAYOUTS = {
    "linear_weight_t": lambda: (torch.randn(3, 37), torch.randn(53, 37).t()),
    "batch_folds": lambda: (torch.randn(2, 5, 37), torch.randn(37, 29)),
    "batched_both": lambda: (torch.randn(4, 7, 33), torch.randn(4, 33, 19)),
    "a_transposed": lambda: (torch.randn(41, 17).t(), torch.randn(41, 23)),
    "vector_matrix": lambda: (torch.randn(37), torch.randn(37, 11)),
    "matrix_vector": lambda: (torch.randn(9, 37), torch.randn(37)),
    "broadcast_copy": lambda: (torch.randn(1, 7, 33).expand(3, 7, 33), torch.randn(3, 33, 5)),
}


@pytest.mark.parametrize("make", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_repeated_layout_reuses_its_plan_on_new_data(make):
    first, second = _fresh(make)
    _check(*first)
    planned = len(matmul_op._PLANS)
    _check(*second)
    assert len(matmul_op._PLANS) == planned  # the second call found the first's plan
    # (a layout whose kernel operand is a copy, broadcast_copy's, gets none)
    assert planned == (0 if make is LAYOUTS["broadcast_copy"] else 1)


def test_a_plan_reads_each_calls_own_storage_offset():
    """Two slices of one buffer with the same shape and strides share a plan;
    each call reads its own rows."""
    x = torch.randn(20, 37)
    w = torch.randn(53, 37)
    for rows in (slice(0, 7), slice(5, 12), slice(13, 20)):
        _check(x[rows], w.t())
    assert len(matmul_op._PLANS) == 1


def test_plans_follow_the_buckets_and_the_precision_setting():
    """A plan made before its family's size changed is not used after it:
    the earlier size is bucketed from then on, as without plans. A change of
    torch's float32 precision setting gets its own plan."""
    w = torch.randn(53, 37)
    _check(torch.randn(100, 37), w.t())
    before = matmul_op._plan_key(torch.randn(100, 37), w.t())
    assert matmul_op._PLANS[before].sizes == ((100, 53, 37),) * 2
    _check(torch.randn(110, 37), w.t())  # the rows change: buckets from now on
    _check(torch.randn(100, 37), w.t())
    after = matmul_op._plan_key(torch.randn(100, 37), w.t())
    assert after != before and matmul_op._PLANS[after].sizes[1][0] == 128
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_op._plan_key(torch.randn(100, 37), w.t()) != after
    finally:
        torch.set_float32_matmul_precision(saved)


def test_a_plan_binds_its_kernel_only_while_the_backend_and_cache_stay():
    """A plan calls its kernel directly (launch.bound) from its second call
    on, and looks it up again when the requested backend changes (a
    simulator is never bound: it runs through launch.run) or the compile
    cache is cleared; results stay exact on fresh data throughout."""
    from torch_pallas import compile_cache, launch

    w = torch.randn(53, 37)
    x = lambda: torch.randn(3, 37)  # noqa: E731
    _check(x(), w.t())
    (plan,) = matmul_op._PLANS.values()
    _check(x(), w.t())
    bound = plan.call
    assert bound is not None and plan.bound_in == launch.binding_state()
    _check(x(), w.t())
    assert plan.call is bound  # kept
    with torch_pallas.backend("tpu_interpret"):
        _check(x(), w.t())
        assert plan.call is None  # the simulator runs through launch.run
    _check(x(), w.t())
    assert plan.call is not None and plan.call is not bound  # bound again on return
    rebound = plan.call
    compile_cache.clear()
    builds = compile_cache.compiled.builds
    _check(x(), w.t())
    assert plan.call is not rebound and compile_cache.compiled.builds == builds + 1
