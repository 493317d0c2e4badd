"""torch_pallas: Pallas kernels (JAX's kernel language) as PyTorch operators."""

from setuptools import find_packages, setup

setup(
    name="torch_pallas",
    version="0.1.0",
    description="Pallas kernels (Mosaic GPU, TPU) as torch.library operators",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # ops/ and kernels/ live at the top of the repository (one folder per layer)
    # but install inside the package, so no top-level `ops` or `kernels` module
    # ever lands on a user's path.
    packages=[
        "torch_pallas",
        # its layers: base, runtime, library, custom_ops, nn, transformers, distributed
        *(f"torch_pallas.{layer}" for layer in find_packages("torch_pallas")),
        "torch_pallas.ops",
        "torch_pallas.kernels",
        # one subpackage per kernel family: mosaic_gpu, tpu, triton
        *(f"torch_pallas.kernels.{family}" for family in find_packages("kernels")),
    ],
    package_dir={
        "torch_pallas": "torch_pallas",
        "torch_pallas.ops": "ops",
        "torch_pallas.kernels": "kernels",
    },
    install_requires=[
        # torch 2.11 on: the oldest CI tests (the lent GPU machine's; CI
        # tests 2.11, 2.12, 2.13 and the newest: docs/install.md). The
        # lower bound keeps an installed CPU build instead of pulling a
        # multi-GB CUDA build.
        "torch>=2.11",
        "jax>=0.10.2",
        "jaxlib>=0.10.2",
        "numpy",
        # jax.experimental.pallas.mosaic_gpu imports absl, which jax does not
        # declare on CPU-only installs.
        "absl-py",
        # JAX's dtypes. Version 0.7.0's import registers so many NumPy ufunc
        # loops that NumPy's loop list (searched on each addition) takes 0.6 s
        # (NumPy 2.4, 2-core CPU): `import jax` 1.12 s with it, 0.53 s with
        # 0.6.0, and every process's first op call waits for that import.
        "ml_dtypes>=0.5,!=0.7.0",
    ],
    extras_require={
        # The `triton` backend on CPU (TRITON_INTERPRET=1); CUDA builds of
        # torch bring their own triton. 3.6 on: what CI tests (3.6, the GPU
        # machine's, with its compile for sm_90a; 3.7, 3.8 and the newest).
        "triton": ["triton>=3.6"],
        # expecttest: torch.testing._internal (PyTorch's own sample inputs).
        # transformers: tests/test_nn.py converts a small GPT-2 (its Conv1D layers);
        # torch_pallas.transformers needs 4.56 on (CI tests 4.56, 5.17, the
        # newest, and versions between: docs/install.md).
        # jax[tpu]: libtpu at JAX's own pin, whose compile-only client
        # tests/test_tpu_compile.py compiles every TPU kernel with (no chip;
        # libtpu ships for Linux only).
        "test": ["pytest", "pytest-xdist", "pytest-benchmark", "matplotlib", "expecttest", "triton>=3.6",
                 "transformers>=4.56", "trl>=1.16", "jax[tpu]; sys_platform == 'linux'"],
    },
)
