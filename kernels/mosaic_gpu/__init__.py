"""Mosaic GPU kernels (`plgpu.kernel`, GMEM/SMEM refs, TMA, `wgmma`), after
the Mosaic GPU quickstart.

Every kernel takes `interpret`: None on a GPU, or Mosaic GPU interpret-mode
parameters to simulate the GPU (SMEM, TMA, barriers, wgmma) on CPU. The
simulator raises on reads past an array's edge where hardware TMA would
zero-fill, so ragged shapes are zero-padded to whole tiles outside the kernel.
"""
