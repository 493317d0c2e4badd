"""The Mosaic GPU quickstart's compatibility route: a Hopper matmul written as
one `pl.pallas_call` with pipelined BlockSpecs, registered with
torch_pallas.custom_op.

    python examples/mosaic_gpu_pallas_call.py   # checks against torch, in the Mosaic GPU simulator

The grid is (M / tile_m, N / tile_n, K / tile_k) and
`plgpu.CompilerParams(dimension_semantics=("parallel", "parallel", "sequential"),
max_concurrent_steps=2)` tells Mosaic GPU what to do with it: the two
parallel dimensions become the CUDA grid (one output tile per block), the
sequential one a pipeline along K that keeps two steps of TMA copies
(GMEM -> SMEM, in the tiled, swizzled layout wgmma reads) in flight while
wgmma accumulates the tile in a `plgpu.ACC` scratch. Sizes that are not
whole tiles are zero-padded (zeros add nothing to the products) and the
result sliced back.

What JAX 0.10.2 does differently from the quickstart:

- `plgpu.CompilerParams(delay_release=...)` raises TypeError: CompilerParams
  has no such field (its docstring still describes one), and the pallas_call
  lowering rebuilds the BlockSpecs without a `plgpu.BlockSpec`'s
  `delay_release`. Without it a buffer is refilled as soon as its step ends,
  so the kernel waits for each wgmma (`wgmma_wait(0)`) instead of keeping one
  in flight (`wgmma_wait(1)` with `delay_release=1`). Keeping one in flight
  needs `plgpu.kernel` with `plgpu.emit_pipeline` (kernels/mosaic_gpu/matmul.py).
- The Mosaic GPU simulator runs a pallas_call only with whole-array blocks
  (and returns 0 for `pl.program_id`). On `mosaic_gpu_interpret`,
  torch_pallas runs this call as Mosaic GPU lowers it for the hardware
  (torch_pallas/custom_ops/mosaic_gpu_pallas_call.py): a `plgpu.kernel` over the
  parallel dimensions, the K steps run one at a time with their TMA copies
  and wgmma simulated; the overlap of `max_concurrent_steps` is not.
- float32 operands would need B K-major for wgmma (TF32): this example takes
  float16 and bfloat16; the `interpret` backend (JAX's generic interpreter)
  cannot run wgmma.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import torch_pallas

SWIZZLE_BYTES = 128  # the widest wgmma swizzle: one tile row is 128 bytes


def matmul_kernel(a_ref, b_ref, o_ref, acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    plgpu.wgmma_wait(0)  # no delay_release through pallas_call: done before the buffers refill

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def pad_to(x, rows, cols):
    return jnp.pad(x, ((0, -x.shape[0] % rows), (0, -x.shape[1] % cols)))


def matmul(a: torch.Tensor, b: torch.Tensor, tile_m: int = 128, tile_n: int = 128,
           max_concurrent_steps: int = 2, interpret=None) -> torch.Tensor:
    """a @ b for 16-bit (M, K) and (K, N) (JAX arrays inside; the annotations
    are the torch op's signature)."""
    if a.dtype != b.dtype or a.dtype not in (jnp.float16, jnp.bfloat16):
        raise ValueError(f"examples::pallas_call_matmul: a.dtype={a.dtype} and b.dtype={b.dtype} "
                         "must both be float16 or bfloat16")
    m, n = a.shape[0], b.shape[1]
    tile_k = SWIZZLE_BYTES // a.dtype.itemsize
    a, b = pad_to(a, tile_m, tile_k), pad_to(b, tile_k, tile_n)
    layout = (plgpu.TilingTransform((8, tile_k)), plgpu.SwizzleTransform(SWIZZLE_BYTES))
    out = pl.pallas_call(
        matmul_kernel,
        grid=(a.shape[0] // tile_m, b.shape[1] // tile_n, a.shape[1] // tile_k),
        in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda i, j, s: (i, s), transforms=layout),
                  plgpu.BlockSpec((tile_k, tile_n), lambda i, j, s: (s, j), transforms=layout)],
        out_specs=plgpu.BlockSpec((tile_m, tile_n), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype),
        scratch_shapes=[plgpu.ACC((tile_m, tile_n), jnp.float32)],
        compiler_params=plgpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "sequential"),
            max_concurrent_steps=max_concurrent_steps),
        interpret=interpret,
    )(a, b)
    return out[:m, :n]


# torch.ops.examples.pallas_call_matmul; `matmul` stays the JAX function.
torch_pallas.custom_op("examples::pallas_call_matmul", matmul)


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


if __name__ == "__main__":
    a = torch.randn(200, 136, dtype=torch.float16)  # not whole tiles: padded inside
    b = torch.randn(136, 72, dtype=torch.float16)
    with torch_pallas.backend("mosaic_gpu_interpret"):
        out = torch.ops.examples.pallas_call_matmul(a, b)
    want = matmul_reference(a, b)
    err = (out.double() - want).abs().max().item()
    print(f"pallas_call_matmul {tuple(a.shape)} @ {tuple(b.shape)} float16: max |error| {err:.2e}")
    assert err <= 2 * (a @ b - want).abs().max().item() + 1e-2  # float16 rounding of the result
