"""torch_pallas is built in layers, each importing only the layers below it
(torch_pallas/__init__.py draws them), and no module imports its way back to
itself. Read from the modules' own import statements, those inside
functions included, so the rule stays true as the code grows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's sources lie in the checkout (setup.py's package_dir).
SOURCES = {"torch_pallas": ROOT / "torch_pallas", "torch_pallas.ops": ROOT / "ops",
           "torch_pallas.kernels": ROOT / "kernels"}

# Lowest first. A module may import a module of a lower layer, or of its own
# package; packages that share a layer (the shipped ops and users' ops; the
# integrations) do not import each other.
LAYERS = (
    ("torch_pallas.kernels",),
    ("torch_pallas.base",),
    ("torch_pallas.runtime",),
    ("torch_pallas.library",),
    ("torch_pallas.ops", "torch_pallas.custom_ops"),
    ("torch_pallas.nn", "torch_pallas.distributed", "torch_pallas.jax"),
    # model patching, on nn's layers and replace_linear; torchax and torch_tpu, on the JAX forms
    ("torch_pallas.transformers", "torch_pallas.torchax", "torch_pallas.torch_tpu"),
    ("torch_pallas",),  # the public API and the environment report (__main__)
)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = modules()


def package_of(module: str) -> str:
    """The layer package holding `module` (the longest that prefixes it)."""
    candidates = [p for layer in LAYERS for p in layer
                  if module == p or module.startswith(p + ".")]
    return max(candidates, key=len)


def rank(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def imports(module: str) -> set[str]:
    """The torch_pallas modules `module` imports, anywhere in its code."""
    path = MODULES[module]
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                here = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imports(module) for module in MODULES}


def upward(module: str, targets) -> list[str]:
    """The `targets` that `module` may not import: of another package at its
    layer or above."""
    package = package_of(module)
    return [t for t in sorted(targets)
            if package_of(t) != package and rank(package_of(t)) >= rank(package)]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (module -> modules it imports)."""
    visiting, done, found = [], set(), []

    def visit(module):
        if module in done:
            return
        if module in visiting:
            found.append(visiting[visiting.index(module):] + [module])
            return
        visiting.append(module)
        for target in sorted(graph[module]):
            visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return found


def test_every_module_lies_in_a_layer():
    assert len(MODULES) > 40, sorted(MODULES)
    for module in MODULES:
        assert package_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_reach_only_lower_layers(module):
    wrong = upward(module, GRAPH[module])
    assert not wrong, (f"{module} ({package_of(module)}) imports {wrong}, which are not below "
                       "its layer: move the shared code down, or hand it over from above")


def test_no_module_imports_its_way_back_to_itself():
    found = circles(GRAPH)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("package", [p for layer in LAYERS[:-1] for p in layer])
def test_each_layer_says_what_it_holds_and_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text())) or ""
    assert "Imports:" in doc, f"{package}'s docstring does not say what it may import"


def test_the_rules_catch_what_they_forbid():
    """Upward and sideways imports, and a circle, on made-up imports (the
    runtime once reached up into custom_ops' kernel advice, which imported
    the Mosaic GPU pallas_call simulation, which imported it back)."""
    assert upward("torch_pallas.runtime.launch", {"torch_pallas.custom_ops.kernel_advice",
                                                  "torch_pallas.base.errors",
                                                  "torch_pallas.runtime.bridge"}) == [
        "torch_pallas.custom_ops.kernel_advice"]
    assert upward("torch_pallas.ops.matmul", {"torch_pallas.custom_ops"}) == ["torch_pallas.custom_ops"]
    assert upward("torch_pallas.nn", {"torch_pallas.ops.matmul"}) == []
    assert upward("torch_pallas.transformers.patching", {"torch_pallas.nn"}) == []
    assert upward("torch_pallas.nn", {"torch_pallas.transformers"}) == ["torch_pallas.transformers"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert "torch_pallas.runtime.launch" in GRAPH["torch_pallas.custom_ops"]  # the graph is read
