"""The matmul op's per-layout plans (ops/matmul.py): a call whose operands
have a layout seen before reuses what was worked out for it (the views the
kernel reads, the buckets, the parameters). Every call here gets fresh
random data, so a plan that kept a tensor rather than a recipe would give a
stale result; each is compared against float64."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import shape_buckets
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
    from torch_pallas.runtime import compile_cache, launch

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


# --- linear plans: a no-grad linear call in one step --------------------------

@pytest.fixture
def linear_plan_runs(monkeypatch):
    """The linear plans' runs, counted."""
    runs = []
    run = matmul_op._LinearPlan.run

    def counting(plan, input, weight):
        runs.append(plan)
        return run(plan, input, weight)

    monkeypatch.setattr(matmul_op._LinearPlan, "run", counting)
    matmul_op._LINEAR_PLANS.clear()
    yield runs
    matmul_op._LINEAR_PLANS.clear()


def _check_linear(x, weight, rtol=1e-5):
    """torch_pallas.linear(x, weight) against float64, rounded to x's dtype."""
    got = torch_pallas.linear(x, weight)
    want = x.detach().double() @ weight.detach().double().t()
    assert got.shape == want.shape and got.dtype == x.dtype and got._base is None
    scale = x.detach().double().abs() @ weight.detach().double().abs().t() + 1
    assert ((got.double() - want).abs() <= rtol * scale).all()
    return got


# The weight as nn.Linear stores it (out, in), and as transformers' Conv1D
# hands it to linear: the transpose of its (in, out) parameter.
WEIGHTS = {
    "linear": lambda dtype: torch.nn.Parameter(torch.randn(53, 37, dtype=dtype)),
    "conv1d": lambda dtype: torch.nn.Parameter(torch.randn(37, 53, dtype=dtype)).t(),
}
INPUTS = {"rows": (3, 37), "batch": (2, 5, 37), "vector": (37,), "one_token": (1, 1, 37)}
ROUNDING = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.mark.parametrize("dtype", ROUNDING, ids=str)
@pytest.mark.parametrize("weight", WEIGHTS.values(), ids=WEIGHTS.keys())
@pytest.mark.parametrize("shape", INPUTS.values(), ids=INPUTS.keys())
def test_a_no_grad_linear_call_runs_its_linear_plan_on_fresh_data(linear_plan_runs, dtype,
                                                                   weight, shape):
    """The first call makes the op's plan and the linear plan from it; the
    next calls, on new data, run the linear plan, as exact as the op."""
    w = weight(dtype)
    with torch.no_grad():
        for _ in range(4):
            _check_linear(torch.randn(shape, dtype=dtype), w, ROUNDING[dtype])
    assert len(linear_plan_runs) == 3 and len(matmul_op._LINEAR_PLANS) == 1


def test_a_linear_plan_reads_the_weight_and_input_as_they_are_at_each_call(linear_plan_runs):
    """Nothing of a call's tensors is kept but the weight's crossing (a JAX
    array over its memory), which follows it: an in-place update of the
    weight, a weight whose data was replaced, a weight whose storage was
    freed and allocated again (FSDP2's way), an input that requires grad
    (under no_grad) and an inference tensor each give their own product."""
    w = torch.nn.Parameter(torch.randn(53, 37))
    with torch.no_grad():
        for _ in range(2):
            _check_linear(torch.randn(4, 37), w)
        w.mul_(-0.5)
        _check_linear(torch.randn(4, 37), w)
        w.data = torch.randn(53, 37)  # other storage, same layout: the same plan
        _check_linear(torch.randn(4, 37), w)
        storage = w.untyped_storage()
        size = storage.nbytes()
        storage.resize_(0)
        held = torch.randn(4096)  # may take the freed memory
        storage.resize_(size)
        w.copy_(torch.randn(53, 37))
        _check_linear(torch.randn(4, 37), w)
        _check_linear(torch.randn(4, 37, requires_grad=True), w)
    with torch.inference_mode():
        out = _check_linear(torch.randn(4, 37), w)
        assert out.is_inference()
    assert len(linear_plan_runs) == 6 and held.isfinite().all()


def test_a_weight_crosses_once_and_is_forgotten_with_it(linear_plan_runs):
    """The linear plan reads a weight through one JAX array over its memory,
    made at its first call and dropped when the weight is collected; a
    weight JAX would have to copy (unaligned: a slice at an odd offset) is
    read at each call instead, and every product is exact."""
    import gc

    from torch_pallas.runtime import bridge

    w = torch.nn.Parameter(torch.randn(53, 37))
    unaligned = torch.nn.Parameter(torch.randn(53 * 37 + 1)[1:].view(53, 37))
    kept = len(bridge._kept)
    with torch.no_grad():
        for _ in range(3):
            _check_linear(torch.randn(1, 1, 37), w)
            _check_linear(torch.randn(1, 1, 37), unaligned)
    arrays = {key[0]: entry[2] for key, entry in bridge._kept.items()}
    assert arrays[id(w)].unsafe_buffer_pointer() == w.data_ptr()
    assert arrays[id(unaligned)] is None
    assert len(linear_plan_runs) == 5 and len(bridge._kept) == kept + 2  # one plan for both
    del w, unaligned, arrays
    gc.collect()
    assert len(bridge._kept) == kept


def test_linear_calls_outside_a_linear_plan_take_the_op(linear_plan_runs):
    """A call needing a gradient, an input the kernel cannot read in place
    (transposed) and a weight of another layout (a column slice) run
    through the op, exactly."""
    w = torch.nn.Parameter(torch.randn(53, 37))
    for _ in range(2):
        out = _check_linear(torch.randn(4, 37), w)
        assert out.grad_fn is not None
    with torch.no_grad():
        for _ in range(2):
            _check_linear(torch.randn(37, 4).t(), w)
            _check_linear(torch.randn(4, 29), torch.randn(53, 40)[:, 3:32])
    assert linear_plan_runs == []


def test_linear_plans_follow_the_backend_the_cache_the_buckets_and_the_precision(linear_plan_runs):
    """A change of the requested backend, a cleared compile cache, a family
    whose size starts changing, and torch's float32 precision setting each
    call for another plan (or none: a simulator is never bound); results
    stay exact on fresh data throughout."""
    from torch_pallas.runtime import compile_cache

    w = torch.nn.Parameter(torch.randn(53, 37))
    x = lambda rows=100: torch.randn(rows, 37)  # noqa: E731
    with torch.no_grad():
        for _ in range(2):
            _check_linear(x(), w)
        (first,) = matmul_op._LINEAR_PLANS.values()
        assert linear_plan_runs == [first]
        with torch_pallas.backend("tpu_interpret"):
            for _ in range(2):
                _check_linear(x(), w)
        assert linear_plan_runs == [first] and len(matmul_op._LINEAR_PLANS) == 1
        _check_linear(x(), w)
        assert linear_plan_runs == [first, first]
        compile_cache.clear()
        builds = compile_cache.compiled.builds
        for _ in range(2):
            _check_linear(x(), w)
        assert compile_cache.compiled.builds == builds + 1 and linear_plan_runs[-1] is not first
        _check_linear(x(110), w)  # the rows change: 100 is bucketed to 128 from now on
        plans = len(matmul_op._LINEAR_PLANS)
        for _ in range(2):
            _check_linear(x(), w)  # a padded plan: through the op
        assert len(matmul_op._LINEAR_PLANS) == plans
        saved = torch.get_float32_matmul_precision()
        try:
            torch.set_float32_matmul_precision("high")
            runs = len(linear_plan_runs)
            for _ in range(2):
                _check_linear(x(7), w)
            assert len(linear_plan_runs) == runs + 1
            key = matmul_op._linear_key(x(7), w)
        finally:
            torch.set_float32_matmul_precision(saved)
        assert matmul_op._linear_key(x(7), w) != key
