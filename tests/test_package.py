"""The installed layout: ops/ and kernels/ live inside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def test_a_wheel_carries_every_module(tmp_path):
    """A regular (non-editable) install: every module of torch_pallas/, ops/
    and kernels/ is in the wheel, at its place inside the package."""
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.split()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = (tmp_path / "dist").glob("torch_pallas-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"torch_pallas/{path}" if top == "torch_pallas" else f"torch_pallas/{name}"
        for name in files if name.endswith(".py")
        for top, _, path in [name.partition("/")]
        if top in ("torch_pallas", "ops", "kernels")
    }
    assert expected and expected <= shipped, sorted(expected - shipped)


def test_environment_report_names_the_openmp_wait_policy(monkeypatch):
    import torch

    from torch_pallas.__main__ import cpu_threads

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_threads() == (
        "cpu threads: torch 2, OMP_WAIT_POLICY=unset (PASSIVE speeds up large CPU kernels "
        "that follow parallel torch ops; set it before Python starts)"
    )
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cpu_threads() == "cpu threads: torch 2, OMP_WAIT_POLICY=PASSIVE"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert cpu_threads() == "cpu threads: torch 1, OMP_WAIT_POLICY=unset"
