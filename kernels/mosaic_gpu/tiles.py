"""The tiles both Hopper matmul kernels (matmul.py, matmul_warp_specialized.py)
stage for `wgmma`: which way each operand lies (`staged_layouts`), their
SMEM layout (128-byte swizzle, `smem_transforms`), the operands zero-padded
to whole tiles with their batches stacked along the rows (`as_row_tiles`),
and the shared memory a Hopper block has for them (`HOPPER_SMEM_BYTES`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import matmul_dims, round_up

# One swizzled SMEM row: a K tile of a wgmma operand holds this many bytes.
SWIZZLE_BYTES = 128

# Shared memory a block may use on Hopper (227 KiB).
HOPPER_SMEM_BYTES = 227 * 1024


def staged_layouts(dtype, transpose_a: bool, transpose_b: bool) -> tuple[bool, bool]:
    """(a_m_major, b_k_major): how the hardware stages the operands. wgmma
    reads 16-bit operands either way, so they stay as they lie; float32 is
    TF32, which wgmma reads K-major only: A (M, K) and B (N, K)."""
    tf32 = jnp.dtype(dtype).itemsize == 4
    return transpose_a and not tf32, transpose_b or tf32


def smem_transforms(dtype, row_bytes: int = SWIZZLE_BYTES):
    """The SMEM tiling and swizzle for tiles whose rows hold `row_bytes`
    (wgmma operands: 128 bytes; epilogue tiles: their width)."""
    swizzle = plgpu.find_swizzle(row_bytes * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def as_row_tiles(a, b, a_m_major: bool, b_k_major: bool, tile_m: int, tile_n: int,
                 tile_k: int):
    """((batch, m, n, k), padded (mp, np, kp), a rows, b rows): a (Ba, M, K),
    or (Ba, K, M) if a_m_major, and b (Bb, K, N), or (Bb, N, K) if b_k_major,
    zero-padded to whole tiles and stacked along the rows as 2-D arrays."""
    dims = matmul_dims(a.shape, b.shape, a_m_major, b_k_major)
    _, m, n, k = dims
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    if a_m_major:
        a_rows = pad_to(a, (a.shape[0], kp, mp)).reshape(-1, mp)
    else:
        a_rows = pad_to(a, (a.shape[0], mp, kp)).reshape(-1, kp)
    if b_k_major:
        b_rows = pad_to(b, (b.shape[0], np_, kp)).reshape(-1, kp)
    else:
        b_rows = pad_to(b, (b.shape[0], kp, np_)).reshape(-1, np_)
    return dims, (mp, np_, kp), a_rows, b_rows
