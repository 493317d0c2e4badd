"""kernels/ stands alone: its files import nothing of torch_pallas but
torch_pallas.kernels (kernels/spec.py; the op layer calls the kernels, never
the other way round). Read from the source (ast), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
PACKAGE = "torch_pallas.kernels"


def imported_modules(source: str, module: str, is_package: bool = False) -> list[str]:
    """The absolute names a module imports (relative imports resolved against
    `module`, the importing module's name; one that climbs above the top
    package stays relative: ".name")."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module
            else:
                parts = module.split(".")
                parent = parts if is_package else parts[:-1]
                kept = parent[:max(len(parent) - (node.level - 1), 0)]
                base = ".".join(kept + ([node.module] if node.module else []))
            # `from torch_pallas import kernels` imports torch_pallas.kernels.
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def outside_kernels(names: list[str]) -> list[str]:
    return [n for n in names
            if (n == "torch_pallas" or n.startswith(("torch_pallas.", ".")))
            and n != PACKAGE and not n.startswith(PACKAGE + ".")]


def module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(KERNELS).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join((PACKAGE, *parts[:-1])), True
    return ".".join((PACKAGE, *parts)), False


FILES = sorted(KERNELS.rglob("*.py"))


def test_every_kernel_family_is_read():
    families = {p.relative_to(KERNELS).parts[0] for p in FILES if p.parent != KERNELS}
    assert {"tpu", "mosaic_gpu", "triton"} <= families


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(KERNELS)))
def test_kernels_import_only_kernels_of_torch_pallas(path):
    module, is_package = module_name(path)
    bad = outside_kernels(imported_modules(path.read_text(), module, is_package))
    assert not bad, f"kernels/{path.relative_to(KERNELS)} imports {bad}, outside {PACKAGE}"


@pytest.mark.parametrize("source", [
    "from torch_pallas import jax_env",
    "import torch_pallas.runtime.backends",
    "from torch_pallas.ops.matmul import matmul",
    "from ... import launch",  # from kernels/tpu/x.py: torch_pallas.runtime.launch
    "from .... import anything",  # above the package
])
def test_the_check_catches_imports_from_outside(source):
    assert outside_kernels(imported_modules(source, f"{PACKAGE}.tpu.matmul"))


@pytest.mark.parametrize("source", [
    "from torch_pallas.kernels.shapes import cdiv",
    "from torch_pallas import kernels",
    "from .. import spec",
    "from ..mosaic_gpu import tiles",
    "import jax.numpy as jnp",
])
def test_the_check_allows_kernels_and_other_libraries(source):
    assert not outside_kernels(imported_modules(source, f"{PACKAGE}.tpu.matmul"))
