"""The proxy fence a pipeline body owes the TMA copy that refills its slots.

`plgpu.emit_pipeline` refills an input slot by TMA (PTX's async proxy) as
soon as the step that read it has run. A body that reads its slots with
plain loads (the generic proxy: `ref[...]`, `plgpu.load`) leaves those loads
unordered with that TMA write under PTX's memory model, which orders
accesses of two proxies only across a proxy fence: `plgpu.commit_smem`
(fence.proxy.async.shared::cta). The warpgroup barrier Mosaic GPU puts
before each copy orders the warpgroup's threads, not the proxies. JAX 0.11
on's race detector follows that model and flags the unfenced form, 0.10's
does not (tests/test_races.py). Bodies whose slots only wgmma reads (through
the async proxy itself) need no fence.
"""

from __future__ import annotations

import functools

from jax.experimental.pallas import mosaic_gpu as plgpu


def fenced(body):
    """Pipeline body `body`, followed by the proxy fence (its result, a
    carry or None, returned as it is)."""

    @functools.wraps(body)
    def run(*args):
        out = body(*args)
        plgpu.commit_smem()
        return out

    return run
