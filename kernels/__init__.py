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

if __name__ == "kernels":
    # This folder is torch_pallas.kernels. It is found as a top-level
    # `kernels` only when a checkout's root is on sys.path (`python -c`,
    # `python -m pytest` or a notebook started there), where it would stand
    # in for the installed distribution of that name (Hugging Face's, which
    # transformers 5 imports). Step aside: load that distribution from the
    # rest of sys.path in our place, or be an empty namespace as a folder
    # that is not a package would be.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _outside_this_checkout() -> list[str]:
        root = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
        return [entry for entry in sys.path
                if os.path.realpath(entry or os.curdir) != root]

    _spec = importlib.machinery.PathFinder.find_spec(__name__, _outside_this_checkout())
    if _spec is None:
        # No distribution: what Python makes of a folder that is not a
        # package, an empty namespace (PEP 420), here with nothing below it
        # (`kernels.triton` is not found). Raising instead would break the
        # libraries that probe for the distribution by importing it once
        # find_spec answers (transformers 5.17 does, and takes a module
        # without __file__ or __version__ for a stray namespace, as absent).
        _spec = importlib.machinery.ModuleSpec(__name__, None, is_package=True)
        _spec.submodule_search_locations = []
    _distribution = importlib.util.module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this body has run.
    sys.modules[__name__] = _distribution
    if _spec.loader is not None:
        _spec.loader.exec_module(_distribution)
