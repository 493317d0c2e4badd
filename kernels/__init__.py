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
    # rest of sys.path in our place, or be missing as it is.
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
        raise ModuleNotFoundError(
            f"No module named {__name__!r} (the {os.path.dirname(__file__)} folder on sys.path "
            "is torch_pallas.kernels, not the `kernels` distribution)", name=__name__)
    _distribution = importlib.util.module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this body has run.
    sys.modules[__name__] = _distribution
    _spec.loader.exec_module(_distribution)
