"""A bounded number of kernel builds under changing shapes.

A kernel is compiled per input shape. A model whose token count changes from
call to call (dynamic padding, `generate` without a KV cache, prompts of
varying length) would build a kernel for every new length, for as long as
the process lives. An op whose kernel can take zero padding along a
dimension (matmul: its rows and its contraction; the padded rows are sliced
off the result, padded contraction terms are zeros) asks `size` which size
to build for:

- the size itself while its family (the op's call with that one dimension
  left out) has seen one size along it: a workload with fixed shapes never
  pads;
- from the second distinct size on, the size rounded up to a bucket, three
  per octave, at 5/8, 3/4 and 1 times a power of two (..., 80, 96, 128,
  160, 192, 256, 320, 384, 512, ...): at most a third more work, and at
  most three kernels per doubling of the size. Two per octave (..., 96,
  128, 192, 256, ...) built fewer kernels but padded up to half again as
  much work: a changing-lengths pass over 100..190 tokens at batch 4 did
  17% more GEMM work (8% now); bench/bench_models.py's pass with the
  kernels already on disk took 3.81 s with two, 3.52 s with three and
  3.60 s with four per octave (single runs on a 2-core VM), and four built
  the most kernels in a first process.

Results keep their accuracy: padding adds zero terms to sums and rows that
are sliced off (tests/test_shape_buckets.py checks the buckets' edges
against float64 and the unpadded kernels). They are not always equal bit
for bit to an unpadded kernel's: XLA's CPU GEMM orders its sums by its
blocking, which follows the sizes (float32 rows differ in the last bits),
so a call's rounding may depend on whether its family had changed size
before. Switch buckets off for results that never depend on that. Sizes up
to `EXACT_UP_TO` are never padded.

Off with `TORCH_PALLAS_SHAPE_BUCKETS=0` in the environment, or
`torch_pallas.runtime.shape_buckets.enabled = False`.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

ENV_VAR = "TORCH_PALLAS_SHAPE_BUCKETS"
EXACT_UP_TO = 8
MAX_FAMILIES = 4096  # sizes remembered; past it the record starts afresh

enabled: bool = os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")

_seen: dict[Hashable, int | None] = {}  # family -> its one size so far, None once it has had two
# Advances whenever a size `size` gave may change (a family starts changing,
# the record is cleared): what callers that remember its answers key them by.
generation: int = 0


def bucket(n: int) -> int:
    """The smallest of 5/8, 3/4 and 1 times a power of two not below n (n
    itself up to EXACT_UP_TO): three buckets an octave, each at most a third
    above the one below it."""
    if n <= EXACT_UP_TO:
        return n
    power = 1 << (n - 1).bit_length()  # the power of two >= n (16 or more)
    for bucket_size in (power // 8 * 5, power // 4 * 3):
        if n <= bucket_size:
            return bucket_size
    return power


def size(family: Hashable, n: int) -> int:
    """The size to build the kernel for when `family` asks for `n`."""
    if not enabled:
        return n
    global generation
    first = _seen.get(family, n)
    if first is None or first != n:
        if len(_seen) >= MAX_FAMILIES:
            _seen.clear()
            generation += 1
        elif first is not None:  # the family's first size is bucketed from now on
            generation += 1
        _seen[family] = None  # changing: bucketed from now on
        return bucket(n)
    _seen[family] = n
    return n


def reset() -> None:
    """Forgets every family's sizes (tests; a new workload)."""
    global generation
    _seen.clear()
    generation += 1


def state() -> tuple[bool, int]:
    """What every answer of `size` depends on besides its arguments and the
    record: a key for remembering them."""
    return enabled, generation
