"""Shared fixtures: a seeded generator per test and the CPU backends."""

from __future__ import annotations

import os
import zlib

import torch

# Without a GPU, the Triton kernels run in Triton's CPU interpreter. The
# variable must be set before they are first imported (triton.jit reads it
# at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One program at a time holds a TPU: pytest-xdist's workers stay on JAX's
# CPU backend, and the tests marked `tpu` run where pytest runs them in one
# process (`pytest -m tpu -n 0`). (This also keeps libtpu, where installed
# for the compile-only tests, from probing for a chip in every worker.)
if os.environ.get("PYTEST_XDIST_WORKER") and "JAX_PLATFORMS" not in os.environ:
    os.environ["JAX_PLATFORMS"] = "cpu"

# Inductor's on-disk caches outlive a run and key compiled graphs by the
# graph, not by a custom op's fake function: a graph compiled by an older
# checkout would be reused with the old fake's sizes and strides. Each run
# (each xdist worker) compiles into a fresh directory; the kernels' own disk
# cache (torch_pallas/runtime/disk_cache.py) keys by the package's source and needs no such care.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchinductor-tests-")

import pytest

import torch_pallas

from helpers import CPU_BACKENDS


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random data per test, reproducible from the test's name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request):
    with torch_pallas.backend(request.param):
        yield request.param
