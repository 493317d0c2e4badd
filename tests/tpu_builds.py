"""Every TPU-family kernel build the ops make, compiled by Mosaic for an
abstract TPU v5e or v6e with libtpu's compile-only client: no chip needed.

Why: interpret mode is not the compiler. A TPU kernel that passes every
simulated test (`interpret`, `tpu_interpret`) and lowers to a Mosaic custom
call (tests/test_tpu_lowering.py) can still fail Mosaic's own passes
(layouts, vector shapes, VMEM) for a real chip. libtpu compiles for a
described chip on this CPU machine (../shared/notes/tpu.md):

    jax.jit(f).lower(*avals on an abstract TPU device).compile()

A build is one kernel call an op makes: the kernel's op name, its inputs'
(shape, dtype) and the op's static parameters, as `launch.run` gets them
(kernels/spec.py). They are found without computing anything: `record` runs
an op's calls, forward and backward (torch autograd), under `Recorder`,
which stands in for `launch.run`: it notes the call and returns zeros shaped
as the kernel's outputs (`jax.eval_shape` of the kernel). Large, realistic
shapes (an 8192^2 matmul, attention over 2048 tokens) cost the time of
making their random inputs, not of the products. Shape buckets are off
while recording: a chip gets each call's own sizes, not the CPU's padded ones.

The calls of an op: its registered examples (`registry.get(op).examples`),
and realistic LLM-sized calls (`REALISTIC`) in every dtype the op accepts
(the op module's `DTYPES`). The `default` tier holds the examples and each
unmarked realistic case in bfloat16 (the dtype models train in; the first
dtype of an op without it); the `exhaustive` tier the other dtypes and the
cases marked `exhaustive`.

Run as a script, in a process of its own: libtpu's settings (`LIBTPU_ENV`)
must be in the environment before JAX starts, and must not reach the other
tests' processes.

    python tests/tpu_builds.py OP [--tier default|exhaustive|all] [--chips v5e,v6e]

prints one JSON object on stdout (`report`); whatever else the process
prints (libtpu's logs, warnings) goes to stderr. `run_subprocess` does that
from another process: tests/test_tpu_compile.py and
bench/tpu_compile_report.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

# libtpu's compile-only client on a machine that is not a TPU VM: JAX on the
# CPU, no query of the TPU VM's metadata service, a stand-in accelerator
# type and worker list. ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu otherwise takes
# /tmp/libtpu_lockfile for the process, which any other JAX process on the
# machine with libtpu installed may hold (a pytest worker) and which two
# compiling processes (xdist) would fight over; this process opens no chip.
LIBTPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

# Chip -> the topology libtpu describes it by (one chip, one TensorCore).
CHIPS = {"v5e": "v5e:1x1", "v6e": "v6e:1x1"}
TIERS = ("default", "exhaustive", "all")
FAMILY_BACKEND = "tpu_interpret"  # a backend whose family is the TPU kernels
CONFIG_BACKEND = "tpu"  # the configs' name for the hardware (spec.config)
DETAIL_LINES = 12  # lines of a compile error kept besides its first
MAX_LINE = 240  # characters of an error's first line kept


def libtpu_installed() -> bool:
    """Whether libtpu (the compile-only client) can be imported here."""
    return importlib.util.find_spec("libtpu") is not None


# --- the calls: examples and realistic shapes ---------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One realistic call of an op: `call(dtype)` makes it on fresh random
    inputs, forward and backward. `dtypes`: the dtypes it runs in (None:
    every dtype the op accepts); `exhaustive`: only in the exhaustive tier."""

    name: str
    call: Callable
    dtypes: tuple | None = None
    exhaustive: bool = False


def _tensor(shape, dtype, grad: bool = True):
    """Random values (normal floats, small ints), requiring grad when
    floating and `grad`."""
    import torch

    if dtype.is_floating_point:
        t = torch.randn(shape, dtype=dtype)
        return t.requires_grad_(grad)
    return torch.randint(-100, 100, shape, dtype=dtype)


def _backward(*outputs) -> None:
    """Backpropagates a random cotangent through the floating outputs that
    require grad (none: nothing to do)."""
    import torch

    loss = None
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            term = (out.float() * torch.randn(out.shape)).sum()
            loss = term if loss is None else loss + term
    if loss is not None:
        loss.backward()


def _fill(shape):
    def call(dtype):
        import torch_pallas

        torch_pallas.fill(shape, 3 if not dtype.is_floating_point else 1.5, dtype=dtype)
    return call


def _iota(n):
    def call(dtype):
        import torch_pallas

        torch_pallas.iota(n, dtype=dtype)
    return call


def _add(x_shape, y_shape):
    def call(dtype):
        import torch_pallas

        _backward(torch_pallas.add(_tensor(x_shape, dtype), _tensor(y_shape, dtype)))
    return call


def _matmul(m, k, n):
    def call(dtype):
        import torch_pallas

        _backward(torch_pallas.matmul(_tensor((m, k), dtype), _tensor((k, n), dtype)))
    return call


def _attention(b=2, hq=8, hkv=8, length=2048, d=128, causal=True, sinks=False, **kwargs):
    def call(dtype):
        import torch_pallas

        q = _tensor((b, hq, length, d), dtype)
        k, v = _tensor((b, hkv, length, d), dtype), _tensor((b, hkv, length, d), dtype)
        extra = {"sinks": _tensor((hq,), dtype)} if sinks else {}
        _backward(torch_pallas.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                         **kwargs, **extra))
    return call


def _varlen_attention(lengths, hq=8, hkv=8, d=128, **kwargs):
    def call(dtype):
        import torch

        import torch_pallas

        tokens = sum(lengths)
        q = _tensor((tokens, hq, d), dtype)
        k, v = _tensor((tokens, hkv, d), dtype), _tensor((tokens, hkv, d), dtype)
        cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        _backward(torch_pallas.varlen_attention(q, k, v, cu_seq, cu_seq, max(lengths),
                                                max(lengths), enable_gqa=hq != hkv, **kwargs))
    return call


def _norm(op, rows, hidden, bias=False):
    def call(dtype):
        import torch_pallas

        x, w = _tensor((rows, hidden), dtype), _tensor((hidden,), dtype)
        extra = (_tensor((hidden,), dtype),) if bias else ()
        _backward(getattr(torch_pallas, op)(x, (hidden,), w, *extra))
    return call


def _grouped_mm(group_rows, k, n):
    def call(dtype):
        import torch

        import torch_pallas

        offs = torch.tensor(group_rows).cumsum(0).to(torch.int32)
        a, b = _tensor((sum(group_rows), k), dtype), _tensor((len(group_rows), k, n), dtype)
        _backward(torch_pallas.grouped_mm(a, b, offs=offs))
    return call


def _linear_cross_entropy(tokens, hidden, vocab):
    def call(dtype):
        import torch

        import torch_pallas

        target = torch.randint(0, vocab, (tokens,))
        _backward(torch_pallas.linear_cross_entropy(_tensor((tokens, hidden), dtype),
                                                    _tensor((vocab, hidden), dtype), target))
    return call


def _token_log_probs(tokens, hidden, vocab):
    """A GRPO step's call: log-probs at temperature 0.7 and the entropy,
    backward through both (token_log_probs_backward's builds, by autograd)."""
    def call(dtype):
        import torch

        import torch_pallas

        target = torch.randint(0, vocab, (tokens,))
        _backward(*torch_pallas.token_log_probs(_tensor((tokens, hidden), dtype),
                                                _tensor((vocab, hidden), dtype), target,
                                                temperature=0.7, return_entropy=True))
    return call


def _swiglu(tokens, width):
    def call(dtype):
        import torch_pallas

        _backward(torch_pallas.swiglu(_tensor((tokens, width), dtype),
                                      _tensor((tokens, width), dtype)))
    return call


def _rotary_embedding(b, hq, hkv, length, d):
    def call(dtype):
        import torch_pallas

        q, k = _tensor((b, hq, length, d), dtype), _tensor((b, hkv, length, d), dtype)
        cos, sin = _tensor((b, length, d), dtype, False), _tensor((b, length, d), dtype, False)
        _backward(*torch_pallas.rotary_embedding(q, k, cos, sin, 1))
    return call


def _rotary_embedding_backward(b, hq, hkv, length, d):
    def call(dtype):
        import torch_pallas

        def heads(h):
            return _tensor((b, h, length, d), dtype, False)

        cos, sin = _tensor((b, length, d), dtype, False), _tensor((b, length, d), dtype, False)
        torch_pallas.rotary_embedding_backward(heads(hq), heads(hkv), cos, sin, 1, heads(hq),
                                               heads(hkv))
    return call


# An LLM's sizes: Llama-like, 4096 tokens (2 x 2048), hidden 1024-8192.
PACKED = (1000, 517, 1579, 1000)  # uneven sequences, 4096 tokens
REALISTIC: dict[str, list[Case]] = {
    "add": [Case("4096x4096 + 4096", _add((4096, 4096), (4096,)))],
    "fill": [Case("4096x4096", _fill((4096, 4096))),
             Case("8192x14336", _fill((8192, 14336)))],
    "iota": [Case("2^20", _iota(1 << 20)), Case("2^24", _iota(1 << 24))],
    "matmul": [
        Case("1024x1024 @ 1024x1024", _matmul(1024, 1024, 1024)),
        Case("16x4096 @ 4096x4096", _matmul(16, 4096, 4096)),
        Case("2048x2048 @ 2048x2048", _matmul(2048, 2048, 2048), exhaustive=True),
        Case("4096x4096 @ 4096x4096", _matmul(4096, 4096, 4096), exhaustive=True),
        Case("8192x8192 @ 8192x8192", _matmul(8192, 8192, 8192), exhaustive=True),
        Case("8192x4096 @ 4096x128", _matmul(8192, 4096, 128), exhaustive=True),
    ],
    "attention": [
        Case("B2 H8 L2048 D128 causal", _attention()),
        Case("B2 H8/2 L2048 D128 causal GQA", _attention(hkv=2), exhaustive=True),
        # dq's float32 rows of 8 query heads (128 MiB) past the VMEM: dq apart
        Case("B1 H32/4 L16384 D128 causal GQA", _attention(b=1, hq=32, hkv=4, length=16384),
             exhaustive=True),
        Case("B2 H8 L2048 D128 window (512, 0)", _attention(causal=False, window_size=(512, 0)),
             exhaustive=True),
        # a query block wide: the diagonal key block first, maxima unguarded
        Case("B2 H8 L2048 D128 window (1023, 0)",
             _attention(causal=False, window_size=(1023, 0)), exhaustive=True),
        Case("B2 H8 L2048 D128 causal softcap 30", _attention(softcap=30.0), exhaustive=True),
        Case("B2 H8 L2048 D128 causal sinks", _attention(sinks=True), exhaustive=True),
    ],
    "varlen_attention": [
        Case(f"packed {PACKED} H8 D128 causal", _varlen_attention(PACKED, window_size=(-1, 0))),
        Case(f"packed {PACKED} H8/2 D128", _varlen_attention(PACKED, hkv=2), exhaustive=True),
    ],
    "rms_norm": [Case("4096x4096", _norm("rms_norm", 4096, 4096)),
                 Case("4096x8192", _norm("rms_norm", 4096, 8192))],
    "layer_norm": [Case("4096x4096", _norm("layer_norm", 4096, 4096, bias=True)),
                   Case("4096x8192", _norm("layer_norm", 4096, 8192, bias=True))],
    "grouped_mm": [Case("8 uneven groups, 4096x1024 @ 8x1024x1792",
                        _grouped_mm((700, 300, 1024, 0, 512, 260, 900, 400), 1024, 1792))],
    "linear_cross_entropy": [Case("4096 tokens x 1024, V 32000",
                                  _linear_cross_entropy(4096, 1024, 32000))],
    "token_log_probs": [
        Case("4096 tokens x 1024, V 32000", _token_log_probs(4096, 1024, 32000)),
        # Qwen's vocabulary (GRPO's usual policies)
        Case("4096 tokens x 1024, V 151936", _token_log_probs(4096, 1024, 151936),
             exhaustive=True),
    ],
    "swiglu": [Case("4096x11008", _swiglu(4096, 11008))],
    "rotary_embedding": [Case("B2 H32/8 L2048 D128", _rotary_embedding(2, 32, 8, 2048, 128))],
    "rotary_embedding_backward": [Case("B2 H32/8 L2048 D128",
                                       _rotary_embedding_backward(2, 32, 8, 2048, 128))],
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A kernel family whose builds are recorded and compiled, and how
    (tests/mosaic_gpu_builds.py defines the Mosaic GPU one; `TPU` is this
    file's).

    family_backend: a backend whose family these kernels are (the op's
    kernel for it is the one built); config_backend: the configs' name for
    the hardware (spec.config, spec.refusal); realistic: op -> its realistic
    calls; execution: device -> the execution keywords a kernel gets on the
    hardware (kernels/spec.py); recording: a context manager factory for
    what recording needs set (a TPU description, TF32 allowed); env: the
    settings a compiling process needs before JAX starts."""

    name: str
    family_backend: str
    config_backend: str
    realistic: dict
    execution: Callable
    recording: Callable
    env: dict


def _tpu_execution(device) -> dict:
    cores = getattr(device, "num_cores", 1) or 1  # v5e, v6e: one TensorCore a chip
    return {"interpret": None, "num_cores": cores}


@contextlib.contextmanager
def _tpu_recording():
    from torch_pallas.base import jax_env

    jax_env.simulate_tpu_on_cpu()  # a TPU description for tracing emit_pipeline on the CPU
    yield


TPU = Family("tpu", FAMILY_BACKEND, CONFIG_BACKEND, REALISTIC, _tpu_execution, _tpu_recording,
             LIBTPU_ENV)


# Ops whose module checks its inputs against another op module's DTYPES.
DTYPES_OF = {"varlen_attention": "attention"}


def op_dtypes(op: str) -> tuple:
    """The dtypes op `op` accepts (its module's DTYPES; a backward op's are
    its forward's)."""
    name = op.removesuffix("_backward")
    module = importlib.import_module(f"torch_pallas.ops.{DTYPES_OF.get(name, name)}")
    return module.DTYPES


# The dtype models train in: the default tier's realistic calls are in it
# alone (where the op takes it), the other dtypes' in the exhaustive tier
# (the examples, in the default tier, cover every dtype at small sizes).
DEFAULT_DTYPE = "bfloat16"


def realistic_calls(op: str, family: Family = TPU):
    """(case, dtype, tier) of each realistic call of `op` for `family`."""
    for case in family.realistic.get(op, ()):
        dtypes = case.dtypes or op_dtypes(op)
        names = [str(d).removeprefix("torch.") for d in dtypes]
        for dtype, name in zip(dtypes, names):
            first = name == DEFAULT_DTYPE or (DEFAULT_DTYPE not in names and name == names[0])
            yield case, dtype, "default" if first and not case.exhaustive else "exhaustive"


def tiers_of(op: str, family: Family = TPU) -> tuple[str, ...]:
    """The tiers that hold calls of `op`: default always, exhaustive where
    some realistic call is there."""
    if any(tier == "exhaustive" for *_, tier in realistic_calls(op, family)):
        return ("default", "exhaustive")
    return ("default",)


def calls(op: str, tier: str, family: Family = TPU) -> list[tuple[str, str | None, Callable]]:
    """(case name, dtype name or None, thunk) of every call of `op` in
    `tier`: the examples (each in its own dtypes) in the default tier, then
    the realistic cases in each dtype the op accepts."""
    import torch

    from torch_pallas.runtime import registry

    out = []
    if tier in ("default", "all"):
        info = registry.get(op)

        def examples():
            for example in info.examples(torch.device("cpu"), True):
                _backward(*_as_tuple(info.overload(*example.args, **example.kwargs)))
        out.append(("examples", None, examples))
    for case, dtype, its_tier in realistic_calls(op, family):
        if tier in ("all", its_tier):
            out.append((case.name, str(dtype).removeprefix("torch."),
                        functools.partial(case.call, dtype)))
    return out


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# --- recording the builds -------------------------------------------------------


@dataclasses.dataclass
class Build:
    """One kernel build: kernel op `kernel`'s call on inputs `avals` with
    static `params`; `dtype` labels it (its case's dtype, else its first
    input's, else its `dtype` parameter); `cases` names the calls that made
    it."""

    kernel: str
    avals: tuple
    params: dict
    dtype: str
    cases: list

    def describe(self) -> str:
        inputs = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in self.avals)
        return f"{self.kernel}({inputs}) {self.params}"


def kernel_spec(kernel: str, family: Family = TPU):
    """`family`'s KernelSpec for kernel op `kernel` (varlen_attention calls
    attention's, which `launch.run` names 'attention')."""
    from torch_pallas.runtime import backends, registry

    return registry.get(kernel).kernel(backends.get(family.family_backend))


def entry(build: Build, device, family: Family = TPU):
    """The kernel's function of its inputs, configured for the hardware
    (device: the JAX device built for, or None where the configs need
    none) as the hardware runs it."""
    spec = kernel_spec(build.kernel, family)
    config = spec.config(family.config_backend, build.avals, build.params, device)
    return functools.partial(spec.run, **build.params, config=config, **family.execution(device))


class Recorder:
    """Stands in for `launch.run` (and for `launch.bound` and
    `launch.cpu_kernel`, matmul's shortcuts to it, which then take the
    `run` path): notes each kernel call as a Build and returns zeros shaped
    as its outputs. Shape buckets are off inside, so each call keeps its
    own sizes. `family`: whose kernels and configs give the outputs' shapes;
    `device`: the device their configs are chosen for (None: the TPU's need
    none to record)."""

    def __init__(self, keep_inputs: bool = False, family: Family = TPU, device=None):
        self.builds: dict[tuple, Build] = {}
        self.case: tuple[str, str | None] = ("", None)
        self._shapes: dict[tuple, object] = {}
        # with keep_inputs: every call in order, (its build, its inputs as
        # NumPy arrays), for running them (bench/tpu_check.py times them)
        self.keep_inputs, self.calls = keep_inputs, []
        self.family, self.device = family, device

    def __enter__(self):
        from torch_pallas.runtime import launch, shape_buckets

        self._recording = self.family.recording()
        self._recording.__enter__()
        self._saved = (launch.run, launch.bound, launch.cpu_kernel, shape_buckets.enabled)
        launch.run = self.run
        launch.bound = launch.cpu_kernel = lambda *args, **kwargs: None
        shape_buckets.enabled = False
        return self

    def __exit__(self, *exc):
        from torch_pallas.runtime import launch, shape_buckets

        launch.run, launch.bound, launch.cpu_kernel, shape_buckets.enabled = self._saved
        self._recording.__exit__(*exc)

    def _shaping_entry(self, build: Build):
        """The function whose outputs' shapes a call gets: the hardware's
        kernel, or, for a call it refuses (another backend runs it there;
        its entry may raise on it, as Mosaic GPU's attention does on
        float32), JAX's generic interpreter's (the `interpret` backend's
        kernel takes every dtype an op accepts; the shapes are the op's)."""
        import torch

        from torch_pallas.runtime import backends, registry

        family = self.family
        spec = kernel_spec(build.kernel, family)
        if spec.refusal(family.config_backend, build.avals, build.params) is None:
            return entry(build, self.device, family)
        simulator = backends.get("interpret")
        spec = registry.get(build.kernel).kernel(simulator)
        config = spec.config(simulator.name, build.avals, build.params, None)
        execution = simulator.execution(device=torch.device("cpu"), takes_inputs=bool(build.avals))
        return functools.partial(spec.run, **build.params, config=config, **execution)

    def run(self, op, device, inputs=(), params=None, user_function=None, x64=False):
        import jax
        import torch

        from torch_pallas.base import dtypes
        from torch_pallas.runtime import launch

        if user_function is not None:
            raise NotImplementedError("the recorder records shipped ops' kernels only")
        params = dict(params or {})
        avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in inputs)
        key = (op, avals, launch.static_key(params))
        build = self.builds.get(key)
        case, dtype = self.case
        if build is None:
            label = dtype or (avals[0][1] if avals else str(params.get("dtype")))
            build = self.builds[key] = Build(op, avals, params, label, [])
        if case not in build.cases:
            build.cases.append(case)
        if self.keep_inputs:
            from torch_pallas.runtime import bridge

            self.calls.append((build, [bridge.to_kernel_argument(t.detach().contiguous()).copy()
                                       for t in inputs]))
        out = self._shapes.get(key)
        if out is None:
            out = self._shapes[key] = jax.eval_shape(
                self._shaping_entry(build), *[jax.ShapeDtypeStruct(s, d) for s, d in avals])
        zeros = [torch.zeros(o.shape, dtype=dtypes.TORCH_DTYPES[str(o.dtype)], device=device)
                 for o in jax.tree.leaves(out)]
        return tuple(zeros) if isinstance(out, (tuple, list)) else zeros[0]


def record(op: str, tier: str, family: Family = TPU,
           device=None) -> tuple[list[Build], list[dict]]:
    """(builds, errors): the distinct kernel builds of `family`'s for `op`'s
    calls in `tier`, in the order first made, and the calls that failed
    before reaching their kernels (case, dtype, error). `device`: as
    Recorder's."""
    import torch

    import torch_pallas  # noqa: F401  (registers the ops)

    torch.manual_seed(0)
    errors = []
    with Recorder(family=family, device=device) as recorder:
        for case, dtype, call in calls(op, tier, family):
            recorder.case = (case, dtype)
            try:
                call()
            except Exception as e:
                errors.append({"case": case, "dtype": dtype, "error": first_line(e),
                               "traceback": traceback.format_exc(limit=-6)})
    return list(recorder.builds.values()), errors


# --- compiling them for a chip ---------------------------------------------------


def abstract_device(chip: str):
    """The one device of libtpu's description of `chip` (CHIPS), a device
    that can be compiled for and never run on."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        topology_name=CHIPS[chip], platform="tpu", chip_config_name="default",
        chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False)).devices[0]


# The sentence of XLA's VMEM error that says by how much (its first line
# names the error's kind alone).
_VMEM_SIZES = re.compile(r"Scoped allocation with size (\S+) and limit (\S+) exceeded")


def recorded_builds(op: str, tier: str, result: dict) -> list[dict]:
    """A compile report's builds, for a compile test: fails the test
    (pytest.fail, every call listed) where calls failed before reaching
    their kernels, and asserts that the tier made some kernel call."""
    import pytest

    errors = [f"  {e['case']} [{e['dtype']}]: {e['error']}\n{e['traceback']}"
              for e in result["record_errors"]]
    if errors:
        pytest.fail(f"{op}: calls that failed before their kernels:\n" + "\n".join(errors),
                    pytrace=False)
    assert result["builds"], f"{op}: its calls in the {tier} tier made no kernel call"
    return result["builds"]


def first_line(error: BaseException) -> str:
    """The error's type and first line (for a scoped VMEM overflow, with
    the allocation's size and the limit)."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    if len(line) > MAX_LINE:  # an MLIR op quoted in full
        line = line[:MAX_LINE - 3] + "..."
    sizes = _VMEM_SIZES.search(text)
    if sizes:
        line += f" scoped allocation {sizes[1]} > limit {sizes[2]}"
    return line


def compile_build(build: Build, device) -> dict:
    """Mosaic's compile of `build` for `device`: {"status": "ok" | "error" |
    "refused", "seconds"}, and for an error its first line ("error") and
    the next lines ("detail": the MLIR op, the kernel's source line). A
    call the kernel refuses on the hardware (KernelSpec.unsupported, which
    sends it to another backend) is not compiled."""
    import jax

    start = time.perf_counter()
    reason = kernel_spec(build.kernel).refusal(CONFIG_BACKEND, build.avals, build.params)
    if reason is not None:
        return {"status": "refused", "error": reason, "seconds": 0.0}
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in build.avals]
    try:
        # The default device answers pltpu.get_tpu_info() (emit_pipeline) with the chip's.
        with jax.default_device(device):
            jax.jit(entry(build, device)).lower(*args).compile()
    except Exception as e:
        lines = [line for line in str(e).strip().splitlines()[1:]
                 if line.strip() and not line.startswith("Please report a bug")]
        return {"status": "error", "error": first_line(e),
                "detail": "\n".join(lines[:DETAIL_LINES]),
                "seconds": time.perf_counter() - start}
    return {"status": "ok", "seconds": time.perf_counter() - start}


def report(op: str, tier: str, chips: list[str]) -> dict:
    """Records `op`'s builds in `tier` and compiles each for every chip of
    `chips`: the JSON object the script prints.

    {"op", "tier", "record_seconds", "record_errors": [{case, dtype, error,
    traceback}], "builds": [{kernel, avals, params (repr), dtype, cases,
    results: {chip: compile_build's answer}}], "chips": {chip: {"device_kind",
    "seconds"} or {"unavailable": why}}}"""
    start = time.perf_counter()
    builds, errors = record(op, tier)
    out = {"op": op, "tier": tier, "record_seconds": time.perf_counter() - start,
           "record_errors": errors, "chips": {},
           "builds": [{"kernel": b.kernel, "avals": [[list(s), d] for s, d in b.avals],
                       "params": repr(b.params), "describe": b.describe(), "dtype": b.dtype,
                       "cases": b.cases, "results": {}} for b in builds]}
    for chip in chips:
        start = time.perf_counter()
        try:
            device = abstract_device(chip)
        except Exception as e:
            out["chips"][chip] = {"unavailable": first_line(e)}
            continue
        for build, row in zip(builds, out["builds"]):
            row["results"][chip] = compile_build(build, device)
        out["chips"][chip] = {"device_kind": device.device_kind,
                              "seconds": time.perf_counter() - start}
    return out


# --- running it in a process of its own ----------------------------------------


def run_subprocess(op: str, tier: str = "default", chips=("v5e", "v6e"),
                   timeout: float = 1800) -> dict:
    """`report(op, tier, chips)` computed by this file run as a script in a
    fresh Python process with LIBTPU_ENV set; its stderr (libtpu's logs)
    is captured and, where the process fails, raised in a RuntimeError."""
    return run_json_script(os.path.abspath(__file__),
                           [op, "--tier", tier, "--chips", ",".join(chips)], timeout)


def run_json_script(script: str, args: list, timeout: float, settings: dict = LIBTPU_ENV) -> dict:
    """The JSON a script that ends in `print_json_alone` prints, run in a
    fresh Python process with `settings` (LIBTPU_ENV) in its environment
    (raised in a RuntimeError with the end of its stderr where the process
    fails)."""
    env = {**os.environ, **settings, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, script, *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}; its stderr "
                           f"ends:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def print_json_alone(script: str, make, settings: dict = LIBTPU_ENV) -> None:
    """A script's main: `settings` (LIBTPU_ENV) set before JAX starts, then
    make()'s result as JSON, alone on stdout (everything else printed, the
    compilers' logs and warnings, goes to stderr)."""
    if "jax" in sys.modules:
        raise RuntimeError(f"{script}: JAX started before the compiler's settings were made")
    for name, value in settings.items():
        os.environ.setdefault(name, value)
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    json.dump(make(), stdout)
    stdout.write("\n")
    stdout.flush()


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", help="a registered op (torch_pallas.runtime.registry)")
    parser.add_argument("--tier", choices=TIERS, default="default")
    parser.add_argument("--chips", default="v5e,v6e",
                        help="comma-separated, of: " + ", ".join(CHIPS))
    args = parser.parse_args(argv)
    print_json_alone("tpu_builds", lambda: report(
        args.op, args.tier, [c for c in args.chips.split(",") if c]))


if __name__ == "__main__":
    main()
