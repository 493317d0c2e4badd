"""Compiled kernels kept on disk, so that the next process starts warm.

Building a kernel (tracing and lowering its Pallas code, then XLA's compile)
costs tens of milliseconds per shape; loading the compiled executable back
costs about one or two. The shipped ops' kernels on the `interpret` backend
(the CPU's default) are written here after they are built
(`jax.experimental.serialize_executable`) and read back by a later process
that needs the same kernel.

An entry's name is a digest of everything the executable follows from: the
kernel's identity (op, backend, device, input shapes and dtypes, static
parameters, configuration, XLA options, which JAX client runs it), the
source of torch_pallas itself (a changed kernel never finds an old entry),
the versions of torch_pallas, JAX, jaxlib and Python, XLA_FLAGS, JAX's
64-bit and matmul-precision settings, and the host's CPU (an executable is
compiled for its instruction set). Users' kernels (custom_op) and the
simulators' (which call back into Python) are never written, and XLA cannot
serialize a oneDNN fusion (JAX 0.10: "ToProto is not implemented for thunk
kind: onednn-fusion"): `store` passes over those, and each process builds
them again.

Where: `TORCH_PALLAS_CACHE_DIR`, else `$XDG_CACHE_HOME/torch_pallas`, else
`~/.cache/torch_pallas`; `TORCH_PALLAS_CACHE_DIR=off` (or 0, or empty)
turns it off. An entry that cannot be read is ignored and rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pickle
import platform
import sys
import tempfile
from pathlib import Path

from torch_pallas.base import VERSION, jax_env

ENV_VAR = "TORCH_PALLAS_CACHE_DIR"
FORMAT = 1  # of an entry's file


def directory() -> Path | None:
    """The cache's directory, or None when turned off."""
    chosen = os.environ.get(ENV_VAR)
    if chosen is not None:
        if chosen.strip().lower() in ("", "0", "off", "false", "no"):
            return None
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "torch_pallas"


@functools.cache
def _source_digest() -> str:
    """A digest of the package's Python sources: torch_pallas/ and the ops
    and kernels, wherever each lies (a checkout's editable install keeps
    ops/ and kernels/ beside torch_pallas/, not inside it)."""
    digest = hashlib.sha256()
    for package in ("torch_pallas", "torch_pallas.ops", "torch_pallas.kernels"):
        for location in importlib.util.find_spec(package).submodule_search_locations:
            root = Path(location).resolve()
            for path in sorted(root.rglob("*.py")):
                digest.update(f"{package}/{path.relative_to(root)}".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _host() -> str:
    """The CPU an executable is compiled for: its model and feature flags."""
    described = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    described.append(line.strip())
                    if len(described) >= 4:
                        break
    except OSError:
        pass
    return "\n".join(described)


def _environment() -> tuple:
    jax = jax_env.jax()
    import jaxlib

    return (FORMAT, VERSION, jax.__version__, jaxlib.__version__, sys.version,
            os.environ.get("XLA_FLAGS", ""), bool(jax.config.jax_enable_x64),
            str(jax.config.jax_default_matmul_precision), _source_digest(), _host())


def digest(identity: tuple) -> str | None:
    """An entry's name: `identity` (a kernel's, as launch describes it, made
    of values whose repr is stable across processes) with the environment;
    None where the environment cannot be described (no caching then)."""
    try:
        return hashlib.sha256(repr((identity, _environment())).encode()).hexdigest()
    except Exception:
        return None


def load(name: str, client):
    """The executable filed under `name`, loaded onto `client` (a JAX CPU
    client), or None."""
    root = directory()
    if root is None or name is None:
        return None
    path = root / f"{name}.kernel"
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        from jax.experimental import serialize_executable

        return serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=client, execution_devices=client.local_devices()[:1]
        )
    except Exception:  # absent, torn, or from a JAX that reads it differently: rebuild
        return None


def store(name: str, compiled) -> None:
    """Files `compiled` under `name`; quietly does nothing where it cannot
    (a read-only home, an executable that does not serialize)."""
    root = directory()
    if root is None or name is None:
        return
    try:
        from jax.experimental import serialize_executable

        data = pickle.dumps(serialize_executable.serialize(compiled))
        root.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: a reader never sees half a file.
        with tempfile.NamedTemporaryFile(dir=root, delete=False, suffix=".tmp") as f:
            f.write(data)
        os.replace(f.name, root / f"{name}.kernel")
    except Exception:
        pass
