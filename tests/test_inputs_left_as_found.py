"""A call leaves its input tensors exactly as it found them: the storage's
flags (resizable: FSDP2 frees an unsharded parameter by resizing its storage
to 0 after each use, and `Tensor.numpy()` had made it non-resizable for
good), the version counter, the layout (shape, strides, offset, data
pointer), requires_grad. Every registered op on every CPU backend, through
its forward and backward with inputs that require grad, and through its
public function twice without gradients (the direct path and matmul's
plans); a converted nn.Linear layer (its linear plans) beside them."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import backend_cases
from torch_pallas.runtime import registry

CPU = torch.device("cpu")

PROPERTIES = {
    "storage_resizable": lambda t: t.untyped_storage().resizable(),
    "version_counter": lambda t: t._version,
    "layout": lambda t: (tuple(t.shape), t.stride(), t.storage_offset(), t.data_ptr()),
    "requires_grad": lambda t: (t.requires_grad, t.is_leaf, t.grad_fn),
}


def _tensors(values):
    return [v for v in values if isinstance(v, torch.Tensor)]


def _backward(outputs):
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    total = sum((o.float() * torch.randn(o.shape)).sum()
                for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
    if isinstance(total, torch.Tensor):
        total.backward()


def _op_calls(info):
    """(tensors, run): an op's example inputs and the calls to make on them."""
    with_grad = info.examples(CPU, True)
    without = info.examples(CPU, False)
    tensors = [t for e in (*with_grad, *without) for t in _tensors((*e.args, *e.kwargs.values()))]

    def run():
        for e in with_grad:
            _backward(info.overload(*e.args, **e.kwargs))
        with torch.no_grad():
            for e in without:
                for _ in range(2):  # the second call finds what the first made
                    info.function(*e.args, **e.kwargs)

    return tensors, run


def _linear_calls():
    layer = torch_pallas.nn.replace_linear(torch.nn.Sequential(torch.nn.Linear(13, 7)))[0]
    x = torch.randn(5, 13)
    tensors = [layer.weight, layer.bias, x]

    def run():
        _backward(layer(x))
        with torch.no_grad():
            for _ in range(2):
                layer(x)

    return tensors, run


def _takes_tensors(info) -> bool:
    return any("Tensor" in str(a.type) for a in info.overload._schema.arguments)


# Factory ops (fill, iota) take no tensors: nothing of theirs to leave as found.
SUBJECTS = {info.name: (lambda info=info: _op_calls(info))
            for info in registry.ops() if _takes_tensors(info)}
SUBJECTS["nn.Linear"] = _linear_calls
# The attention ops on the simulators take tens of seconds: -m exhaustive.
CASES = backend_cases({subject: subject for subject in SUBJECTS})

_records: dict = {}


def record(backend: str, subject: str) -> dict:
    """Each property of each input before and after the calls, and what a
    resize of each resizable input's storage to 0 and back raised (None:
    nothing);
    made once per (backend, subject) and shared by the tests below."""
    key = (backend, subject)
    if key not in _records:
        tensors, run = SUBJECTS[subject]()
        before = [{name: read(t) for name, read in PROPERTIES.items()} for t in tensors]
        with torch_pallas.backend(backend):
            run()
        after = [{name: read(t) for name, read in PROPERTIES.items()} for t in tensors]
        resized = []
        for t, properties in zip(tensors, before):
            if not properties["storage_resizable"]:
                # Tensors that came out of a kernel (an example's saved forward
                # outputs): DLPack's import made them so, as torch.from_dlpack does.
                continue
            storage = t.untyped_storage()
            size = storage.nbytes()
            try:
                storage.resize_(0)
                storage.resize_(size)
                resized.append(None)
            except RuntimeError as e:
                resized.append(str(e))
        _records[key] = {"before": before, "after": after, "resized": resized,
                         "count": len(tensors)}
    return _records[key]


@pytest.mark.parametrize("prop", PROPERTIES)
@pytest.mark.parametrize("backend,subject", CASES)
def test_calls_leave_each_property_of_their_inputs(backend, subject, prop):
    found = record(backend, subject)
    assert found["count"] > 0, f"{subject} has no tensor inputs to check"
    for i, (before, after) in enumerate(zip(found["before"], found["after"])):
        assert after[prop] == before[prop], (
            f"{subject} on {backend}: input {i}'s {prop} was {before[prop]!r}, "
            f"is {after[prop]!r} after the calls")


@pytest.mark.parametrize("backend,subject", CASES)
def test_input_storages_resize_to_zero_and_back_after_calls(backend, subject):
    found = record(backend, subject)
    assert found["resized"], f"{subject}: no input storage to resize"
    failures = [(i, message) for i, message in enumerate(found["resized"]) if message]
    assert not failures, f"{subject} on {backend}: storages that would not resize: {failures}"
