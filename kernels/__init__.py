"""Kernels, one folder per family, one file per op (pure JAX Pallas or Triton).

Nothing here imports the rest of torch_pallas: a kernel takes and returns
arrays, with its tuning knobs in a frozen config dataclass
(`default_config(backend)`). The references every kernel is tested against
are torch's, in float64: torch_pallas/references.py.
"""
