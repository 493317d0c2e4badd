"""Matrix multiplication on TPU, pipelined over K with a float32 accumulator
in VMEM (after the Pallas TPU matmul guide).

`pl.kernel` runs on a TensorCore mesh; `pltpu.emit_pipeline` walks the grid
(M/bm, N/bn, K/bk), copying A and B blocks HBM -> VMEM while the previous
step computes. The M and N dimensions are PARALLEL (split across the
TensorCores), K is ARBITRARY (sequential): at k == 0 the accumulator is
zeroed, every step adds `dot(a, b)` in float32, and the last step writes the
accumulator, cast to the output dtype, into the output block. Ragged M, N, K
are zero-padded to whole blocks once, outside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.blocking import pad_to, round_up


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_m: int | None  # None: the whole dimension in one block
    block_n: int | None
    block_k: int | None

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        # JAX's interpreter copies whole blocks per grid step: on CPU one
        # block (one XLA dot) is fastest. TPU-sized blocks elsewhere.
        if backend == "interpret":
            return cls(block_m=None, block_n=None, block_k=None)
        return cls(block_m=128, block_n=128, block_k=128)


def default_config(backend: str) -> MatmulConfig:
    return MatmulConfig.default(backend)


def matmul_kernel(a_hbm, b_hbm, o_hbm, acc_vmem, *, block_k, num_cores):
    m, k = a_hbm.shape
    _, n = b_hbm.shape
    block_m, block_n = acc_vmem.shape
    k_steps = k // block_k

    def body(a_vmem, b_vmem, o_vmem):
        k_step = pl.program_id(2)

        @pl.when(k_step == 0)
        def _():
            acc_vmem[...] = jnp.zeros_like(acc_vmem)

        acc_vmem[...] += jnp.dot(
            a_vmem[...], b_vmem[...], preferred_element_type=jnp.float32
        )

        @pl.when(k_step == k_steps - 1)
        def _():
            o_vmem[...] = acc_vmem[...].astype(o_vmem.dtype)

    split = {}
    if num_cores > 1:
        split = dict(
            core_axis_name="core",
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY),
        )
    pltpu.emit_pipeline(
        body,
        grid=(m // block_m, n // block_n, k_steps),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((block_k, block_n), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        **split,
    )(a_hbm, b_hbm, o_hbm)


def matmul(a, b, *, config: MatmulConfig, num_cores: int, interpret):
    """a @ b for 2-D a (M, K) and b (K, N), accumulated in float32."""
    m, k = a.shape
    _, n = b.shape
    block_m, block_n, block_k = config.block_m or m, config.block_n or n, config.block_k or k
    mp, np_, kp = round_up(m, block_m), round_up(n, block_n), round_up(k, block_k)
    out = pl.kernel(
        functools.partial(matmul_kernel, block_k=block_k, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct((mp, np_), a.dtype),
        mesh=pltpu.create_tensorcore_mesh("core", num_cores=num_cores),
        scratch_types=dict(acc_vmem=pltpu.VMEM((block_m, block_n), jnp.float32)),
        interpret=interpret,
    )(pad_to(a, (mp, kp)), pad_to(b, (kp, np_)))
    return out[:m, :n]


def matmul_reference(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
