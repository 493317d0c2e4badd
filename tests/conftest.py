"""Shared fixtures: a seeded generator per test and the CPU backends."""

from __future__ import annotations

import zlib

import pytest
import torch

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
