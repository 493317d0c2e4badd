"""What a TPU chip takes, for the TPU kernels run on one (`interpret=None`):
the precision of its matrix unit's products, the dtypes its vector unit
loads, and its memory, from which block sizes are chosen.

- Products (`precision`): bfloat16 at the MXU's native precision (one pass,
  float32 accumulation through `preferred_element_type`); Mosaic refuses a
  bfloat16 dot at HIGHEST ("Bad lhs type", v5e and v6e). float32 at
  HIGHEST: the MXU's default for float32 is one bfloat16 pass, less than
  torch allows at any float32 matmul precision.
- float16 (`widening_float16`): Mosaic cannot load float16 vectors on v5e
  and v6e ("Invalid vector type for load"), so on a chip a kernel's float16
  operands are widened to float32 before it runs and its float16 results
  narrowed after, outside the kernel: twice the bytes read and written, and
  float32 products (several MXU passes) where bfloat16 would take one. The
  simulators keep float16 as it is.
- Memory (`info`): the chip of a JAX device by its device kind
  (`pltpu.get_tpu_info_for_chip`), for kernels sizing their blocks to its
  VMEM and asking Mosaic for it (`vmem_limit`, `kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# JAX's device kinds of the chips, oldest first.
_KINDS = {
    "TPU v4": "TPU_V4",
    "TPU v5 lite": "TPU_V5E",
    "TPU v5e": "TPU_V5E",
    "TPU v5": "TPU_V5P",
    "TPU v5p": "TPU_V5P",
    "TPU v6 lite": "TPU_V6E",
    "TPU v6e": "TPU_V6E",
    "TPU7x": "TPU_7X",
}
# Mosaic's own default limit on the VMEM a kernel's blocks and scratch take
# (scoped VMEM), v5e's: the budget when the chip is unknown.
DEFAULT_VMEM_BUDGET = 16 * 2**20
# The most scoped VMEM a kernel asks for (vmem_limit): v5e and v6e have 128
# MiB per TensorCore.
RAISED_VMEM_LIMIT = 64 * 2**20


def precision(dtype):
    """The dot precision for operands of `dtype` (see the module's docstring)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


@functools.cache
def info(device_kind: str | None):
    """`pltpu.TpuInfo` of the chip of that device kind (per TensorCore), or
    None for a device that is not a TPU chip JAX describes."""
    name = _KINDS.get(device_kind or "")
    version = getattr(pltpu.ChipVersion, name, None) if name else None
    if version is None:
        return None
    try:
        return pltpu.get_tpu_info_for_chip(version, 1)
    except (ValueError, NotImplementedError):
        return None


def device_kind(device) -> str | None:
    return getattr(device, "device_kind", None)


def vmem_limit(device) -> int:
    """The scoped VMEM (bytes) the matmul-shaped kernels ask Mosaic for
    (`compiler_params`) and size their blocks to on `device`: half the
    chip's VMEM, at most RAISED_VMEM_LIMIT; Mosaic's default where the chip
    is unknown. Their larger blocks need it: v5e, 16384 x 4096 x 1792
    grouped_mm in 512 x 896 x 2048 tiles 1.73 ms against 1.80 in the 16 MiB
    that 512 x 896 x 1024 fit; matmul 8192^3 in 1024^3 blocks 5.93 ms
    against 6.09 (bench/tpu_check.py --vmem-limit-mib 64, 2026-12-06)."""
    chip = info(device_kind(device))
    if chip is None:
        return DEFAULT_VMEM_BUDGET
    return min(RAISED_VMEM_LIMIT, chip.vmem_capacity_bytes // 2)


def compiler_params(vmem_limit_bytes: int | None):
    """A pl.kernel's Mosaic parameters for that scoped-VMEM limit (None:
    Mosaic's default, none passed)."""
    if vmem_limit_bytes is None:
        return None
    return pltpu.CompilerParams(vmem_limit_bytes=vmem_limit_bytes)


def kernel(body, *, vmem_limit: int | None, **kwargs):
    """pl.kernel(body, **kwargs) asking Mosaic for `vmem_limit` bytes of
    scoped VMEM (None: its default), its outputs kept out of XLA's fusions
    where it asks for a limit. In a loop that stacks its results (a
    `lax.scan`'s outputs, as the JAX forms' chunked loss makes), XLA fuses
    the kernel's call with the dynamic-update-slice that writes its output in
    place and compiles that fusion under XLA's own 16 MiB of scoped VMEM, not
    the kernel's limit: CompileTimeScopedVmemOom for blocks that need more
    (libtpu 0.0.42, v5e: a 256 x 4096 matmul of K 131072 in 1024 x 4096
    blocks, 22 MiB). An optimization barrier on the outputs keeps the call
    apart; the price is one copy of each output where XLA would have written
    it in place."""
    call = pl.kernel(body, compiler_params=compiler_params(vmem_limit), **kwargs)
    if vmem_limit is None:
        return call
    return lambda *args: jax.lax.optimization_barrier(call(*args))


def log(x):
    """log(x) for x > 0 to about exp's accuracy: one Newton step on
    exp(y) = x from jnp.log's value, y + x * exp(-y) - 1. On v5e float32 log
    is off by up to 1.1e-4 (absolute; XLA's too) and exp by 4.6e-6
    (relative), measured against float64 (2026-12-06): a softmax's log-sum-
    exp taken with log alone moved every probability a backward recomputes
    from it by 1e-4. Its cost: one exp per row, where it takes a row's sum."""
    y = jnp.log(x)
    return y + x * jnp.exp(-y) - 1.0


def _float16(x) -> bool:
    return hasattr(x, "dtype") and jnp.dtype(x.dtype) == jnp.float16


def _widened_parameter(value):
    """A static parameter naming float16 (an output dtype) as float32."""
    if isinstance(value, str) and value == "float16":
        return "float32"
    if value is jnp.float16 or (isinstance(value, jnp.dtype) and value == jnp.float16):
        return jnp.dtype(jnp.float32)
    return value


def widening_float16(run):
    """A TPU kernel's entry point that, on a chip (`interpret=None`), takes
    float16 operands through float32 (see the module's docstring); the
    results have the dtypes the kernel gives for float16."""

    @functools.wraps(run)
    def run_on_chip(*inputs, interpret, **params):
        if interpret is not None or not (any(map(_float16, inputs))
                                         or any(_widened_parameter(v) is not v
                                                for v in params.values())):
            return run(*inputs, interpret=interpret, **params)
        expected = jax.eval_shape(functools.partial(run, interpret=interpret, **params),
                                  *inputs)
        wide = [x.astype(jnp.float32) if _float16(x) else x for x in inputs]
        out = run(*wide, interpret=interpret,
                  **{k: _widened_parameter(v) for k, v in params.items()})
        return jax.tree.map(lambda o, e: o.astype(e.dtype), out, expected)

    return run_on_chip
