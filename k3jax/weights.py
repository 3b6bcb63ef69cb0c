"""Building a model: `from_pretrained` (presets with random weights; checkpoints in k3jax.checkpoint),
parameter byte counts and the out-of-memory pre-check."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import K3Config
from k3jax.model import K3Model
from k3jax.presets import PRESETS, get_preset

DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}


class OutOfMemoryError(MemoryError):
    """The model would not fit the device; raised before anything is allocated."""


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype}")
    return dtype


def abstract_model(cfg: K3Config, dtype=jnp.bfloat16) -> K3Model:
    """The model with shapes and dtypes only (nothing allocated)."""
    return nnx.eval_shape(lambda: K3Model(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def param_bytes(cfg: K3Config, dtype=jnp.bfloat16) -> int:
    """Exact bytes of the model's parameters in their storage dtypes."""
    state = nnx.state(abstract_model(cfg, dtype))
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


def device_memory_bytes(device: jax.Device | None = None) -> int | None:
    """Memory available to arrays on `device` (GPU: the allocator's limit; CPU: physical RAM)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def check_fits(cfg: K3Config, dtype, n_devices: int = 1, extra_bytes: int = 0) -> int:
    """Raises OutOfMemoryError when the parameters (+ extra) exceed the devices' memory."""
    need = param_bytes(cfg, dtype) + extra_bytes
    have = device_memory_bytes()
    if have is not None and need > have * n_devices:
        raise OutOfMemoryError(
            f"{cfg.name}: needs ~{need / 2**30:.1f} GiB for weights and state but {n_devices} "
            f"{jax.devices()[0].platform} device(s) have ~{have * n_devices / 2**30:.1f} GiB; "
            f"use a smaller preset or more devices")
    return need


def from_pretrained(path_or_preset: str, *, dtype="bfloat16", seed: int = 0, mesh=None, **config_changes) -> K3Model:
    """A model from a preset name (random weights from `seed`) or a checkpoint directory.

    Random weights are drawn on the default device directly in their final dtype (nothing large
    is staged in host memory). `config_changes` override K3Config fields, e.g.
    `expert_format="bf16"`. `mesh` (a jax Mesh or a spec such as "ep=8", "ep=2,tp=2"; see
    k3jax.sharding) creates every parameter directly in its shards. Raises ConfigError for an
    unknown preset and OutOfMemoryError when the weights cannot fit.
    """
    dtype = parse_dtype(dtype)
    if mesh is not None:
        from k3jax import sharding
        mesh = sharding.make_mesh(mesh) if isinstance(mesh, str) else mesh
    if os.path.isdir(path_or_preset):
        from k3jax.checkpoint import load_hf_checkpoint
        target = None if mesh is None else sharding.checkpoint_sharding(mesh)
        return load_hf_checkpoint(path_or_preset, dtype=dtype, sharding=target, **config_changes)
    if path_or_preset not in PRESETS and os.sep in path_or_preset:
        raise FileNotFoundError(f"checkpoint directory {path_or_preset!r} does not exist")
    cfg = get_preset(path_or_preset, **config_changes)
    if mesh is not None:
        sharding.check_fits_sharded(cfg, dtype, mesh)
        return sharding.create_sharded(lambda: K3Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed)), mesh)
    check_fits(cfg, dtype)
    with jax.default_device(jax.devices()[0]):
        return K3Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
