"""The exceptions torch_pallas raises, and the note it adds to JAX's."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend that cannot serve a call, or one that does not exist."""


class RaceDetectedError(RuntimeError):
    """A simulation backend's race detector flagged a kernel."""


class BackendLimitError(BackendError):
    """A backend that cannot run the kernel it was given: a limit of JAX's
    simulator or interpreter, not of the hardware. The message names the op,
    the backend, the limit and what to do (torch_pallas/custom_ops/kernel_advice.py)."""


class FineGridWarning(UserWarning):
    """A user's kernel whose grids have so many steps that the backend runs
    it far slower than with larger blocks (torch_pallas/custom_ops/kernel_advice.py)."""


def add_note(error: BaseException, note: str) -> None:
    """Adds `note` to `error`'s notes, which tracebacks print after its
    message (Python 3.10, which has no add_note, keeps them unprinted)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]
