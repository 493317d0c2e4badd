"""The CPU simulators' state: one simulated kernel at a time, a reset after
a failure, and their race detectors.

The simulation backends (`tpu_interpret`, `mosaic_gpu_interpret`) keep
global state in JAX (simulated memories, clocks, race records): kernels run
one at a time in a process, and a kernel that fails leaves that state
behind, after which every later kernel fails until it is reset.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator

from torch_pallas.base import jax_env
from torch_pallas.base.errors import RaceDetectedError, add_note
from torch_pallas.runtime.backends import Backend

_detect_races: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_pallas_detect_races", default=False
)
_lock = threading.Lock()


@contextlib.contextmanager
def race_detection(enabled: bool = True) -> Iterator[None]:
    """Runs the simulation backends (`tpu_interpret`, `mosaic_gpu_interpret`)
    with their data-race detectors on; a flagged kernel raises
    RaceDetectedError."""
    token = _detect_races.set(enabled)
    try:
        yield
    finally:
        _detect_races.reset(token)


def detecting_races() -> bool:
    """Whether calls made now ask for race detection."""
    return _detect_races.get()


def run(backend: Backend, kernel: Callable, arrays: list, *, detect_races: bool,
        describe: Callable[[], str]):
    """`kernel(*arrays)` on a simulation backend, waited for; raises
    RaceDetectedError (naming the call, `describe()`) when asked to detect
    races and the simulator found one."""
    with _lock:
        try:
            out = kernel(*arrays)
            jax_env.jax().block_until_ready(out)
        except Exception as e:
            jax_env.reset_simulator(backend.family)
            note = runtime_note(e, backend.name)
            if note is not None:
                add_note(e, f"{describe()}: {note}")
            raise
        if detect_races and jax_env.races_found(backend.family):
            raise RaceDetectedError(
                f"{describe()}: backend {backend.name!r} detected a data race in the kernel"
            )
    return out


def runtime_note(error: BaseException, backend: str) -> str | None:
    """A note for an exception a simulator raised while running a kernel,
    or None: a block read past an array's edge, which hardware TMA fills
    with zeros and the Mosaic GPU simulator refuses."""
    if backend == "mosaic_gpu_interpret" and "Out-of-bounds read" in str(error):
        return ("a block reads past an array's edge: the GPU's TMA would read zeros there, "
                "JAX's Mosaic GPU simulator raises. What to do: pad the operands to whole "
                "blocks (jnp.pad) and slice the result, or keep every block inside the arrays")
    return None
