"""Expert-parallel dispatch/combine (k3jax.moe_parallel) against ops.moe_experts on 8 CPU devices.

Every variant must be exact (no dropped token) for any routing, including every token routed to
one expert. "ragged" (ragged_all_to_all) does not run on XLA:CPU: it is checked here through an
emulation of ragged_all_to_all's documented semantics built on all_to_all (which also poisons
the output buffer with NaN, so a row the collective should not write never reaches a result),
and lowered unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import moe_parallel, mxfp4, ops, sharding

E, M, I, K = 16, 32, 64, 4
ACT = dict(act="situ", beta=4.0, linear_beta=25.0)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """ragged_all_to_all's contract from dense all_to_alls (CPU test stand-in)."""
    n = jax.lax.axis_size(axis_name)
    rows = jnp.arange(operand.shape[0])
    # Chunk j: this rank's rows for receiver j, moved to the front; zero past send_sizes[j].
    chunks = jnp.stack([jnp.where(((rows < send_sizes[j]) & (rows + input_offsets[j] < operand.shape[0]))
                                  .reshape((-1,) + (1,) * (operand.ndim - 1)),
                                  jnp.roll(operand, -input_offsets[j], axis=0), 0) for j in range(n)])
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)               # [src, rows, ...]
    where = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)     # where src writes on me
    out = jnp.full_like(output, jnp.nan) if jnp.issubdtype(output.dtype, jnp.floating) else output
    for i in range(n):
        dst = jnp.where(jnp.arange(operand.shape[0]) < recv_sizes[i], where[i] + jnp.arange(operand.shape[0]),
                        output.shape[0])
        out = out.at[dst].set(got[i], mode="drop")
    return out


@pytest.fixture
def emulate_ragged(monkeypatch):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)


def experts_for(fmt: str, key) -> ops.ExpertWeights:
    k1, k2, k3 = jax.random.split(key, 3)
    shapes = ((E, I, M), (E, I, M), (E, M, I))
    if fmt == "mxfp4":
        (p1, s1), (p3, s3), (p2, s2) = (mxfp4.random_packed(k, s) for k, s in zip((k1, k2, k3), shapes))
        return ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    return ops.ExpertWeights(*(jax.random.normal(k, s, jnp.float32) * 0.3 for k, s in zip((k1, k2, k3), shapes)))


def routing(kind: str, n: int, key):
    if kind == "random":
        return jax.random.randint(key, (n, K), 0, E)
    if kind == "one_expert":         # every (token, slot) pair to expert 5 (duplicate slots too)
        return jnp.full((n, K), 5, jnp.int32)
    if kind == "one_rank":           # every token to the last rank's experts, distinct per slot
        return jnp.broadcast_to(jnp.arange(E - K, E, dtype=jnp.int32), (n, K))
    raise ValueError(kind)


def run_ep(mesh_spec, variant, z, ids, w, experts):
    mesh = sharding.make_mesh(mesh_spec)
    experts = jax.device_put(experts, jax.NamedSharding(mesh, jax.P("expert")))
    with jax.set_mesh(mesh):
        return jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant=variant, **ACT))(z, ids, w, experts)


CASES = [  # (mesh, variant, routing, tokens, expert format)
    ("ep=8", "a2a", "random", 16, "bf16"),
    ("ep=8", "a2a", "one_expert", 8, "bf16"),
    ("dp=2,ep=4", "a2a", "one_rank", 5, "mxfp4"),
    ("ep=2,tp=2", "a2a", "random", 1, "mxfp4"),
    ("ep=8", "allgather", "random", 16, "bf16"),
    ("dp=2,ep=4", "allgather", "one_expert", 3, "mxfp4"),
    ("ep=4", "allgather", "one_rank", 8, "bf16"),
    ("ep=8", "ragged", "random", 16, "bf16"),
    ("ep=8", "ragged", "one_expert", 8, "mxfp4"),
    ("dp=2,ep=4", "ragged", "one_rank", 5, "bf16"),
    ("ep=2,tp=2", "ragged", "random", 3, "bf16"),
    ("ep=8", "packed", "random", 16, "bf16"),
    ("dp=2,ep=4", "packed", "one_expert", 3, "mxfp4"),
    ("ep=2,tp=2", "packed", "one_rank", 1, "bf16"),
    ("ep=8", "a2a_packed", "random", 16, "mxfp4"),
    ("dp=2,ep=4", "a2a_packed", "one_rank", 5, "bf16"),
    ("ep=8", "allreduce", "random", 16, "bf16"),
    ("dp=2,ep=4", "allreduce", "one_expert", 5, "bf16"),
    ("ep=4", "allreduce", "one_rank", 8, "mxfp4"),
]


@pytest.mark.parametrize("mesh_spec,variant,route_kind,n,fmt", CASES)
def test_dispatch_combine_exact(mesh_spec, variant, route_kind, n, fmt, emulate_ragged):
    kz, ki, kw, ke = jax.random.split(jax.random.key(n * 7 + len(route_kind)), 4)
    experts = experts_for(fmt, ke)
    z = jax.random.normal(kz, (n, M), jnp.float32)
    ids = routing(route_kind, n, ki)
    w = jax.random.uniform(kw, (n, K), jnp.float32, 0.1, 1.0)
    want = ops.moe_experts(z, ids, w, experts, **ACT)
    got = run_ep(mesh_spec, variant, z, ids, w, experts)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got)))
    # Same per-row expert math and the same float32 combine: float32 rounding at most.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_bf16_latent_matches_single_device():
    """bf16 activations: the per-slot outputs are the same bf16 values, so the combine agrees to
    bf16 rounding of the (identical) float32 sum."""
    kz, ki, kw, ke = jax.random.split(jax.random.key(3), 4)
    experts = experts_for("mxfp4", ke)
    z = jax.random.normal(kz, (12, M), jnp.bfloat16)
    ids, w = routing("random", 12, ki), jax.random.uniform(kw, (12, K), jnp.float32, 0.1, 1.0)
    want = ops.moe_experts(z, ids, w, experts, **ACT).astype(jnp.float32)
    for variant in ("a2a", "allgather", "packed", "a2a_packed", "allreduce"):
        got = run_ep("ep=4", variant, z, ids, w, experts).astype(jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_ids_packed_in_payload_are_exact(dtype):
    """Every id < num_ids survives the trip through the payload dtype, also summed with zeros
    (the "allreduce" variant), next to random latent values."""
    for num_ids in (16, 896, 70_000):
        ids = jnp.concatenate([jnp.arange(num_ids, dtype=jnp.int32),
                               jnp.zeros((-num_ids) % 4, jnp.int32)]).reshape(-1, 4)
        z = jax.random.normal(jax.random.key(num_ids), (ids.shape[0], 8), dtype)
        rows = moe_parallel._pack(z, ids, num_ids)
        assert rows.dtype == dtype
        for r in (rows, rows + jnp.zeros_like(rows)):
            z2, ids2 = moe_parallel._unpack(r, 8, 4, num_ids)
            np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
            np.testing.assert_array_equal(np.asarray(z2, np.float32), np.asarray(z, np.float32))


def test_ragged_lowers_unchanged():
    """The real ragged_all_to_all path lowers (it runs on GPU only)."""
    mesh = sharding.make_mesh("ep=8")
    experts = jax.device_put(experts_for("bf16", jax.random.key(0)), jax.NamedSharding(mesh, jax.P("expert")))
    z, ids, w = jnp.ones((8, M)), jnp.zeros((8, K), jnp.int32), jnp.ones((8, K))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant="ragged", **ACT)).lower(
            z, ids, w, experts).as_text()
    assert "ragged_all_to_all" in text or "ragged-all-to-all" in text


def test_variant_choice_and_errors():
    assert moe_parallel.resolve_variant("auto", 8, "cpu") == "a2a"
    assert moe_parallel.resolve_variant("auto", 10_000, "gpu") == "ragged"
    assert moe_parallel.resolve_variant("auto", 8, "gpu") == "packed"
    assert moe_parallel.resolve_variant("allgather", 8, "cpu") == "allgather"
    with pytest.raises(ValueError, match="unknown expert-parallel variant"):
        moe_parallel.resolve_variant("nccl", 8)
    mesh = sharding.make_mesh("ep=8")
    bad = ops.ExpertWeights(*(jnp.zeros((12,) + s) for s in ((I, M), (I, M), (M, I))))
    with pytest.raises(ValueError, match="12 experts do not split"):
        moe_parallel.moe_experts(jnp.ones((8, M)), jnp.zeros((8, K), jnp.int32), jnp.ones((8, K)), bad,
                                 mesh=mesh, **ACT)
