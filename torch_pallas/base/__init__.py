"""What the rest of torch_pallas stands on: the package's exceptions
(`errors`), its dtype tables (`dtypes`), and the one place for each
library's private APIs, probed once with a public fallback: torch's
(`torch_compat`) and JAX's (`jax_env`, which also imports and sets up JAX).

Imports: nothing of torch_pallas (tests/test_layering.py).
"""

VERSION = "0.1.0"  # torch_pallas.__version__; the kernels' disk cache keys by it
