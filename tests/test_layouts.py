"""Every registered op on inputs in the layouts models give them (transposed,
permuted, sliced, expanded: tests/layouts.py), built from the op's own
examples, so a new op is covered once it is registered:

- on every CPU backend, the op's fake describes exactly what its kernels
  return (sizes, strides, dtype, storage offset: opcheck's fake-tensor check);
- under torch.compile(fullgraph=True), with static and with dynamic shapes,
  the outputs and the gradients of every input that requires grad equal
  eager's. A compiled graph checks the strides a fake promised: a fake
  that promised an input's layout for a contiguous result failed there
  (attention_backward's `empty_like(q)` on a transposed q).
"""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import backend_cases
from layouts import LAYOUTS, compiled_matches_eager, rebased
from torch_pallas.runtime import registry

CPU = torch.device("cpu")


def examples(info):
    """The op's examples with inputs requiring grad where it has any, else
    those without (factory ops, the backward op)."""
    return info.examples(CPU, True) or info.examples(CPU, False)


# Every simulated call runs once per layout here; the attention ops on the
# simulators take a few seconds each, and go to -m exhaustive as in opcheck.
FAKE_CASES = backend_cases({info.name: info for info in registry.ops()})


@pytest.mark.parametrize("backend,info", FAKE_CASES)
def test_fakes_describe_what_the_kernels_return(backend, info):
    with torch_pallas.backend(backend):
        for example in info.examples(CPU, False):
            for layout in LAYOUTS:
                bases, rebuild = rebased(example.args, example.kwargs, layout)
                args, kwargs = rebuild(bases)
                torch.library.opcheck(info.overload, args, kwargs, test_utils="test_faketensor")


# A backward op (attention_backward, ...) compiles inside its forward op's
# compiled backward here already (static and dynamic); its own cases, a
# second compilation of the same kernels, run with -m exhaustive. So do the
# static cases of the model ops that tests/test_patching.py compiles
# statically inside a patched model by default (each op's dynamic case
# stays here): 20-30 s of compiling each.
COMPILED_IN_MODELS = ("attention", "rms_norm", "layer_norm", "rotary_embedding", "swiglu",
                      "linear_cross_entropy")
COMPILED_CASES = [
    pytest.param(info, dynamic, id=f"{info.name}-{'dynamic' if dynamic else 'static'}",
                 marks=[pytest.mark.exhaustive] if info.name.endswith("_backward") or (
                     info.name in COMPILED_IN_MODELS and not dynamic) else [])
    for info in registry.ops() for dynamic in (False, True)
]


@pytest.mark.parametrize("info,dynamic", COMPILED_CASES)
def test_compiled_forward_and_backward_equal_eager_on_model_layouts(info, dynamic):
    """Every example compiled with static shapes; the first with dynamic
    ones (which shapes the symbols stand for changes nothing of the fakes'
    strides, and each dynamic compilation costs seconds)."""
    chosen = examples(info)
    for number, example in enumerate(chosen[:1] if dynamic else chosen):
        compiled_matches_eager(info.overload, example.args, example.kwargs, dynamic=dynamic,
                               what=f"{info.name} example {number}")
