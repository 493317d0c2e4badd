"""Every Mosaic GPU kernel build the ops make, compiled to an sm_90a cubin
for an H100 (or H200) on this CPU machine, with XLA's compile-only CUDA
client: no GPU needed.

Why: the simulator (`mosaic_gpu_interpret`) checks values and races, and
tests/test_mosaic_gpu_lowering.py that the kernels lower to Mosaic GPU
custom calls (layouts, SMEM budget, MLIR verifier); neither runs LLVM's
NVPTX backend or ptxas. Only they say whether a kernel compiles at all for
the chip, how many registers it takes and whether it spills (two (128, 512)
float32 arrays live across a loop: 255 registers and kilobytes of spill,
which neither the simulator nor the lowering reports), and only the SASS
shows the Tensor Core instructions (HGMMA) a kernel meant to use.

How (../shared/notes/gpu.md): with a JAX CUDA plugin installed (the
jax-cuda12/13 plugin and pjrt wheels; no GPU) and JAX_PLATFORMS=cpu set
before JAX starts, the plugin still describes a GPU from XLA's target
config (gpu_targets/*.txtpb), and

    jax.jit(f).trace(*avals sharded on that device).lower().compile()

runs jaxlib's whole Mosaic GPU pipeline for compute capability 9.0a (MLIR,
NVPTX, PTX, ptxas, cubin). The plugin has no PTX compiler of its own (jaxlib
0.10.2's is built without libnvptxcompiler): it runs a CUDA toolkit's ptxas
(/usr/local/cuda, PATH); without one every build fails with "No PTX
compilation provider is available". MOSAIC_GPU_DUMP_TO=<dir> makes it write each
kernel's PTX, ptxas log (registers, spill bytes), MLIR passes (its dynamic
shared memory) and SASS (nvdisasm, from the nvidia-cuda-nvdisasm wheel
found through CUDA_ROOT).

The builds are tests/tpu_builds.py's, for the Mosaic GPU family: the op's
examples and realistic LLM-sized calls (`REALISTIC`, H100-sized: matmul up
to 8192^3, attention over 4096 tokens, 128 experts, 128256- and 151936-word vocabs),
forward and backward, recorded without computing anything; their configs
are the ones the `mosaic_gpu` backend picks on the GPU (the device's kind
and SM count; no tuned configs: the shipped ones), float32 products as TF32
(torch allowing it; where it does not, the op runs on Triton).

Run as a script, in a process of its own (JAX_PLATFORMS must be set before
JAX starts and must not reach the other tests' processes):

    python tests/mosaic_gpu_builds.py OP [OP ...] [--tier default|exhaustive|all] [--gpu h100]

prints one JSON object on stdout ({op: `report`}); whatever else the
process prints goes to stderr. `run_subprocess` does that from another
process: tests/test_mosaic_gpu_compile.py.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import site
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import tpu_builds
from tpu_builds import Case

# The compile-only CUDA client: JAX on the CPU (the CUDA plugin stays
# registered and describes the GPU; without this JAX tries to open a GPU
# and fails before the topology is asked for).
SETTINGS = {"JAX_PLATFORMS": "cpu"}
TARGETS = Path(__file__).resolve().parent / "gpu_targets"
GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
FAMILY_BACKEND = "mosaic_gpu_interpret"  # a backend whose family is the Mosaic GPU kernels
CONFIG_BACKEND = "mosaic_gpu"  # the configs' name for the hardware
# A Hopper block's shared memory (the H100's and H200's
# shared_memory_per_block_optin, gpu_targets/*.txtpb).
SMEM_LIMIT = 232448
# The kernels built on wgmma: their cubins must hold HGMMA (a kernel of
# theirs that falls back to FMA would still compile and run, slowly).
WGMMA_KERNELS = ("matmul", "attention", "attention_backward", "grouped_mm",
                 "grouped_mm_backward")


def plugin_installed() -> bool:
    """Whether a JAX CUDA plugin (XLA's compile-only CUDA client) is here."""
    if importlib.util.find_spec("jax_plugins") is None:  # no plugin at all
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
               for v in (12, 13))


def nvdisasm_root() -> str | None:
    """The CUDA_ROOT holding bin/nvdisasm (the nvidia-cuda-nvdisasm wheel's
    folder, or a toolkit's), for the SASS; None where there is none."""
    roots = [os.environ.get("CUDA_ROOT", "")]
    roots += [str(Path(p) / "nvidia" / v) for p in site.getsitepackages() for v in ("cu13", "cu12")]
    return next((r for r in roots if r and Path(r, "bin", "nvdisasm").is_file()), None)


# --- the calls: examples and realistic shapes (H100-sized) ---------------------


def _uneven(total: int, groups: int) -> tuple[int, ...]:
    """`total` rows over `groups` experts, unevenly (weights 0-12, so every
    13th expert gets none), as a router leaves them."""
    weights = [(i * 7919) % 13 for i in range(groups)]
    rows = [total * w // sum(weights) for w in weights]
    rows[1] += total - sum(rows)
    return tuple(rows)


PACKED = (1000, 517, 2579, 4096, 1000, 999)  # uneven sequences, 10191 tokens
REALISTIC: dict[str, list[Case]] = {
    **tpu_builds.REALISTIC,  # add, fill, iota, swiglu, rotary: already LLM-sized
    "matmul": [
        Case("4096x4096 @ 4096x4096", tpu_builds._matmul(4096, 4096, 4096)),
        Case("16x4096 @ 4096x4096", tpu_builds._matmul(16, 4096, 4096)),
        Case("8192x8192 @ 8192x8192", tpu_builds._matmul(8192, 8192, 8192), exhaustive=True),
        Case("8192x4096 @ 4096x14336", tpu_builds._matmul(8192, 4096, 14336), exhaustive=True),
    ],
    "attention": [
        Case("B2 H16 L4096 D128 causal", tpu_builds._attention(hq=16, hkv=16, length=4096)),
        Case("B2 H16/4 L4096 D128 causal GQA",
             tpu_builds._attention(hq=16, hkv=4, length=4096), exhaustive=True),
        Case("B2 H16 L4096 D128 window (1024, 0)",
             tpu_builds._attention(hq=16, hkv=16, length=4096, causal=False,
                                   window_size=(1024, 0)), exhaustive=True),
        Case("B2 H16 L4096 D128 causal softcap 30",
             tpu_builds._attention(hq=16, hkv=16, length=4096, softcap=30.0), exhaustive=True),
        Case("B2 H16 L4096 D128 causal sinks",
             tpu_builds._attention(hq=16, hkv=16, length=4096, sinks=True), exhaustive=True),
    ],
    "varlen_attention": [
        Case(f"packed {PACKED} H16/4 D128 causal",
             tpu_builds._varlen_attention(PACKED, hq=16, hkv=4, window_size=(-1, 0))),
    ],
    "grouped_mm": [
        Case("8 uneven experts, 16384x4096 @ 8x4096x14336",
             tpu_builds._grouped_mm(_uneven(16384, 8), 4096, 14336), exhaustive=True),
        Case("128 uneven experts, 16384x2048 @ 128x2048x768",
             tpu_builds._grouped_mm(_uneven(16384, 128), 2048, 768)),
    ],
    "rms_norm": [Case("8192x8192", tpu_builds._norm("rms_norm", 8192, 8192))],
    "layer_norm": [Case("8192x8192", tpu_builds._norm("layer_norm", 8192, 8192, bias=True))],
    "linear_cross_entropy": [
        Case("8192 tokens x 4096, V 128256",
             tpu_builds._linear_cross_entropy(8192, 4096, 128256), exhaustive=True),
        Case("4096 tokens x 1024, V 32000", tpu_builds._linear_cross_entropy(4096, 1024, 32000)),
    ],
    "token_log_probs": [
        Case("8192 tokens x 4096, V 151936",
             tpu_builds._token_log_probs(8192, 4096, 151936), exhaustive=True),
        Case("4096 tokens x 1024, V 32000", tpu_builds._token_log_probs(4096, 1024, 32000)),
    ],
}


def _execution(device) -> dict:
    return {"interpret": None}  # the hardware


@contextmanager
def _tf32_allowed():
    """float32 products as TF32, as on a GPU where torch allows it: the
    Tensor Cores read float32 as TF32 only, and a call torch asks full
    float32 of runs on Triton instead (matmul.unsupported)."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


FAMILY = tpu_builds.Family("mosaic_gpu", FAMILY_BACKEND, CONFIG_BACKEND, REALISTIC, _execution,
                           _tf32_allowed, SETTINGS)


# --- compiling them for a GPU ----------------------------------------------------


@functools.cache
def abstract_gpu(gpu: str):
    """(device, sharding): the one device of XLA's description of `gpu`
    (GPUS), compiled for and never run on, and a sharding that puts an
    array on it."""
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=(TARGETS / GPUS[gpu]).read_text())
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return topology.devices[0], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"registers,.*?(\d+) bytes smem"),
}
_DYNAMIC_SMEM = re.compile(rb"dynamic_shared_memory_size %c(\d+)_i32")


def cubins(dump: str) -> list[dict]:
    """Of each kernel Mosaic GPU compiled into `dump` (MOSAIC_GPU_DUMP_TO):
    its name, registers, spill bytes, shared memory (the launch's dynamic
    size plus ptxas's static bytes) and HGMMA count in its SASS (None where
    no SASS was written: nvdisasm not found)."""
    out = []
    for ptxas in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
        stem = ptxas.removesuffix(".ptxas")
        log = Path(ptxas).read_text()
        row = {"name": os.path.basename(stem)}
        for key, pattern in _PTXAS.items():
            found = pattern.search(log)
            row[key] = int(found[1]) if found else None
        passes = Path(stem + ".mlir-passes.log")
        sizes = ([int(s) for s in _DYNAMIC_SMEM.findall(passes.read_bytes())]
                 if passes.exists() else [])
        row["smem"] = max(sizes) + (row["static_smem"] or 0) if sizes else row["static_smem"]
        sass = Path(stem + ".sass_ctrl")
        row["hgmma"] = sass.read_text().count("HGMMA") if sass.exists() else None
        out.append(row)
    return out


def compile_build(build: tpu_builds.Build, gpu: str) -> dict:
    """The compile of `build` to cubins for `gpu`: {"status": "ok" | "error"
    | "refused", "seconds", "cubins": [cubins' rows]}, and for an error its
    first line ("error") and the next lines ("detail"). A call the kernel
    refuses on the hardware (it runs on Triton there) is not compiled."""
    import jax

    start = time.perf_counter()
    spec = tpu_builds.kernel_spec(build.kernel, FAMILY)
    reason = spec.refusal(CONFIG_BACKEND, build.avals, build.params)
    if reason is not None:
        return {"status": "refused", "error": reason, "seconds": 0.0, "cubins": []}
    device, sharding = abstract_gpu(gpu)
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in build.avals]
    with tempfile.TemporaryDirectory(prefix="mosaic_gpu_dump") as dump:
        os.environ["MOSAIC_GPU_DUMP_TO"] = dump  # read by the plugin at each kernel's compile
        try:
            # out_shardings: a kernel of no inputs (fill, iota) is built for the GPU too
            jax.jit(tpu_builds.entry(build, device, FAMILY),
                    out_shardings=sharding).trace(*args).lower().compile()
        except Exception as e:
            lines = [line for line in str(e).strip().splitlines()[1:] if line.strip()]
            return {"status": "error", "error": tpu_builds.first_line(e),
                    "detail": "\n".join(lines[:tpu_builds.DETAIL_LINES]),
                    "seconds": time.perf_counter() - start, "cubins": cubins(dump)}
        finally:
            del os.environ["MOSAIC_GPU_DUMP_TO"]
        return {"status": "ok", "seconds": time.perf_counter() - start, "cubins": cubins(dump)}


_COMPILED: dict[tuple, dict] = {}  # (gpu, build described) -> its compile_build result


def report(op: str, tier: str, gpu: str) -> dict:
    """Records `op`'s Mosaic GPU builds in `tier` and compiles each for
    `gpu`: {"op", "tier", "gpu", "device_kind", "record_seconds",
    "compile_seconds", "record_errors": [{case, dtype, error, traceback}],
    "builds": [{kernel, avals, params (repr), describe, dtype, cases,
    result: compile_build's answer}]}."""
    device, _ = abstract_gpu(gpu)
    start = time.perf_counter()
    builds, errors = tpu_builds.record(op, tier, FAMILY, device)
    recorded = time.perf_counter()
    rows = []
    for b in builds:
        # An op's backward op makes the builds its forward's backward made:
        # compiled once a process (jaxlib would reuse the cubins and write none).
        key = (gpu, b.describe())
        if key not in _COMPILED:
            _COMPILED[key] = {**compile_build(b, gpu), "first_for": op}
        rows.append({"kernel": b.kernel, "avals": [[list(s), d] for s, d in b.avals],
                     "params": repr(b.params), "describe": b.describe(), "dtype": b.dtype,
                     "cases": b.cases, "result": _COMPILED[key]})
    return {"op": op, "tier": tier, "gpu": gpu, "device_kind": device.device_kind,
            "record_seconds": recorded - start, "compile_seconds": time.perf_counter() - recorded,
            "record_errors": errors, "builds": rows}


# --- running it in a process of its own ----------------------------------------


def run_subprocess(ops, tier: str = "default", gpu: str = "h100", timeout: float = 1800) -> dict:
    """{op: report(op, tier, gpu)} for each of `ops`, computed by this file
    run as a script in one fresh Python process (raised in a RuntimeError
    with the end of its stderr where the process fails)."""
    return tpu_builds.run_json_script(os.path.abspath(__file__),
                                      [*ops, "--tier", tier, "--gpu", gpu], timeout, SETTINGS)


def _nvdisasm_settings() -> dict:
    """CUDA_ROOT where nvdisasm, which writes the SASS, is found there."""
    root = nvdisasm_root()
    return {"CUDA_ROOT": root} if root else {}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="+", help="registered ops (torch_pallas.runtime.registry)")
    parser.add_argument("--tier", choices=tpu_builds.TIERS, default="default")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    args = parser.parse_args(argv)
    # An empty tuning cache: the configs a GPU picks before any tuning, not
    # whatever this machine's cache holds.
    with tempfile.TemporaryDirectory(prefix="mosaic_gpu_tuning") as cache:
        os.environ["TORCH_PALLAS_CACHE_DIR"] = cache
        tpu_builds.print_json_alone("mosaic_gpu_builds", lambda: {
            op: report(op, args.tier, args.gpu) for op in args.ops},
            {**SETTINGS, **_nvdisasm_settings()})


if __name__ == "__main__":
    main()
