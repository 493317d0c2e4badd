"""Kernels, one folder per family, one file per op (pure JAX Pallas or Triton).

Nothing here imports torch_pallas: a kernel takes and returns arrays, with
its tuning knobs in a frozen config dataclass (`default_config(backend)`).
"""
