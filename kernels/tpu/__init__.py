"""Pallas TPU kernels (`pl.kernel` on a TensorCore mesh, HBM and VMEM refs,
`pltpu.emit_pipeline`), after the Pallas TPU quickstart.

Every kernel takes `num_cores` (TensorCores on the mesh) and `interpret`
(how to run it: JAX's generic interpreter, TPU interpret mode, or None for a
TPU). With one core the kernels bind no core axis, which lets JAX's generic
interpreter run them.
"""
