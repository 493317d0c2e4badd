#!/usr/bin/env bash
# Source on the lent GPU machine (H100 or H200: no network; its python3
# holds torch 2.11.0+cu130, jax 0.11.2 with the CUDA 13 plugin, triton 3.6.0,
# transformers 5.17.0, pytest, pytest-benchmark) from the checkout's root:
# installs this checkout into that Python with `pip install --no-deps -e .`
# (pip fetches nothing and leaves the machine's torch and JAX as they are),
# then the wheels carried in .gpu-wheels/ (what the image lacks: Liger-Kernel
# for linear_cross_entropy's reference, expecttest for the tests that read
# torch's own samples). Fill .gpu-wheels/ on the CPU machine first and carry
# it with the device call (it is git-ignored; a few MiB):
#   pip download --no-deps --dest .gpu-wheels liger-kernel==0.8.5 expecttest
# Then, one phase a device call (bench/gpu_check.py --list):
#   source bench/gpu_machine.sh && python bench/gpu_check.py --phase correctness --out "$OUT/correctness"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install --quiet --no-deps --no-build-isolation --no-index -e "$ROOT"
if compgen -G "$ROOT/.gpu-wheels/*.whl" > /dev/null; then
    "$PYTHON" -m pip install --quiet --no-deps --no-index "$ROOT"/.gpu-wheels/*.whl
fi
# JAX must leave the GPU's memory to torch (torch_pallas sets this too, at
# its first kernel; a process that starts JAX first needs it here).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Triton's and JAX's compiled kernels kept between the calls of one warm machine.
export TRITON_CACHE_DIR="$ROOT/.gpu-cache/triton"
"$PYTHON" - <<'PY'
import importlib.metadata as m
import torch
names = ("torch", "jax", "jaxlib", "jax-cuda13-plugin", "triton", "transformers", "numpy",
         "liger-kernel", "torch_pallas")
versions = []
for name in names:
    try:
        versions.append(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        versions.append(f"{name} absent")
print(", ".join(versions))
print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
PY
