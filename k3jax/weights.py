"""Building a model: `from_pretrained` (presets with random weights; checkpoints in k3jax.checkpoint),
parameter byte counts and the out-of-memory pre-check."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
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
    """Memory free for new arrays on `device` (GPU: the allocator's limit minus what is in use;
    CPU: the host's available RAM, else its physical RAM)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


# A decode run leaves this fraction of the free memory to XLA's temporaries beyond the state and
# the logits (compiled-step buffers, dequantized experts).
DECODE_HEADROOM = 0.1
# Logits [B, V] float32 and the sampler's temporaries of the same size: the largest decode activations.
LOGITS_COPIES = 4


def check_fits(cfg: K3Config, dtype, *, mesh=None, batch: int = 0, max_len: int = 0, params: bool = True,
               activation_bytes: int | None = None) -> int:
    """Bytes the most loaded device needs; raises OutOfMemoryError, before anything is allocated,
    when they exceed its free memory (device_memory_bytes).

    Counts the parameters (one device's shards under `mesh`: sharding.per_device_param_bytes;
    `params=False` when they are already on the device) and, for batch > 0, the decode state of
    `batch` sequences of up to `max_len` tokens (cache.state_bytes, split over the mesh's batch
    axes) plus the activations: `activation_bytes` per device (e.g. a compiled step's
    memory_analysis().temp_size_in_bytes) or, when None, an estimate (the logits and the sampler's
    copies). With a decode state, all must fit in all but DECODE_HEADROOM of the free memory.
    """
    from k3jax import sharding
    from k3jax.cache import state_bytes
    dtype = parse_dtype(dtype)
    weights = 0
    if params:
        weights = param_bytes(cfg, dtype) if mesh is None else sharding.per_device_param_bytes(cfg, dtype, mesh)
    state = activations = 0
    if batch > 0:
        # Batch axes that do not divide the batch are dropped (batch 1 runs replicated).
        shards = 1 if mesh is None else batch // sharding.batch_sharding(mesh, (batch,)).shard_shape((batch,))[0]
        state = -(-state_bytes(cfg, batch, max_len, jnp.dtype(dtype).itemsize) // shards)
        activations = (-(-LOGITS_COPIES * batch * cfg.vocab_size * 4 // shards) if activation_bytes is None
                       else activation_bytes)
    need = weights + state + activations
    device = jax.local_devices()[0]
    have = device_memory_bytes(device)
    # The parameters may fill the free memory; the decode state and activations get all but the
    # headroom of what the parameters leave (the rule from_pretrained then generate apply). When the
    # parameters alone do not fit, the room is the free memory.
    usable = (have if have is None or batch <= 0 or weights > have
              else weights + int((1 - DECODE_HEADROOM) * (have - weights)))
    if usable is None or need <= usable:
        return need
    parts = ([f"{_gib(weights)} parameters"] if params else []) + (
        [f"{_gib(state)} decode state for batch {batch} x {max_len} tokens",
         f"{_gib(activations)} activations"] if batch > 0 else [])
    if weights > usable:
        fix = "use a smaller preset or shard the parameters over more devices (mesh='ep=N')"
    elif activation_bytes is not None and activations > state:
        fix = "use a smaller batch or shorter prompts (long prompts need large prefill activations)"
    else:
        fix = "use a smaller batch or fewer tokens (prompt + max_new_tokens)"
    where = cfg.name if mesh is None else f"{cfg.name} on mesh {sharding.format_mesh(mesh)}"
    room = (_gib(usable) if usable == have else
            f"{_gib(usable)} (of {_gib(have)} free: the parameters, then {1 - DECODE_HEADROOM:.0%} of the rest)"
            if params and weights else f"{_gib(usable)} ({1 - DECODE_HEADROOM:.0%} of {_gib(have)} free)")
    raise OutOfMemoryError(f"{where}: needs {_gib(need)} per device ({' + '.join(parts)}), more than the "
                           f"{room} a {device.platform} device has for it; {fix}")


def _gib(n: int) -> str:
    return f"~{n / 2**30:.2f} GiB"


def describe(value) -> str:
    """A short description of an argument for error messages: 'float 2.5', 'ndarray float32[2, 3]'."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} {value.dtype}{list(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an int; TypeError naming `name` for a non-integer (bool included), ValueError
    below `minimum` or above `maximum`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_seed(seed, name: str = "seed") -> int:
    """A random seed as jax.random.key and nnx.Rngs take it: an int that fits int64."""
    return check_int(name, seed, minimum=-2 ** 63, maximum=2 ** 63 - 1)


SOURCE_KINDS = ("auto", "preset", "checkpoint")


def _is_checkpoint(path_or_preset: str, source: str) -> bool:
    """Whether `path_or_preset` names a checkpoint directory: `source` "auto" - when a directory
    exists there (else a preset); "checkpoint" - always (reading it names a missing directory or a
    file: checkpoint.read_hf_config); "preset" - never (a folder that happens to share a preset's
    name is not read)."""
    if source not in SOURCE_KINDS:
        raise ValueError(f"source={source!r}: choose from {', '.join(SOURCE_KINDS)}")
    return source == "checkpoint" or (source == "auto" and os.path.isdir(path_or_preset))


def config_of(path_or_preset: str, *, source: str = "auto", **config_changes) -> K3Config:
    """The K3Config `from_pretrained(path_or_preset, source=source, **config_changes)` builds,
    without weights (a preset, or a checkpoint directory's config.json): for checks before a long load."""
    if _is_checkpoint(path_or_preset, source):
        from k3jax.checkpoint import checkpoint_config
        return checkpoint_config(path_or_preset, **config_changes)
    if source == "auto" and path_or_preset not in PRESETS and os.sep in path_or_preset:
        raise FileNotFoundError(f"checkpoint directory {path_or_preset!r} does not exist")
    return get_preset(path_or_preset, **config_changes)


def from_pretrained(path_or_preset: str, *, dtype="bfloat16", seed: int = 0, mesh=None, source: str = "auto",
                    **config_changes) -> K3Model:
    """A model from a preset name (random weights from `seed`) or a checkpoint directory: an
    existing directory wins unless `source` says which it is ("preset" / "checkpoint").

    Random weights are drawn on the default device directly in their final dtype (nothing large
    is staged in host memory). `config_changes` override K3Config fields, e.g.
    `expert_format="bf16"`. `mesh` (a jax Mesh or a spec such as "ep=8", "ep=2,tp=2"; see
    k3jax.sharding) creates every parameter directly in its shards. Raises ConfigError for an
    unknown preset and OutOfMemoryError when the weights cannot fit.
    """
    if not isinstance(path_or_preset, (str, os.PathLike)):
        raise TypeError(f"path_or_preset must be a preset name or a checkpoint directory, got "
                        f"{type(path_or_preset).__name__} {path_or_preset!r}")
    path_or_preset = os.fspath(path_or_preset)
    check_seed(seed)
    dtype = parse_dtype(dtype)
    if mesh is not None:
        from k3jax import sharding
        mesh = sharding.as_mesh(mesh)
    if _is_checkpoint(path_or_preset, source):
        from k3jax.checkpoint import load_hf_checkpoint
        target = None if mesh is None else sharding.checkpoint_sharding(mesh)
        return load_hf_checkpoint(path_or_preset, dtype=dtype, sharding=target, mesh=mesh, **config_changes)
    cfg = config_of(path_or_preset, source=source, **config_changes)
    check_fits(cfg, dtype, mesh=mesh)
    if mesh is not None:
        return sharding.create_sharded(lambda: K3Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed)), mesh)
    with jax.default_device(jax.devices()[0]):
        return K3Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
