"""The installed layout: ops/ and kernels/ live inside the package."""

from __future__ import annotations

import subprocess
import sys


def test_ops_and_kernels_install_inside_the_package(tmp_path):
    code = (
        "import importlib.util, torch_pallas.ops, torch_pallas.kernels.tpu.matmul, "
        "torch_pallas.kernels.mosaic_gpu.matmul; "
        "print(importlib.util.find_spec('ops'), importlib.util.find_spec('kernels'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["None", "None"]  # no top-level `ops` or `kernels`
