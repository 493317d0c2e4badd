"""JAX, imported on first use and set up for living inside a torch process.

Importing torch_pallas must not initialise JAX: `import torch_pallas` only
registers the torch ops. The first kernel call comes through here, which

- keeps JAX from preallocating most of a GPU's memory (a torch process must
  never lose its memory to JAX): `XLA_PYTHON_CLIENT_PREALLOCATE=false` unless
  the user already chose a value;
- keeps a machine with no accelerator quiet: JAX otherwise starts every
  runtime installed, and libtpu (the test extra's jax[tpu] puts it on every
  Linux machine) prints its initialization errors in the middle of a user's
  output where there is no TPU; there JAX gets the CPU alone, unless the
  user chose its platforms;
- tells Pallas TPU which TPU the CPU simulates (the TPU backends run on CPU,
  whose device kind TPU code does not know);
- builds the `interpret=` argument of each simulation backend, compiles
  each simulated core's body once (not on every call) and resets the
  simulators' global state after a failure;
- keeps a second, synchronous JAX CPU client for small CPU kernels
  (`synchronous_cpu_device`);
- reaches jaxlib's DLPack capsule import and export directly, for the
  bridge's per-call cost (torch_pallas/runtime/bridge.py checks them against the
  public API once and falls back to it).

This is the one module that uses JAX's private API (names under
`jax._src`), each looked up here with the spelling of every supported JAX
version; where a name is missing the caller takes JAX's public path (or, for
the simulators' state, does without).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
import types

# The TPU simulated on CPU: a v5p TensorCore pair (megacore), so the TPU
# kernels' work split across cores is exercised.
SIMULATED_TPU_CORES = 2


@functools.cache
def jax() -> types.ModuleType:
    """The `jax` module, imported without preallocating GPU memory, on the
    CPU alone where the machine has no accelerator (`cpu_only_machine`)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    module = importlib.import_module("jax")
    if not module.config.jax_platforms and cpu_only_machine():
        # Before JAX starts its runtimes: an update after that changes nothing.
        module.config.update("jax_platforms", "cpu")
    return module


# Device files of the accelerators a JAX runtime could drive: NVIDIA GPUs
# (WSL2's /dev/dxg), AMD GPUs (/dev/kfd), TPUs (/dev/accel*, /dev/vfio).
ACCELERATOR_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd", "/dev/accel*",
                            "/dev/vfio/*")
GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU's PCI vendor


def cpu_only_machine() -> bool:
    """Whether this machine has none of the accelerators JAX's runtimes
    drive: no such device file and no Google PCI device (a TPU). Any sign
    of one leaves JAX to choose, as it would without torch_pallas."""
    import glob

    if any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES):
        return False
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return False
        except OSError:
            return False
    return True


@functools.cache
def simulate_tpu_on_cpu() -> None:
    """Describes a TPU for JAX's CPU device so TPU kernels can run there.

    TPU `emit_pipeline` and tiling ask `pltpu.get_tpu_info()`, which looks the
    current device kind up; "cpu" is unknown to it until registered.
    """
    jax()
    from jax._src.pallas.mosaic import tpu_info

    registry = getattr(tpu_info, "registry", None)
    if registry is None:  # a JAX that no longer has the registry
        return
    registry.setdefault(
        "cpu",
        lambda: tpu_info.get_tpu_info_for_chip(
            tpu_info.ChipVersion.TPU_V5P, SIMULATED_TPU_CORES
        ),
    )


def x64_scope(enabled: bool = True):
    """A context with JAX's 64-bit mode on (`jax.enable_x64`) for what runs
    inside it alone: a custom op's kernel that takes or returns 64-bit
    arrays is traced, compiled and called there. A no-op when not
    `enabled`."""
    if not enabled:
        return contextlib.nullcontext()
    jax_ = jax()
    enable = getattr(jax_, "enable_x64", None)
    if enable is None:  # JAX versions that kept it in jax.experimental
        from jax.experimental import enable_x64 as enable
    return enable(True)


def x64_enabled() -> bool:
    """Whether JAX's 64-bit mode is on here (in this thread's context)."""
    return bool(jax().config.jax_enable_x64)


def forced_interpret(params):
    """A context in which every Pallas kernel traced runs interpreted with
    `params` (True: JAX's generic interpreter; TPU or GPU interpret-mode
    parameters: the simulators), whatever `interpret=` the code passes or
    omits: JAX's `pltpu.force_tpu_interpret_mode`, which sets the one
    setting that `pl.pallas_call`, `pl.kernel`, `core_map` and
    `plgpu.kernel` all read. A no-op for None (the hardware)."""
    if params is None:
        return contextlib.nullcontext()
    jax()
    from jax.experimental.pallas import tpu as pltpu

    force = getattr(pltpu, "force_tpu_interpret_mode", None)
    return contextlib.nullcontext() if force is None else force(params)


_synchronous_cpu_lock = threading.Lock()


@functools.cache
def _synchronous_cpu_client():
    from jax._src.lib import xla_client

    return xla_client.make_cpu_client(asynchronous=False)


def synchronous_cpu_device():
    """The CPU device of a JAX CPU client of this package's own, which runs
    each computation on the calling thread; None if this jaxlib cannot make
    one.

    JAX's own CPU client hands every computation estimated at 1,000 FLOPs
    or more to a worker thread and the caller waits for it: a torch op
    waits at once, and after any pause between calls the sleeping worker
    is slow to wake, compared with what a small kernel costs. Large kernels
    stay on JAX's client, whose threads run them faster (docs/performance.md
    has the measurements)."""
    jax()
    with _synchronous_cpu_lock:
        try:
            return _synchronous_cpu_client().local_devices()[0]
        except Exception:  # a jaxlib without this client: JAX's own
            return None


_simulated_bodies: dict = {}  # (jaxpr, argument types) -> compiled body
_simulated_bodies_lock = threading.Lock()
MAX_SIMULATED_BODIES = 512  # past it the record starts afresh


@functools.cache
def compile_simulated_threads_once() -> None:
    """Both simulators run each simulated core (TPU) or thread (Mosaic GPU)
    as a Python thread that evaluates the kernel body's jaxpr, compiled by
    `thread_map._run_jaxpr` through a function it defines anew on every
    call, so JAX's caches never hit: every kernel call lowered and compiled
    its bodies again, about 0.95 s of the 1.0 s a 1000-element `add` took
    on `tpu_interpret`. Here each body is compiled as JAX compiles it,
    once per jaxpr and argument types, and called as JAX calls it (the
    `add` then takes 0.04 s). Not through one `jax.jit`: its cache makes a
    thread wait for another thread's build of the same entry, and the
    simulated threads of one kernel deadlocked there. Two threads may build
    the same body once each. A JAX without that function keeps its own."""
    jax_ = jax()
    try:
        from jax._src import core
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return
    if not callable(getattr(thread_map, "_run_jaxpr", None)):
        return

    def evaluate(jaxpr, consts, *args):
        core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        leaves, tree = jax_.tree.flatten((consts, args))
        key = (jaxpr, tree, tuple(jax_.typeof(x) for x in leaves))
        with _simulated_bodies_lock:
            compiled = _simulated_bodies.get(key)
        if compiled is None:
            compiled = (jax_.jit(evaluate, static_argnums=(0,))
                        .trace(jaxpr, consts, *args).lower().compile())
            with _simulated_bodies_lock:
                if len(_simulated_bodies) >= MAX_SIMULATED_BODIES:
                    _simulated_bodies.clear()
                _simulated_bodies[key] = compiled
        compiled(consts, *args)

    thread_map._run_jaxpr = run_jaxpr


def tpu_interpret_params(*, detect_races: bool):
    """`interpret=` for TPU interpret mode (simulated TensorCores and DMAs)."""
    compile_simulated_threads_once()
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        num_cores_or_threads=SIMULATED_TPU_CORES, detect_races=detect_races,
        **_race_reporting(pltpu.InterpretParams),
    )


def gpu_interpret_params(*, detect_races: bool):
    """`interpret=` for Mosaic GPU interpret mode (simulated SMEM, TMA, wgmma)."""
    compile_simulated_threads_once()
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = getattr(plgpu, "InterpretParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import (
            InterpretGPUParams as params,
        )
    return params(detect_races=detect_races, **_race_reporting(params))


def _race_reporting(params_class) -> dict:
    """Keeps a simulator running after its race detector flags an access:
    JAX 0.11 on raises inside the simulated kernel by default (`on_race=
    "raise"`), 0.10 has no such field and only records the race; recorded,
    the race is logged and `races_found` set, which torch_pallas turns into
    RaceDetectedError after the call (runtime/simulators.py)."""
    fields = getattr(params_class, "__dataclass_fields__", {})
    return {"on_race": "warn"} if "on_race" in fields else {}


def _gpu_callbacks():
    return importlib.import_module(
        "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks"
    )


def _tpu_interpreter():
    return importlib.import_module(
        "jax._src.pallas.mosaic.interpret.interpret_pallas_call"
    )


def reset_simulator(family: str) -> None:
    """Clears a simulator's global state, which a failed kernel leaves behind
    (until then every later kernel in the process fails)."""
    if family == "mosaic_gpu":
        _gpu_callbacks().reset_gpu_interpret_mode_state()
    elif family == "tpu":
        jax()
        from jax.experimental.pallas import tpu as pltpu

        pltpu.reset_tpu_interpret_mode_state()


@functools.cache
def pallas_call_lowers_for_mosaic_gpu() -> bool:
    """Whether this JAX lowers a `pl.pallas_call` with `plgpu.CompilerParams`
    for Mosaic GPU on a GPU (0.10, which deprecates it). From 0.11 on only
    `plgpu.kernel` lowers to Mosaic GPU: a pallas_call lowers to Triton on a
    GPU, and one with Mosaic GPU parameters fails a bare assertion."""
    jax()
    from jax._src.pallas import core as pallas_core
    from jax.experimental.pallas import mosaic_gpu as plgpu

    try:  # the module that registers the rule, where one exists
        importlib.import_module("jax._src.pallas.mosaic_gpu.pallas_call_registration")
    except ImportError:
        return False
    rule = getattr(pallas_core, "get_lowering_rule", None)
    try:
        return rule is not None and rule(plgpu.CompilerParams, "gpu") is not None
    except ValueError:  # registered for another platform
        return False


def gpu_races_follow_proxies() -> bool:
    """Whether the Mosaic GPU simulator's race detector follows PTX's memory
    proxies (JAX 0.11 on): a TMA copy (the async proxy) is ordered after a
    thread's plain SMEM accesses (the generic proxy) only across
    `plgpu.commit_smem` (fence.proxy.async), not in program order as in
    0.10, so a pipeline body that reads its slots and ends unfenced is
    flagged when the pipeline refills them."""
    memory = importlib.import_module("jax._src.pallas.mosaic_gpu.interpret.shared_memory")
    return callable(getattr(getattr(memory, "GpuClockBundle", None), "commit_smem", None))


def gpu_simulator_reads_zeros_past_edges() -> bool:
    """Whether the Mosaic GPU simulator's TMA copies read zeros past an
    array's edge and drop writes there, as the hardware does (JAX 0.11 on),
    instead of raising IndexError (0.10)."""
    task = getattr(_gpu_callbacks(), "AsyncCopyGmemToSmemTask", None)
    return getattr(task, "out_of_bounds_source_fill", None) is not None


def races_found(family: str) -> bool:
    """Whether the simulator's race detector flagged the last kernel it ran."""
    if family == "mosaic_gpu":
        state = getattr(_gpu_callbacks(), "_races", None)
    else:
        state = getattr(_tpu_interpreter(), "races", None)
    return bool(state is not None and state.races_found)


@functools.cache
def dlpack_import_target(dl_device_type: int, device_id: int):
    """(JAX device, stream) a DLPack capsule from that device imports to."""
    jax()
    from jax._src import dlpack as jax_dlpack
    from jax._src import xla_bridge

    platform = jax_dlpack._DL_DEVICE_TO_PLATFORM[dl_device_type]
    device = xla_bridge.get_backend(platform).device_from_local_hardware_id(device_id)
    stream = None
    if dl_device_type != jax_dlpack.DLDeviceType.kDLCUDAHost:
        try:
            stream = device.get_stream_for_external_ready_events()
        except Exception as e:  # the CPU has no streams: UNIMPLEMENTED
            if "UNIMPLEMENTED" not in str(e):
                raise
    return device, stream


@functools.cache
def dlpack_to_buffer():
    """jaxlib's capsule import, as (capsule, device, stream, dl_device_type)."""
    jax()
    from jax._src.lib import _jax, jaxlib_extension_version

    to_buffer = _jax.dlpack_managed_tensor_to_buffer
    if jaxlib_extension_version >= 467:
        return lambda capsule, device, stream, dl_type: to_buffer(capsule, device, stream, None, dl_type)
    return lambda capsule, device, stream, dl_type: to_buffer(capsule, device, stream, None)


@functools.cache
def buffer_to_dlpack():
    """jaxlib's capsule export of a JAX array (array, stream=...)."""
    jax()
    from jax._src.lib import _jax

    return _jax.buffer_to_dlpack_managed_tensor
