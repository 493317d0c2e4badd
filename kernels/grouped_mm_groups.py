"""Groups of rows for the grouped matmuls (pure JAX, no kernel).

A grouped matmul's groups are given by their cumulative ends, torch's
`offs`: group g holds rows ends[g-1] .. ends[g] (ends[-1] := 0 before group
0), groups may be empty, and rows from ends[-1] on belong to none.

`walk_rows` visits one range of rows in tiles of static sizes, which is
what a kernel whose blocks have static shapes needs of a range whose
length is known only on the device: whole tiles of `chunk` rows, then the
rest by its binary digits (one tile of each power of two it holds, down to
`min_tile`), then what is left (fewer than `min_tile` rows) as one tile that
ends at the range's end and reaches back over rows already done, with a
mask of the rows it is for. Every row is visited exactly once unmasked, so
the tiles cost the range's rows plus at most `min_tile` more; a tile never
reaches past the array's edge (the start is clamped) and is never larger
than the array.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def starts(ends):
    """Each group's first row: 0, ends[0], ..., ends[-2]."""
    return jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])


def tile_sizes(chunk: int, rows: int, min_tile: int = 8) -> tuple[int, ...]:
    """The static tile sizes of a walk: chunk, chunk/2, ... down to
    min_tile, each no larger than the array's `rows` (a power of two chunk
    is assumed)."""
    sizes, size = [], chunk
    while size >= min_tile:
        if size <= rows:
            sizes.append(size)
        size //= 2
    return tuple(sizes) or (rows,)


def walk_rows(visit: Callable, carry, start, end, *, rows: int, chunk: int,
              min_tile: int = 8):
    """Visits rows start .. end of an array of `rows` rows in static tiles.

    `visit(carry, first_row, size, mask)` returns the new carry; `size` is
    static, `first_row` a traced int32, and `mask` None (every row of the
    tile is in the range) or a (size,) bool array of the rows that are.
    """
    sizes = tile_sizes(chunk, rows, min_tile)
    big = sizes[0]
    start = start.astype(jnp.int32)
    end = end.astype(jnp.int32)

    def whole(i, carry):
        return visit(carry, start + i * big, big, None)

    carry = jax.lax.fori_loop(0, (end - start) // big, whole, carry)
    row = start + (end - start) // big * big
    for size in sizes[1:]:
        take = end - row >= size
        carry = jax.lax.cond(take, lambda c, r=row, s=size: visit(c, r, s, None),
                             lambda c: c, carry)
        row = jnp.where(take, row + size, row)
    # Fewer than the smallest tile left: one tile ending at `end` (or at the
    # array's start), masked to rows row .. end.
    last = sizes[-1]
    first = jnp.maximum(end - last, 0)

    def rest(carry):
        index = first + jnp.arange(last, dtype=jnp.int32)
        return visit(carry, first, last, (index >= row) & (index < end))

    return jax.lax.cond(end > row, rest, lambda c: c, carry)
