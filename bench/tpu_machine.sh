#!/usr/bin/env bash
# Source on a TPU machine whose JAX (with libtpu) is installed and which has
# no network: installs torch's CPU build from the machine's own package
# index into .tpu-deps/ (kept between runs) and lays this checkout out as
# the installed package would be (ops/ and kernels/ inside torch_pallas),
# without letting pip touch the machine's JAX. Then, from the checkout:
#   pytest tests/test_tpu_backend.py -m tpu -o addopts=""   # one process holds the chip
#   TORCH_PALLAS_BACKEND=tpu pytest tests/test_jax_forms.py -o addopts="" -m "not exhaustive"
#   python -m torch_pallas --backend tpu
#   python bench/tpu_check.py --out results/
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPS="$ROOT/.tpu-deps"
if [ ! -d "$DEPS/torch" ]; then
    PIP_CONFIG_FILE=/dev/null python3 -m pip install --quiet --isolated --only-binary=:all: \
        --index-url file:///opt/pypi/simple --target "$DEPS" torch==2.13.0 \
        --find-links /opt/wheels
fi
rm -rf "$DEPS/pkg" && mkdir -p "$DEPS/pkg"
cp -r "$ROOT/torch_pallas" "$DEPS/pkg/torch_pallas"
cp -r "$ROOT/ops" "$DEPS/pkg/torch_pallas/ops"
cp -r "$ROOT/kernels" "$DEPS/pkg/torch_pallas/kernels"
# the package first, the machine's JAX before torch's folder (which may hold another)
export PYTHONPATH="$DEPS/pkg:${PYTHONPATH:+$PYTHONPATH:}$DEPS"
