"""Bytes a decode step must move (the roofline's numerator) and the device's measured bandwidth."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from k3jax.config import K3Config, expected_unique_experts

# Measured device-to-device copy rates (bytes read + written per second); see BENCHMARKS.md.
MEASURED_COPY_BANDWIDTH = {"NVIDIA H200": 4.3e12}
# Dense bf16 tensor-core peak from the vendor's spec sheet (FLOP/s): 2048 multiply-adds per clock per
# SM; ncu's tensor-pipe percentages are of this rate at the SM clock it profiles at.
PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12}


def dense_weight_bytes(cfg: K3Config, dtype_bytes: int = 2) -> int:
    """Bytes of every weight a decode step reads in full: all but the routed experts and the
    embedding table (of which a step reads only B rows)."""
    params = cfg.active_param_count() - sum(
        cfg.num_experts_per_token * 3 * cfg.moe_hidden_size * cfg.moe_intermediate_size
        for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    return params * dtype_bytes


def decode_step_bytes(cfg: K3Config, batch: int, context: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Fewest bytes one decode step of `batch` sequences at `context` cached tokens moves.

    Weights are read once per step (shared by the batch); the expected number of distinct experts
    assumes uniform routing; KDA states are read and written; the MLA cache is read up to `context`.
    """
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = n_moe * expected_unique_experts(cfg, batch) * cfg.expert_bytes()
    kda_state = batch * len(cfg.kda_layers) * (
        2 * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 + 2 * (cfg.kda_conv_size - 1) * 3 * cfg.kda_dim * dtype_bytes)
    mla_cache = batch * len(cfg.mla_layers) * (context + 1) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    dense = dense_weight_bytes(cfg, dtype_bytes) + batch * cfg.hidden_size * dtype_bytes
    total = dense + experts + kda_state + mla_cache
    return {"dense_weights": dense, "experts": experts, "kda_state": kda_state, "mla_cache": mla_cache, "total": total}


@functools.cache
def copy_bandwidth(device: jax.Device | None = None, nbytes: int | None = None) -> float:
    """Measured copy rate of `device` in bytes/s (read + write), median of a few large copies."""
    device = device or jax.devices()[0]
    if device.device_kind in MEASURED_COPY_BANDWIDTH:
        return MEASURED_COPY_BANDWIDTH[device.device_kind]
    nbytes = nbytes or (1 << 30 if device.platform == "gpu" else 1 << 26)
    x = jax.device_put(jnp.arange(nbytes // 4, dtype=jnp.float32), device)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / sorted(times)[len(times) // 2]
