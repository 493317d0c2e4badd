"""Every Triton kernel the ops launch, compiled for an H100 (sm_90a) on this
CPU machine as a real CUDA launch would compile it: no GPU needed.

Why: Triton's CPU interpreter (TRITON_INTERPRET=1, what the value tests run
under) type-checks nothing and has no shared memory, registers or tensor
cores: a kernel that passes every interpreted test can fail to compile,
ask for more shared memory than a block may have (Triton checks only when
a cubin loads on a GPU), spill its accumulators to local memory or miss
Hopper's wgmma. Compiling a kernel by hand with a signature written for it
is not the launch's compile either: a launch specializes every integer and
pointer argument (== 1, divisible by 16) and picks among the autotuner's
configs, and those decide the pipelining, the layouts and the registers
(../shared/notes/gpu.md: a hand-built matmul 49152 B of shared memory and
a 464-byte stack, the launcher's 147456 B and none).

So the ops themselves are run, forward and backward (torch autograd),
under `torch_pallas.backend("triton")` on CPU tensors, in a process where
Triton's active driver is a stand-in that reports CUDA compute capability
9.0 (`StandInDriver`) and each launch (`kernel[grid](...)`) compiles
instead of running (`Compiling`): a JITFunction is warmed up with the
launch's own arguments (Triton's specialization of them, nothing
launched); an Autotuner compiles every config it would time (after its
`prune_configs`), since any of them may be the one a GPU picks. The
kernels' outputs are left as `torch.empty` made them: nothing downstream
reads them but other launches.

Each distinct cubin is then read (`analyse`): its shared memory
(`metadata.shared`), its registers and stack frame (`cuobjdump
-res-usage`), and from its SASS (`cuobjdump -sass`) the bytes of its
local-memory stores and loads (STL/LDL: Triton allocates no local arrays,
so these are spills) and whether it uses Hopper's HGMMA. cuobjdump ships
with the triton wheel (triton/backends/nvidia/bin).

The calls of an op: the H100's, which the Mosaic GPU compile takes too
(tests/mosaic_gpu_builds.py's REALISTIC: Llama-like products, 4096-token
attention, packed sequences, Mixtral- and Qwen3-MoE-like expert products,
8192-wide rows, 128256- and 151936-word vocabularies; `calls`), and the registered
examples.

Run as a script, in a process of its own (without TRITON_INTERPRET: the
kernels are decorated at import as compiled or interpreted):

    python tests/triton_builds.py OP [--tier default|exhaustive|all]

prints one JSON object on stdout (`report`); everything else goes to stderr.
`run_subprocess` does that from another process: tests/test_triton_compile.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mosaic_gpu_builds  # noqa: E402  (the H100's calls, shared by both GPU families)
import tpu_builds  # noqa: E402  (the calls and the JSON-alone main are shared)
from tpu_builds import first_line  # noqa: E402

TIERS = tpu_builds.TIERS
# H100 (SXM and PCIe alike): compute capability 9.0, 32-thread warps; the
# largest shared memory one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin).
TARGET = ("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 232448
# What Triton may ask of the device while compiling (it reads the shared
# memory limit for some sanitizer modes only): an H100 SXM's.
H100_PROPERTIES = {"max_shared_mem": SHARED_MEMORY_LIMIT, "multiprocessor_count": 132,
                   "max_num_regs": 65536, "warpSize": 32, "sm_clock_rate": 1980000,
                   "mem_clock_rate": 2619000, "mem_bus_width": 5120}
# The environment of the compiling process: no interpreter (the kernels
# compile), fp fusion stated (Triton 3.9 warns when it is unset).
ENV_REMOVED = ("TRITON_INTERPRET",)
ENV_SET = {"TRITON_DEFAULT_FP_FUSION": "1", "PYTHONWARNINGS": "ignore"}
CUOBJDUMP = "cuobjdump"


# --- inputs for the feature checks ---------------------------------------------------


def _empty(shape, dtype, grad: bool = True):
    """An input of `shape`: uninitialized (its values reach no compile),
    requiring grad when floating and `grad`."""
    import torch

    t = torch.empty(shape, dtype=dtype)
    return t.requires_grad_(grad and dtype.is_floating_point)


def _backward(*outputs) -> None:
    """Backpropagates uninitialized cotangents through the outputs that
    require grad."""
    import torch

    outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])


def triton_version() -> str:
    """The installed Triton's version, without importing it (the test
    process must not decide between compiled and interpreted kernels)."""
    import importlib.metadata

    return importlib.metadata.version("triton")


def calls(op: str, tier: str) -> list[tuple[str, str | None, object]]:
    """(case name, dtype name or None, thunk) of every call of `op` in
    `tier`: the H100's calls, as the Mosaic GPU compile takes them
    (mosaic_gpu_builds.REALISTIC), tiered differently. The default tier
    holds the realistic calls in bfloat16: each is a kernel config space
    compiled whole (every autotune config, 1-2 s a cubin), and the default
    run must stay within minutes. The exhaustive tier holds the registered
    examples (every dtype, ragged shapes: other specializations), the
    other dtypes and the cases marked exhaustive."""
    out = []
    if tier in ("exhaustive", "all"):
        out += [call for call in tpu_builds.calls(op, "default", mosaic_gpu_builds.FAMILY)
                if call[0] == "examples"]
    for case, dtype, its_tier in tpu_builds.realistic_calls(op, mosaic_gpu_builds.FAMILY):
        if tier in ("all", its_tier):
            out.append((case.name, str(dtype).removeprefix("torch."),
                        functools.partial(case.call, dtype)))
    return out


def tiers_of(op: str) -> tuple[str, ...]:
    """The tiers that hold calls of `op`: exhaustive always (the examples),
    default where a realistic call is in it (a backward op's default
    calls are its forward's, through autograd)."""
    return (("default",) if calls(op, "default") else ()) + ("exhaustive",)


def _rms_norm_casting_modes():
    """rms_norm in each casting mode, forward and backward: bfloat16 x with
    a float32 weight rounded as Llama does, float16 with Gemma's offset
    weight (the kernels' bit rounding, constexpr dtypes, weight offset)."""
    import torch

    import torch_pallas

    def call(dtype, weight_dtype, mode):
        x, w = _empty((64, 4096), dtype), _empty((4096,), weight_dtype)
        _backward(torch_pallas.rms_norm(x, (4096,), w, 1e-6, casting_mode=mode))
    return [(f"{mode} x {dtype} weight {weight}", str(dtype).removeprefix("torch."),
             functools.partial(call, dtype, weight, mode))
            for dtype, weight, mode in ((torch.bfloat16, torch.float32, "llama"),
                                        (torch.float16, torch.float16, "gemma"))]


def _attention_options():
    """attention forward and backward in each dtype with every option its
    kernels take: a float mask, causal, dropout, softcap, and spans (a
    window), and none of them."""
    import torch

    import torch_pallas

    def call(dtype, options):
        q, k, v = (_empty((1, 2, 100, 64), dtype) for _ in range(3))
        extra = dict(options)
        if extra.pop("mask", False):
            extra["attn_mask"] = _empty((1, 1, 100, 100), dtype, grad=False)
        _backward(torch_pallas.attention(q, k, v, **extra))
    options = {"none": {}, "mask, dropout": {"mask": True, "dropout_p": 0.1},
               "causal, softcap": {"is_causal": True, "softcap": 30.0},
               "window": {"window_size": (32, 0)}}
    return [(f"{name} {dtype}", str(dtype).removeprefix("torch."),
             functools.partial(call, dtype, option))
            for dtype in (torch.bfloat16, torch.float32, torch.float16)
            for name, option in options.items()]


def _grouped_mm_forms():
    """grouped_mm forward and backward: bfloat16 with a bias and weights
    stored (G, N, K) (read in place), float32 (G, K, N) without."""
    import torch

    import torch_pallas

    def call(dtype, transposed, bias):
        offs = torch.tensor([10, 10, 60, 90], dtype=torch.int32)
        x = _empty((100, 64), dtype)
        w = _empty((4, 48, 64), dtype).mT if transposed else _empty((4, 64, 48), dtype)
        extra = {"bias": _empty((4, 48), dtype)} if bias else {}
        _backward(torch_pallas.grouped_mm(x, w, offs=offs, **extra))
    return [("bias, (G, N, K) weights", "bfloat16", functools.partial(call, torch.bfloat16,
                                                                      True, True)),
            ("(G, K, N) weights", "float32", functools.partial(call, torch.float32, False,
                                                               False))]


def _fill_negative_zero():
    """fill with -0.0 in every float dtype it writes."""
    import torch

    import torch_pallas

    return [("-0.0", str(dtype).removeprefix("torch."),
             functools.partial(torch_pallas.fill, (1000,), -0.0, dtype=dtype))
            for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]


# Feature checks the ops' own tests run (their smallest config per launch):
# tests/test_rms_norm.py, test_attention_triton.py, test_grouped_mm_triton.py,
# test_fill.py.
CHECKS = {"rms_norm_casting_modes": _rms_norm_casting_modes,
          "fill_negative_zero": _fill_negative_zero,
          "attention_options": _attention_options,
          "grouped_mm_forms": _grouped_mm_forms}


# --- compiling each launch -------------------------------------------------------------


class StandInDriver:
    """Triton's active driver for a process with no GPU: the current device
    is an H100 (compute capability 9.0), device 0, on the default stream.
    What JITFunction.run, its warmup and the compiler ask of a driver; a
    launch (which would need the CUDA driver) never reaches it here."""

    def __init__(self):
        from types import SimpleNamespace

        self.utils = SimpleNamespace(get_device_properties=lambda device: dict(H100_PROPERTIES))

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*TARGET)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")  # where the stand-in's tensors live

    def is_active(self) -> bool:
        return True


@dataclasses.dataclass
class Compiled:
    """One distinct cubin: its kernel, how it was specialized and
    configured, the calls that launched it, and (after `analyse`) what it
    asks of the GPU."""

    kernel: object  # triton's CompiledKernel
    name: str
    signature: dict
    constexprs: dict
    autotuned: bool
    seconds: float
    cases: list = dataclasses.field(default_factory=list)
    launches: int = 0
    usage: dict = dataclasses.field(default_factory=dict)

    def row(self) -> dict:
        metadata = self.kernel.metadata
        pointers = [t for t in self.signature.values() if str(t).startswith("*")]
        return {"kernel": self.name, "hash": metadata.hash,
                "dtype": pointers[0][1:] if pointers else None,
                "signature": self.signature, "constexprs": self.constexprs,
                "num_warps": metadata.num_warps, "num_stages": metadata.num_stages,
                "autotuned": self.autotuned, "shared": metadata.shared,
                "seconds": round(self.seconds, 3), "cases": self.cases,
                "launches": self.launches, **self.usage}


def _json_value(value):
    return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)


class Compiling:
    """While inside: Triton's driver is the stand-in, the `triton` backend
    serves CPU tensors, shape buckets are off (a GPU call keeps its own
    sizes), and every `kernel[grid](...)` compiles (all the configs of an
    autotuned kernel) and launches nothing. `compiled`: the distinct
    cubins by hash; `failures`: each config that did not compile."""

    def __init__(self, every_config: bool = True):
        # every_config False: an autotuned launch compiles its smallest
        # candidate alone (a feature check's compile, not the config space)
        self.every_config = every_config
        self.compiled: dict[str, Compiled] = {}
        self.failures: list[dict] = []
        self.case: tuple[str, str | None] = ("", None)

    def __enter__(self):
        from triton.runtime import driver
        from triton.runtime.jit import KernelInterface

        from torch_pallas.runtime import backends, shape_buckets

        real_serves = backends.check_serves

        def serves(b, device, op):
            if b.name == "triton" and device.type == "cpu":
                return  # compiled for the stand-in GPU, never run
            real_serves(b, device, op)

        # (the driver Triton had, None before its first use: no CUDA driver
        # here, so reset_active would fail to make one)
        self._saved = (backends.check_serves, shape_buckets.enabled,
                       KernelInterface.__getitem__, driver._active)
        driver.set_active(StandInDriver())
        backends.check_serves = serves
        shape_buckets.enabled = False
        compiling = self
        KernelInterface.__getitem__ = (
            lambda kernel, grid: lambda *args, **kwargs: compiling.launch(kernel, grid, args,
                                                                          kwargs))
        return self

    def __exit__(self, *exc):
        from triton.runtime import driver
        from triton.runtime.jit import KernelInterface

        from torch_pallas.runtime import backends, shape_buckets

        (backends.check_serves, shape_buckets.enabled, KernelInterface.__getitem__,
         driver._active) = self._saved

    def launch(self, kernel, grid, args, kwargs) -> None:
        """A launch, compiled: an autotuner's every (pruned) config, as its
        warmup would, each on its own so that one failure hides no other."""
        from triton.runtime.autotuner import Autotuner

        if not isinstance(kernel, Autotuner):
            self.compile(kernel, grid, args, kwargs, autotuned=False)
            return
        kernel.nargs = dict(zip(kernel.arg_names, args))
        try:
            configs = kernel.prune_configs({**kwargs, "grid": grid})
        finally:
            kernel.nargs = None
        for config in configs if self.every_config else configs[-1:]:
            self.compile(kernel.fn, grid, args, {**kwargs, **config.all_kwargs()},
                         autotuned=True)

    def compile(self, fn, grid, args, kwargs, *, autotuned: bool) -> None:
        jit = fn
        while not hasattr(jit, "arg_names"):  # a heuristics wrapper's JITFunction
            jit = jit.fn
        constexprs = {jit.arg_names[i]: _json_value(kwargs.get(jit.arg_names[i]))
                      for i in jit.constexprs if jit.arg_names[i] in kwargs}
        constexprs.update({k: _json_value(v) for k, v in kwargs.items()
                           if k in ("num_warps", "num_stages")})
        case, dtype = self.case
        start = time.perf_counter()
        try:
            kernel = fn.warmup(*args, grid=grid, **kwargs)
        except Exception as e:
            failure = {"kernel": jit.__name__, "constexprs": constexprs, "case": case,
                       "dtype": dtype, "error": first_line(e),
                       "detail": traceback.format_exc(limit=-4)[-3000:]}
            same = (failure["kernel"], repr(constexprs), failure["error"])
            if not any((f["kernel"], repr(f["constexprs"]), f["error"]) == same
                       for f in self.failures):
                self.failures.append(failure)
            return
        seconds = time.perf_counter() - start
        compiled = self.compiled.get(kernel.hash)
        if compiled is None:
            signature = {k: str(v) for k, v in kernel.src.signature.items()}
            compiled = self.compiled[kernel.hash] = Compiled(
                kernel, kernel.name, signature, constexprs, autotuned, seconds)
        compiled.launches += 1
        if [case, dtype] not in compiled.cases:
            compiled.cases.append([case, dtype])


# --- reading the cubins ----------------------------------------------------------


def nvidia_tool(name: str) -> str:
    """The path of a tool the triton wheel ships (cuobjdump, nvdisasm)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# Local-memory stores and loads in SASS, with their width in bits (32 unless said).
_LOCAL_ACCESS = re.compile(r"\b(STL|LDL)(?:\.(?:U|S)?(8|16|64|128))?\b")


def local_bytes(sass: str) -> tuple[int, int]:
    """(bytes stored, bytes loaded) by the SASS's local-memory instructions,
    counted once each as ptxas counts its spill stores and loads."""
    stored = loaded = 0
    for op, bits in _LOCAL_ACCESS.findall(sass):
        size = int(bits or 32) // 8
        if op == "STL":
            stored += size
        else:
            loaded += size
    return stored, loaded


def _cuobjdump(cubin: bytes, option: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvidia_tool(CUOBJDUMP), option, f.name], capture_output=True,
                              text=True, check=True).stdout


# The PTX's float and bitwise arithmetic on values (sub.f32, neg.f16, xor.b32,
# mul.rn.bf16, ...): what a feature check reads of how a kernel computes.
_ARITHMETIC = re.compile(r"\b(?:add|sub|mul|neg|xor|and|or)\.[a-z0-9.]+")


def analyse(kernel) -> dict:
    """What a compiled kernel asks of the GPU: registers a thread, its stack
    frame and local memory (bytes), bytes of spill stores and loads (its
    SASS's STL and LDL), its HGMMA (wgmma) instructions and its PTX's
    arithmetic mnemonics (`ptx_arithmetic`). The SASS (a
    second or more a cubin) is read only where it can hold either: a
    kernel without a stack frame has no local memory to spill to, one
    without wgmma in its PTX no HGMMA."""
    cubin = kernel.asm["cubin"]
    found = _RESOURCES.search(_cuobjdump(cubin, "-res-usage"))
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage found no resources in {kernel.name}'s cubin")
    registers, stack, _, local = map(int, found.groups())
    ptx = kernel.asm["ptx"]
    usage = {"registers": registers, "stack": stack, "local": local, "spill_stores": 0,
             "spill_loads": 0, "hgmma": 0, "ptx_arithmetic": sorted(set(_ARITHMETIC.findall(ptx)))}
    wgmma = "wgmma.mma_async" in ptx
    if stack or local or wgmma:
        sass = _cuobjdump(cubin, "-sass")
        usage["spill_stores"], usage["spill_loads"] = local_bytes(sass)
        usage["hgmma"] = len(re.findall(r"\bHGMMA\.", sass))
    return usage


# --- the report ------------------------------------------------------------------


def report(op: str, tier: str, check: str | None = None) -> dict:
    """Runs `op`'s calls in `tier` under `Compiling` and reads each cubin:
    the JSON object the script prints.

    {"op", "tier", "target", "shared_memory_limit", "record_seconds",
    "analyse_seconds", "record_errors": [{case, dtype, error, traceback}],
    "failures": [{kernel, constexprs, case, dtype, error, detail}],
    "kernels": [Compiled.row(): kernel, hash, dtype, signature,
    constexprs, num_warps, num_stages, autotuned, shared, seconds, cases,
    launches, registers, stack, local, spill_stores, spill_loads, hgmma]}"""
    import torch

    import torch_pallas

    torch.manual_seed(0)
    start = time.perf_counter()
    errors = []
    todo = calls(op, tier) if check is None else CHECKS[check]()
    with Compiling(every_config=check is None) as compiling, torch_pallas.backend("triton"):
        for case, dtype, call in todo:
            compiling.case = (case, dtype)
            try:
                call()
            except Exception as e:
                errors.append({"case": case, "dtype": dtype, "error": first_line(e),
                               "traceback": traceback.format_exc(limit=-6)})
    recorded = time.perf_counter()
    for compiled in compiling.compiled.values():
        compiled.usage = analyse(compiled.kernel)
    return {"op": op, "tier": tier, "target": list(TARGET),
            "shared_memory_limit": SHARED_MEMORY_LIMIT,
            "record_seconds": recorded - start, "analyse_seconds": time.perf_counter() - recorded,
            "record_errors": errors, "failures": compiling.failures,
            "kernels": [c.row() for c in compiling.compiled.values()]}


def run_subprocess(op: str | None, tier: str = "default", timeout: float = 1800,
                   check: str | None = None) -> dict:
    """`report(op, tier)` from this file run as a script in a fresh process
    without TRITON_INTERPRET (raised in a RuntimeError with the end of its
    stderr where the process fails)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_REMOVED}
    env.update(ENV_SET)
    command = [sys.executable, os.path.abspath(__file__), op or "-", "--tier", tier,
               *(["--check", check] if check else [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}; its stderr "
                           f"ends:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def launched(result: dict) -> set[tuple[str, str]]:
    """(kernel, dtype of the call that launched it) of a report's cubins:
    what a feature check asserts on (its failures and errors empty first)."""
    problems = [e["error"] for e in result["record_errors"]] + [
        f"{f['kernel']} {f['constexprs']}: {f['error']}" for f in result["failures"]]
    assert not problems, "\n".join(problems)
    return {(k["kernel"], dtype) for k in result["kernels"] for _, dtype in k["cases"]}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", help="a registered op (torch_pallas.runtime.registry)")
    parser.add_argument("--tier", choices=TIERS, default="default")
    parser.add_argument("--check", choices=sorted(CHECKS),
                        help="compile a feature check's calls (CHECKS) instead of OP's")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("triton_builds: TRITON_INTERPRET is set; the kernels would not compile")
    for name, value in ENV_SET.items():
        os.environ.setdefault(name, value)
    tpu_builds.print_json_alone("triton_builds", lambda: report(args.op, args.tier, args.check))


if __name__ == "__main__":
    main()
