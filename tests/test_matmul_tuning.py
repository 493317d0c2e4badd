"""The warp-specialized Hopper matmul and its tuner: every configuration the
tuner may pick is simulated (Mosaic GPU interpret mode) against float64 on
ragged shapes; the tuner and its disk cache run with fake timings."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torch_pallas.kernels.mosaic_gpu import (matmul as M, matmul_tuning as T,
                                             matmul_warp_specialized as W)
from torch_pallas.kernels.mosaic_gpu.tiles import HOPPER_SMEM_BYTES
from torch_pallas.base import jax_env
from torch_pallas.ops import matmul as matmul_op

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# (config, dtype) for every default a first call may use
SHIPPED = sorted(
    {(T.shipped_default("NVIDIA H100 80GB HBM3", dt, m, 4096, 4096), dt)
     for dt in DTYPES for m in (16, 4096)}
    | {(T.GENERIC_DEFAULT, dt) for dt in DTYPES},
    key=str,
)


def simulate(config, dtype, batches=(1, 1), seed=0):
    """One product on ragged shapes covering 2 x 2 output tiles and 3 K steps,
    on 2 simulated SMs (so the persistent loop runs several tiles each)."""
    config = dataclasses.replace(config, num_programs=2)
    m, n, k = config.tile_m + 7, 2 * config.tile_n + 5, 2 * config.tile_k(dtype) + 3
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal((batches[0], m, k)), dtype)
    b = jnp.asarray(rng.standard_normal((batches[1], k, n)), dtype)
    interpret = jax_env.gpu_interpret_params(detect_races=False)
    try:
        out = jax.jit(lambda a, b: M.matmul(a, b, transpose_a=False, transpose_b=False,
                                            config=config, interpret=interpret))(a, b)
    except Exception:
        jax_env.reset_simulator("mosaic_gpu")
        raise
    ta, tb, to = (torch.from_dlpack(x).float() if x.dtype == jnp.float32 else
                  torch.from_dlpack(x.astype(jnp.float32)).to(getattr(torch, jnp.dtype(dtype).name))
                  for x in (a, b, out))
    ref = matmul_op.reference(ta, tb)
    bound = matmul_op.error_bound(ta, tb, ref)
    assert to.shape == ref.shape
    assert bool(((to.double() - ref).abs() <= bound).all()), f"{config} {jnp.dtype(dtype).name}"


@pytest.mark.parametrize(
    "config,dtype", SHIPPED,
    ids=[f"{c.tile_m}x{c.tile_n}x{c.max_concurrent_steps}-{jnp.dtype(d).name}" for c, d in SHIPPED],
)
def test_shipped_configs_are_correct_in_simulation(config, dtype):
    config.check(dtype)
    simulate(config, dtype)


@pytest.mark.parametrize("batches", [(3, 3), (1, 3), (3, 1)], ids=str)
def test_warp_specialized_batches_in_simulation(batches):
    simulate(T.GENERIC_DEFAULT, jnp.bfloat16, batches)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_tunable_config_is_correct_in_simulation(dtype):
    for config in T.candidates(dtype):
        simulate(config, dtype)


def test_candidates_fit_a_hopper_sm_and_prune_the_rest():
    for dtype in DTYPES:
        found = T.candidates(dtype)
        assert found and all(c.smem_bytes(dtype) <= HOPPER_SMEM_BYTES for c in found)
        assert all(c.tile_m * c.tile_n // 128 <= T.ACCUMULATOR_REGISTERS for c in found)
        space = np.prod([len(v) for v in T.SEARCH_SPACE.values()])
        assert len(found) < space  # something was pruned before compiling
    too_big = W.WarpSpecializedConfig(tile_m=256, tile_n=256, max_concurrent_steps=6)
    with pytest.raises(ValueError, match="shared memory"):
        too_big.check(jnp.bfloat16)


def test_tuner_picks_the_fastest_and_caches_it_on_disk(tmp_path):
    cache = T.TuningCache(tmp_path / "tuning.json", device_kind="NVIDIA H200")
    configs = T.candidates(jnp.bfloat16)[:6]
    fastest = configs[3]

    def fake_time(config, dtype, m, n, k):
        if config == configs[1]:
            raise RuntimeError("does not compile")  # skipped, not fatal
        return 1.0 if config == fastest else 2.0

    assert T.tune(jnp.bfloat16, 2048, 4096, 4096, cache=cache, time_fn=fake_time,
                  configs=configs) == fastest
    again = T.TuningCache(tmp_path / "tuning.json", device_kind="NVIDIA H200")
    assert again.get(jnp.bfloat16, 2000, 4000, 4096) == fastest  # same bucket
    assert T.config_for(jnp.bfloat16, 2000, 4000, 4096, cache=again) == fastest
    assert again.get(jnp.bfloat16, 16, 4096, 4096) is None  # another bucket
    assert again.get(jnp.float16, 2048, 4096, 4096) is None  # another dtype
    other_gpu = T.TuningCache(tmp_path / "tuning.json", device_kind="NVIDIA B200")
    assert other_gpu.get(jnp.bfloat16, 2048, 4096, 4096) is None


def test_cache_is_keyed_by_kernel_source(tmp_path, monkeypatch):
    cache = T.TuningCache(tmp_path / "t.json", device_kind="NVIDIA H100")
    cache.put(jnp.bfloat16, 128, 4096, 4096, T.GENERIC_DEFAULT)
    monkeypatch.setattr(T, "kernel_source_hash", lambda: "edited-kernel")
    assert T.TuningCache(tmp_path / "t.json", device_kind="NVIDIA H100").get(
        jnp.bfloat16, 128, 4096, 4096) is None


def test_tuner_without_a_working_config_says_so(tmp_path):
    cache = T.TuningCache(tmp_path / "t.json", device_kind="x")
    with pytest.raises(RuntimeError, match="no matmul configuration ran"):
        T.tune(jnp.bfloat16, 64, 64, 64, cache=cache, time_fn=lambda *a: 1 / 0,
               configs=T.candidates(jnp.bfloat16)[:2])


def test_first_calls_use_shipped_defaults_on_hopper_and_generic_elsewhere(tmp_path):
    h100 = T.TuningCache(tmp_path / "t.json", device_kind="NVIDIA H100 80GB HBM3")
    assert T.config_for(jnp.bfloat16, 16, 4096, 4096, cache=h100).tile_m == 64
    assert T.config_for(jnp.bfloat16, 8192, 4096, 4096, cache=h100).tile_m == 128
    other = T.TuningCache(tmp_path / "t.json", device_kind="NVIDIA A100")
    assert T.config_for(jnp.bfloat16, 8192, 4096, 4096, cache=other) == T.GENERIC_DEFAULT


def test_backend_selects_the_kernel_per_shape(tmp_path, monkeypatch):
    """On a GPU (an H100 with 132 SMs here): the warp-specialized kernel, its
    shipped config for this M, one program per SM; in the simulator the
    quickstart's kernel."""
    monkeypatch.setenv("TORCH_PALLAS_CACHE_DIR", str(tmp_path))
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", core_count=132)
    h200 = types.SimpleNamespace(device_kind="NVIDIA H200", core_count=140)
    n = 500
    for m, k, transpose_a in ((4096, 64, False), (64, 4096, False), (4096, 64, True)):
        a_shape = (1, k, m) if transpose_a else (1, m, k)  # skinny M gets other tiles
        avals = ((a_shape, "bfloat16"), ((1, k, n), "bfloat16"))
        params = {"transpose_a": transpose_a, "transpose_b": False}
        for gpu in (h100, h200):  # the target device's kind and SM count
            config = M.select_config("mosaic_gpu", avals, params, gpu)
            shipped = T.shipped_default(gpu.device_kind, jnp.bfloat16, m, n, k)
            assert config == dataclasses.replace(shipped, num_programs=gpu.core_count)
        assert isinstance(M.select_config("mosaic_gpu_interpret", avals, params), M.MatmulConfig)


def test_without_a_gpu_the_hardware_config_says_what_it_needs(monkeypatch):
    devices = jax.devices

    def no_gpu(backend=None):  # JAX without a GPU backend, on any machine
        if backend == "gpu":
            raise RuntimeError("Unknown backend: 'gpu' requested")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_gpu)
    avals = (((1, 64, 64), "bfloat16"), ((1, 64, 64), "bfloat16"))
    with pytest.raises(RuntimeError, match="JAX sees none.*num_programs"):
        M.select_config("mosaic_gpu", avals, {"transpose_a": False, "transpose_b": False})
