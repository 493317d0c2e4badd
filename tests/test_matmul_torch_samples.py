"""pallas::matmul on every sample input PyTorch's own test suite uses for
matmul, mm, bmm and linear (torch.testing._internal's OpInfo database), on
every CPU backend, in float32, float16 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from torch_pallas.base import dtypes
from torch_pallas.ops import matmul as matmul_op
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive

# (torch.testing._internal needs expecttest, which the test extra installs)
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

OPS = ("matmul", "mm", "bmm", "nn.functional.linear")
OPINFOS = [op for op in op_db if op.name in OPS]


# The samples every torch from 2.11 on gives each op's OpInfo (torch 2.11:
# 37 in all; later versions add more, such as torch 2.13's bmm
# "triton_optimized" variant, 18 more): each op found, with all of them.
MIN_SAMPLES = {"matmul": 15, "mm": 3, "bmm": 1, "nn.functional.linear": 18}


def samples(dtype):
    for opinfo in OPINFOS:
        for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=False):
            yield opinfo.name, sample.input, sample.args


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
def test_torch_sample_inputs(cpu_backend, dtype):
    checked = dict.fromkeys(OPS, 0)
    for name, x, args in samples(dtype):
        what = f"{name} {tuple(x.shape)} x {[tuple(a.shape) for a in args]} {dtype}"
        if name == "nn.functional.linear":
            weight, bias = args[0], (args[1] if len(args) > 1 else None)
            out, expected = torch_pallas.linear(x, weight, bias), F.linear(x, weight, bias)
            b = weight.t()
        else:
            b = args[0]
            out, expected = torch.ops.pallas.matmul(x, b), torch.matmul(x, b)
        assert out.shape == expected.shape and out.dtype == expected.dtype, what
        ref = matmul_op.reference(x, b)
        bound = matmul_op.error_bound(x, b, ref) if ref.numel() else 0.0
        if name == "nn.functional.linear" and len(args) > 1:
            ref = ref + args[1].double()
            bound = bound + 2 * dtypes.ROUNDING[dtype] * ref.abs()
        assert_within(out, ref, bound, what)
        checked[name] += 1
    # the sample set is PyTorch's: make sure all of it was found
    assert all(checked[op] >= MIN_SAMPLES[op] for op in OPS), checked
