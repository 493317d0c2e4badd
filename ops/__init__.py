"""The torch ops (`torch.ops.pallas.*`): one file per op with its
`torch.library` definition, fake (meta) function, autograd, public Python
function, float64 reference and example calls, and the `registry.OpInfo`
naming the kernel files that implement it.

Importing this package imports every op file in it, which registers the
ops; it does not import JAX.

Imports: `base`, `runtime` (`launch.run`, `registry`) and `library`
(`registration.define`) of torch_pallas, and the kernels' shape helpers;
never `custom_ops` or the integrations, which stand beside and above it.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "checks":  # argument checks the op files share
        importlib.import_module(f"{__name__}.{_module.name}")
