"""Kernels, one folder per family, one file per op (pure JAX Pallas or Triton).

Nothing here imports the rest of torch_pallas: a kernel takes and returns
arrays, with its tuning knobs in a frozen config dataclass (`default(backend)`),
and its file ends with `KERNEL`, what the op layer may use of it
(kernels/spec.py). Shared by every family: shapes.py (block counts, a
matmul's M, N, K), padding.py (ragged shapes padded to whole blocks) and
gridless.py (a one-block kernel, on JAX refs under the generic interpreter). The
references every kernel is tested against are torch's, in float64: each
op's `reference` in ops/.

Imports: nothing of torch_pallas outside torch_pallas.kernels
(tests/test_kernel_imports.py, tests/test_layering.py).
"""
