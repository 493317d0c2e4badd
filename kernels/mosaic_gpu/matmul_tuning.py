"""Chooses the warp-specialized matmul's configuration per (device, dtype,
shape bucket): from a cache on disk, else the defaults shipped for H100/H200,
else a generic default; `tune` fills the cache by timing every configuration
that fits the hardware on the GPU (or with any timing function given).

The cache (JSON, `$TORCH_PALLAS_CACHE_DIR` or ~/.cache/torch_pallas) is keyed
by the device kind, the JAX and jaxlib versions and a hash of the kernel's
source, so a new GPU, JAX or kernel never reuses stale choices. Where no
device kind is given, choices are for JAX's first GPU (`default_gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import itertools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from torch_pallas.kernels.mosaic_gpu import matmul_warp_specialized, tiles
from torch_pallas.kernels.mosaic_gpu.matmul_warp_specialized import WarpSpecializedConfig

# Each compute warpgroup keeps its tile_m x tile_n float32 accumulator in
# registers: 128 threads, at most this many registers each for it.
ACCUMULATOR_REGISTERS = 160

SEARCH_SPACE = dict(
    tile_m=(64, 128, 256),
    tile_n=(64, 128, 256),  # per compute warpgroup; the program tile is twice as wide
    max_concurrent_steps=(2, 3, 4, 5, 6),
    grid_tile_width=(1, 4, 8),
)


def candidates(dtype) -> list[WarpSpecializedConfig]:
    """Every configuration of the search space that fits a Hopper SM: shared
    memory and accumulator registers (pruned before anything compiles)."""
    found = []
    for tile_m, tile_n, steps, width in itertools.product(*SEARCH_SPACE.values()):
        config = WarpSpecializedConfig(tile_m=tile_m, tile_n=tile_n,
                                       max_concurrent_steps=steps, grid_tile_width=width)
        if tile_m * tile_n // 128 > ACCUMULATOR_REGISTERS:
            continue
        try:
            config.check(dtype)
        except ValueError:
            continue
        found.append(config)
    return found


def bucket(m: int, n: int, k: int) -> str:
    """Shapes that share a configuration: each dimension rounded up to a
    power of two (M from 64, N and K from 256)."""
    def up(x, lo):
        return max(lo, 1 << max(0, (x - 1).bit_length()))
    return f"{up(m, 64)}x{up(n, 256)}x{up(k, 256)}"


def shipped_default(device_kind: str, dtype, m: int, n: int, k: int) -> WarpSpecializedConfig | None:
    """Defaults for H100/H200 so first calls need no tuning: skinny M on
    64-row tiles, otherwise 128 x (2 x 128) tiles in stripes of 8 along N
    (float32: narrower, its epilogue tiles take twice the SMEM). To be
    replaced by `tune`'s choices once measured on the hardware."""
    if not any(name in device_kind for name in ("H100", "H200", "H800", "GH200")):
        return None
    if jnp.dtype(dtype).itemsize != 2:
        return WarpSpecializedConfig(tile_m=128, tile_n=64, max_concurrent_steps=4, grid_tile_width=4)
    if m <= 128:
        return WarpSpecializedConfig(tile_m=64, tile_n=128, max_concurrent_steps=4, grid_tile_width=1)
    return WarpSpecializedConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, grid_tile_width=8)


GENERIC_DEFAULT = WarpSpecializedConfig(tile_m=128, tile_n=64, max_concurrent_steps=3)


def kernel_source_hash() -> str:
    """Of the kernel and the tiles it stages: an edit to either may change the best choice."""
    source = "".join(inspect.getsource(m) for m in (matmul_warp_specialized, tiles))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def default_gpu() -> jax.Device:
    """The GPU configurations are chosen for where none is named: JAX's first
    (kernels are handed no device; a machine's GPUs are alike)."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:  # no GPU backend
        raise RuntimeError(
            "matmul: the warp-specialized kernel's configuration depends on the GPU "
            f"(its kind, its SM count), and JAX sees none ({e}); name the device kind "
            "(TuningCache(device_kind=...)) and set WarpSpecializedConfig.num_programs"
        ) from e


class TuningCache:
    """Chosen configurations on disk: {context key: {dtype/bucket: config}}."""

    def __init__(self, path: Path | None = None, device_kind: str | None = None):
        root = Path(os.environ.get("TORCH_PALLAS_CACHE_DIR", Path.home() / ".cache" / "torch_pallas"))
        self.path = path or root / "matmul_tuning.json"
        self.device_kind = device_kind or default_gpu().device_kind
        self.context = "|".join((self.device_kind, f"jax {jax.__version__}",
                                 f"jaxlib {jax.lib.__version__}", kernel_source_hash()))
        self._lock = threading.Lock()

    def _load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def get(self, dtype, m: int, n: int, k: int) -> WarpSpecializedConfig | None:
        entry = self._load().get(self.context, {}).get(f"{jnp.dtype(dtype).name}/{bucket(m, n, k)}")
        return WarpSpecializedConfig(**entry) if entry else None

    def put(self, dtype, m: int, n: int, k: int, config: WarpSpecializedConfig) -> None:
        with self._lock:
            data = self._load()
            data.setdefault(self.context, {})[f"{jnp.dtype(dtype).name}/{bucket(m, n, k)}"] = (
                dataclasses.asdict(config)
            )
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.path)  # readers never see half a file


def config_for(dtype, m: int, n: int, k: int, cache: TuningCache | None = None) -> WarpSpecializedConfig:
    """The configuration for an (m, k) @ (k, n) product: tuned, shipped or generic."""
    cache = cache or TuningCache()
    return (cache.get(dtype, m, n, k)
            or shipped_default(cache.device_kind, dtype, m, n, k)
            or GENERIC_DEFAULT)


def time_on_device(config: WarpSpecializedConfig, dtype, m: int, n: int, k: int,
                   repeats: int = 10) -> float:
    """Median seconds of one product on `default_gpu()`, one program per SM
    unless `config` says otherwise (compiled first; operands as the
    hardware stages them, tiles.staged_layouts)."""
    gpu = default_gpu()
    config = dataclasses.replace(config, num_programs=config.num_programs or gpu.core_count)
    _, b_k_major = tiles.staged_layouts(dtype, False, False)
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (1, m, k), dtype)
    b = jax.random.normal(key_b, (1, n, k) if b_k_major else (1, k, n), dtype)
    a, b = jax.device_put((a, b), gpu)
    fn = jax.jit(functools.partial(matmul_warp_specialized.matmul_warp_specialized,
                                   a_m_major=False, b_k_major=b_k_major, config=config,
                                   interpret=None))
    fn(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tune(dtype, m: int, n: int, k: int, *, cache: TuningCache | None = None,
         time_fn: Callable[..., float] = time_on_device,
         configs: list[WarpSpecializedConfig] | None = None) -> WarpSpecializedConfig:
    """Times every candidate for this shape bucket, stores the fastest in the
    cache and returns it. Configurations that fail to compile are skipped."""
    cache = cache or TuningCache()
    timings, failures = [], []
    for config in configs if configs is not None else candidates(dtype):
        try:
            timings.append((time_fn(config, dtype, m, n, k), config))
        except Exception as e:  # does not compile or run on this device
            failures.append(f"{config}: {type(e).__name__}: {e}")
    if not timings:
        raise RuntimeError(
            f"no matmul configuration ran for {m}x{k}x{n} {jnp.dtype(dtype).name}; "
            f"{len(failures)} failed, the first: {failures[0] if failures else 'none tried'}"
        )
    best = min(timings, key=lambda t: t[0])[1]
    cache.put(dtype, m, n, k, best)
    return best
