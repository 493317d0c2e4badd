"""The contract between a kernel file and the layer above it.

Every kernel file (`kernels/<family>/<op>.py`) ends with one `KernelSpec`,
named `KERNEL`, that says everything the op layer may use of it; the op
names the kernel files that implement it (torch_pallas/runtime/registry.py), and
nothing reaches into a kernel file for anything else.

How the entry point is called, for a call of op `op` on backend `backend`:

    config = spec.config(backend, avals, params, device)
    spec.run(*inputs, **params, config=config, **execution)

- `inputs`: the op's tensors, as JAX arrays (Triton kernels: torch tensors);
  `avals`: their (shape, dtype name) pairs; `params`: the op's static
  parameters (hashable; part of the compiled kernel's identity); `device`:
  the JAX device the kernel is built for (None for Triton kernels).
- `execution`: the keywords that say how the backend runs this family
  (torch_pallas/runtime/backends.py, `Backend.execution`):

  ==============  ==========================================================
  family          keywords
  ==============  ==========================================================
  ``tpu``         ``interpret`` (True, TPU interpret-mode parameters, or None
                  on a TPU) and ``num_cores`` (TensorCores on the mesh)
  ``mosaic_gpu``  ``interpret`` (Mosaic GPU interpret-mode parameters, or None
                  on a GPU)
  ``triton``      ``wrap`` (identity, or `torch.library.wrap_triton` while
                  torch.compile traces), and ``device`` for kernels that take
                  no tensor
  ==============  ==========================================================

Nothing here imports JAX, Triton or the rest of torch_pallas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# (shape, dtype name) of each input, e.g. ((8, 128), "bfloat16").
Avals = tuple[tuple[tuple[int, ...], str], ...]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one kernel file offers its op.

    Attributes:
      run: the entry point, called as described in the module's docstring.
      default_config: backend name -> the kernel's config (a frozen
        dataclass of its tuning knobs) for that backend.
      select_config: optional; (backend, avals, params, device) -> a config
        chosen for this call's shapes and device (replaces `default_config`
        when given).
      compiler_options: optional; (backend, avals, params) -> XLA compiler
        options for this call's compilation (they choose speed, never
        results).
      unsupported: optional; (backend, avals, params) -> why the kernel
        cannot run this call as torch asks (a sentence finishing "backend
        'x' ..."), or None. An automatic backend choice then falls back; an
        explicit one raises with the reason.
      flops: optional; (avals, params) -> the call's floating-point
        operations, known before anything is traced (the build skips a
        lowering for the calling thread's client that the size rules out).
    """

    run: Callable[..., Any]
    default_config: Callable[[str], Any]
    select_config: Callable[[str, Avals, Mapping[str, Any], Any], Any] | None = None
    compiler_options: Callable[[str, Avals, Mapping[str, Any]], Mapping[str, Any]] | None = None
    unsupported: Callable[[str, Avals, Mapping[str, Any]], str | None] | None = None
    flops: Callable[[Avals, Mapping[str, Any]], float] | None = None

    def config(self, backend: str, avals: Avals, params: Mapping[str, Any],
               device: Any = None) -> Any:
        """The config for one call: per shape and device where the kernel
        chooses so."""
        if self.select_config is not None:
            return self.select_config(backend, avals, params, device)
        return self.default_config(backend)

    def options(self, backend: str, avals: Avals, params: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.compiler_options is None:
            return {}
        return self.compiler_options(backend, avals, params)

    def work(self, avals: Avals, params: Mapping[str, Any]) -> float | None:
        """The call's FLOPs where the kernel says, else None."""
        return None if self.flops is None else self.flops(avals, params)

    def refusal(self, backend: str, avals: Avals, params: Mapping[str, Any]) -> str | None:
        if self.unsupported is None:
            return None
        return self.unsupported(backend, avals, params)
