"""Sizes: block counts, rounding up to whole blocks, the batch, M, N and K
of a batched matmul's operands, and a row-wise kernel's rows. Plain
integer arithmetic and reshapes (no JAX), so the Triton kernels share it
too."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def fitted_block(dim: int, block: int, align: int, smallest: int | None = None) -> int:
    """A block of at most `block` (a multiple of `align`) for a dimension of
    `dim`: the whole dimension, rounded up to `align`, where it fits in one;
    else the largest multiple of `align` down to `smallest` (block / 2 by
    default) that divides it, so that no operand is copied into a padded one
    (1792 = 2 x 896 for a 1024 block); else `block`, the rest padded."""
    whole = round_up(dim, align)
    if whole <= block:
        return whole
    for size in range(block, (block // 2 if smallest is None else smallest) - 1, -align):
        if whole % size == 0:
            return size
    return block


def matmul_dims(a_shape: tuple[int, ...], b_shape: tuple[int, ...], transpose_a: bool,
                transpose_b: bool) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a batched a @ b.

    a_shape: (Ba, M, K), or (Ba, K, M) with transpose_a; b_shape: (Bb, K, N),
    or (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch.
    """
    ba, m, ka = (a_shape[0], a_shape[2], a_shape[1]) if transpose_a else a_shape
    bb, kb, n = (b_shape[0], b_shape[2], b_shape[1]) if transpose_b else b_shape
    if ka != kb:
        raise ValueError(f"matmul: a's K ({ka}, a {tuple(a_shape)}, {transpose_a=}) and "
                         f"b's K ({kb}, b {tuple(b_shape)}, {transpose_b=}) must be equal")
    if 1 not in (ba, bb) and ba != bb:
        raise ValueError(f"matmul: batches {ba} and {bb} must be equal or one of them 1")
    return max(ba, bb), m, n, ka


def rows(x):
    """x (..., N), a JAX array or a torch tensor, as the rows (R, N) a
    row-wise kernel (the norms) reads, and its leading shape, which the
    kernel's results take back: inside a kernel the reshapes are free,
    where each is a dispatcher call of a small torch call outside it."""
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, x.shape[-1]), lead
