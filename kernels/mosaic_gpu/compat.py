"""The Mosaic GPU API spellings that differ between the JAX versions
torch_pallas supports (0.10.2 to 0.12), written once for the kernels here.
Each branch is chosen by what the installed JAX offers, not by its version.

- `plgpu.load(ref, idx, *, layout=)`: JAX 0.10 requires the index (`()` for
  the whole ref); 0.11 makes it optional and deprecates it (index the ref
  with `ref.at[...]` instead); 0.12 removes it, and passing one raises
  TypeError. `load(ref, layout=)` reads the whole ref on each.

(`plgpu.transpose_ref(ref, perm)`, deprecated in 0.12, is `ref.transpose(perm)`
on every supported version: the kernels spell it so.)
"""

from __future__ import annotations

import functools
import inspect

from jax.experimental.pallas import mosaic_gpu as plgpu


@functools.cache
def _load_requires_index() -> bool:
    index = inspect.signature(plgpu.load).parameters.get("idx")
    return index is not None and index.default is inspect.Parameter.empty


def load(ref, *, layout=None):
    """The whole of SMEM/GMEM `ref` as an array in register layout `layout`
    (`plgpu.load`)."""
    if _load_requires_index():
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)
