"""The installed layout: ops/ and kernels/ live inside the package."""

from __future__ import annotations

import importlib.metadata
import os
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
        "spec = importlib.util.find_spec('kernels'); "
        "print(importlib.util.find_spec('ops'), spec and spec.origin)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout
    ops, kernels = out.split()
    assert ops == "None"  # no top-level `ops`
    # no top-level `kernels` of ours (Hugging Face's distribution may be installed)
    assert kernels == "None" or not Path(kernels).resolve().is_relative_to(ROOT)


def _run_in_the_checkout(code: str, **env) -> subprocess.CompletedProcess:
    """`python -c code` started in the checkout's root (on sys.path first)."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env})


def test_the_checkout_root_does_not_shadow_the_kernels_distribution():
    """Started in the checkout, `kernels/` (torch_pallas.kernels) is the first
    `kernels` on sys.path; Hugging Face's distribution of that name, which
    transformers 5 imports, is loaded in its place; without it transformers
    still imports and finds no `kernels` (5.17 imports whatever find_spec
    names and reads a module without __file__ as absent)."""
    try:
        importlib.metadata.distribution("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    done = _run_in_the_checkout(
        "import transformers.models.llama.modeling_llama, kernels\n"
        "from transformers.utils import import_utils\n"
        "print(getattr(kernels, '__file__', None), import_utils.is_kernels_available())")
    assert done.returncode == 0, done.stderr
    where, available = done.stdout.split()
    if installed:
        assert not Path(where).resolve().is_relative_to(ROOT)
    else:
        assert (where, available) == ("None", "False")


def test_the_kernels_folder_steps_aside_for_any_distribution(tmp_path):
    """Whatever `kernels` comes later on sys.path is what `import kernels`
    gives in the checkout; with none, an empty namespace, as a folder that
    is not a package would give, with none of our kernels below it."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'the distribution'\n")
    found = _run_in_the_checkout("import kernels; print(kernels.WHO, kernels.__name__)",
                                 PYTHONPATH=str(tmp_path))
    assert found.stdout.split() == ["the", "distribution", "kernels"], found.stderr
    hidden = tmp_path / "elsewhere"  # sys.path without any distribution of that name
    hidden.mkdir()
    missing = _run_in_the_checkout(
        "import sys; sys.path[:] = [p for p in sys.path if 'packages' not in p]; import kernels\n"
        "print(getattr(kernels, '__file__', None), list(kernels.__path__))\n"
        "import kernels.triton",
        PYTHONPATH=str(hidden))
    assert missing.stdout.split() == ["None", "[]"], missing.stderr
    assert "ModuleNotFoundError: No module named 'kernels.triton'" in missing.stderr, missing.stderr


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
