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


def experts_for(fmt: str, key, e: int = E) -> ops.ExpertWeights:
    k1, k2, k3 = jax.random.split(key, 3)
    shapes = ((e, I, M), (e, I, M), (e, M, I))
    if fmt == "mxfp4":
        (p1, s1), (p3, s3), (p2, s2) = (mxfp4.random_packed(k, s) for k, s in zip((k1, k2, k3), shapes))
        return ops.ExpertWeights(p1, p3, p2, s1, s3, s2)
    return ops.ExpertWeights(*(jax.random.normal(k, s, jnp.float32) * 0.3 for k, s in zip((k1, k2, k3), shapes)))


def routing(kind: str, n: int, key, e: int = E):
    if kind == "random":
        return jax.random.randint(key, (n, K), 0, e)
    if kind == "one_expert":         # every (token, slot) pair to expert 5 (duplicate slots too)
        return jnp.full((n, K), 5, jnp.int32)
    if kind == "one_rank":           # every token to the last rank's experts, distinct per slot
        return jnp.broadcast_to(jnp.arange(e - K, e, dtype=jnp.int32), (n, K))
    raise ValueError(kind)


def run_ep(mesh_spec, variant, z, ids, w, experts):
    """The experts in their parameter layout: over "expert", and "tensor" where it divides them."""
    mesh = sharding.make_mesh(mesh_spec)
    axes = moe_parallel.expert_axes(experts.num_experts, mesh)
    experts = jax.device_put(experts, jax.NamedSharding(mesh, jax.P(axes or None)))
    with jax.set_mesh(mesh):
        return jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant=variant, **ACT))(z, ids, w, experts)


CASES = [  # (mesh, variant, routing, tokens, expert format[, experts])
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
    # Experts over "tensor" too (tp ranks share an expert group's tokens and psum their rows);
    # tp alone: no dispatch at all, only that sum.
    ("tp=2", "a2a", "random", 3, "mxfp4"),
    ("tp=4", "packed", "one_expert", 1, "bf16"),
    ("dp=2,tp=4", "allgather", "random", 5, "bf16"),
    ("ep=2,tp=4", "a2a_packed", "one_rank", 4, "mxfp4"),
    ("tp=2", "a2a", "random", 3, "bf16", 5),     # 5 experts do not split: one local call
    ("ep=8", "a2a_packed", "random", 16, "mxfp4"),
    ("dp=2,ep=4", "a2a_packed", "one_rank", 5, "bf16"),
    ("ep=8", "allreduce", "random", 16, "bf16"),
    ("dp=2,ep=4", "allreduce", "one_expert", 5, "bf16"),
    ("ep=4", "allreduce", "one_rank", 8, "mxfp4"),
    # 80 rows per rank, 128 experts per rank: its own rows run in 64-row calls (more in SPY_CASES).
    ("ep=2", "a2a_packed", "one_expert", 20, "mxfp4", 256),
    ("ep=2", "allreduce", "one_rank", 20, "bf16", 256),
]


def test_experts_split_over_expert_and_tensor_axes():
    assert moe_parallel.expert_axes(16, sharding.make_mesh("ep=2,tp=4")) == ("expert", "tensor")
    assert moe_parallel.expert_axes(16, sharding.make_mesh("tp=2")) == ("tensor",)
    assert moe_parallel.expert_axes(6, sharding.make_mesh("ep=2,tp=4")) == ("expert",)     # 4 does not divide 3
    assert moe_parallel.expert_axes(5, sharding.make_mesh("tp=2")) == ()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_dispatch_combine_exact(case, emulate_ragged):
    mesh_spec, variant, route_kind, n, fmt, e = case + (E,) * (6 - len(case))
    kz, ki, kw, ke = jax.random.split(jax.random.key(n * 7 + len(route_kind)), 4)
    experts = experts_for(fmt, ke, e)
    z = jax.random.normal(kz, (n, M), jnp.float32)
    ids = routing(route_kind, n, ki, e)
    w = jax.random.uniform(kw, (n, K), jnp.float32, 0.1, 1.0)
    want = ops.moe_experts(z, ids, w, experts, **ACT)
    got = run_ep(mesh_spec, variant, z, ids, w, experts)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got)))
    # Same per-row expert math and the same float32 combine: float32 rounding at most.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


SPY_CASES = [  # (mesh, variant, routing, tokens, experts): padding, 64-row calls, ranks owning nothing
    ("ep=4", "a2a", "random", 7, E),
    ("ep=2", "a2a_packed", "random", 20, 256),
    ("dp=2,ep=2", "ragged", "one_rank", 37, 256),
    ("ep=2", "allgather", "random", 1, E),
    ("dp=2,ep=2", "packed", "random", 37, 256),
    ("ep=4", "allreduce", "one_expert", 5, E),
    ("ep=2", "packed", "one_rank", 24, 256),
    ("ep=2", "allgather", "random", 20, E),      # 80 rows > E/ep experts: one call
]


@pytest.mark.parametrize("mesh_spec,variant,route_kind,n,e", SPY_CASES)
def test_each_rank_touches_only_its_selected_experts(mesh_spec, variant, route_kind, n, e, emulate_ragged):
    """Every local expert call on a rank: at most ROW_CHUNK rows; its distinct ids are exactly the
    ids of its non-zero-weight rows (or the one id 0 when it has none), and over all calls those
    are the experts this rank owns that its group's tokens select; nothing else is gathered."""
    mesh = sharding.make_mesh(mesh_spec)
    dp, ep = mesh.shape.get("data", 1), mesh.shape["expert"]
    calls = []

    def record(g, r, ids, w):
        calls.append((int(g), int(r), np.asarray(ids), np.asarray(w)))

    def spy(z, ids, w, experts, **kw):
        g = jax.lax.axis_index("data") if dp > 1 else 0
        jax.debug.callback(record, g, jax.lax.axis_index("expert"), ids, w)
        return ops.moe_experts(z, ids, w, experts, **kw)

    ki, kw, kz = jax.random.split(jax.random.key(n), 3)
    ids = routing(route_kind, n, ki, e)
    w = jax.random.uniform(kw, (n, K), jnp.float32, 0.1, 1.0)
    z = jax.random.normal(kz, (n, M), jnp.float32)
    experts = experts_for("bf16", jax.random.key(1), e)
    want = ops.moe_experts(z, ids, w, experts, **ACT)
    sharded = jax.device_put(experts, jax.NamedSharding(mesh, jax.P("expert")))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant=variant, local_impl=spy, **ACT))(
            z, ids, w, sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    e_local, group = e // ep, -(-n // (dp * ep)) * ep           # experts per rank, tokens per group
    used = {}
    for g, r, c_ids, c_w in calls:
        # 64-row calls up to as many rows as the rank has experts; one call above
        assert c_ids.shape[0] <= moe_parallel.ROW_CHUNK or c_ids.shape[0] > e_local
        live = set(c_ids[c_w[:, 0] != 0, 0].tolist())
        assert set(c_ids[:, 0].tolist()) == (live or {0})
        used.setdefault((g, r), set()).update(live)
    for g in range(dp):
        sel = np.asarray(ids[g * group:(g + 1) * group]).reshape(-1)
        for r in range(ep):
            assert used.get((g, r), set()) == set((sel[sel // e_local == r] % e_local).tolist()), (g, r)
    if e == 256:  # 80-96 rows on a rank with 128 experts: all calls are 64-row chunks
        assert {c[2].shape[0] for c in calls} == {moe_parallel.ROW_CHUNK}
    if variant in moe_parallel.GATHERED and n * K <= moe_parallel.ROW_CHUNK:
        # Tokens that are padding in every group are not computed: n * K rows, not ep * n_pad * K.
        assert {c[2].shape[0] for c in calls} == {min(n, group) * K}


@pytest.fixture
def interpret_on_many_devices(monkeypatch):
    """Lets jax's Mosaic GPU interpreter (CPU interpret mode) run under shard_map.

    jax 0.11.2's interpreter keeps one global state for all devices and sizes its device barrier
    to the shard_map's devices, yet two of its steps assume no other device is mid-kernel: at the
    end of a kernel it asserts that no barrier of *any* device is still allocated ("Barrier
    remains allocated at key ... device_id=1"), and at the end of each cluster it resets every
    device's per-cluster state (wgmma accumulator ids: "KeyError: HostAllocationKey(...,
    buffer_id=-100)" on the other device). Devices interpret concurrently, so both trip. Here
    both steps first wait for every device at that same point (the interpreter's own device
    barrier; every device runs the same kernels), and one device resets. Compiled GPU kernels
    do not go through the interpreter.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    assert_free = gc._assert_no_barriers_allocated

    def assert_when_all_done(token):
        gc._get_shared_memory().barrier.wait()
        return assert_free(token)

    def cluster_finished(*, token):
        mem = gc._get_shared_memory()
        if mem.barrier.wait() == 0:
            mem.reset_per_cluster_state()
        mem.barrier.wait()
        return token

    monkeypatch.setattr(gc, "_assert_no_barriers_allocated", assert_when_all_done)
    monkeypatch.setattr(gc, "cluster_finished", gc.fail_on_exception(cluster_finished))


def test_pallas_kernel_is_the_local_impl(interpret_on_many_devices):
    """The Pallas MXFP4 moe_experts kernel (interpret mode, its smallest shapes: M = I = 512) as
    every rank's local_impl of the GPU default variant, with a padding token: it engages (no
    fallback) and gives ops.moe_experts on one device to bf16 rounding (same per-slot math)."""
    from pallas_kernels import registry
    n, e, k, m = 3, 8, 2, 512
    ke, kz, ki, kw = jax.random.split(jax.random.key(5), 4)
    packs = [mxfp4.random_packed(x, s) for x, s in zip(jax.random.split(ke, 3), ((e, m, m),) * 3)]
    experts = ops.ExpertWeights(*(p for p, _ in packs), *(sc for _, sc in packs))
    z = jax.random.normal(kz, (n, m), jnp.bfloat16)
    ids, w = jax.random.randint(ki, (n, k), 0, e), jax.random.uniform(kw, (n, k), jnp.float32, 0.1, 1.0)
    want = ops.moe_experts(z, ids, w, experts, **ACT).astype(jnp.float32)
    mesh = sharding.make_mesh("ep=2")
    sharded = jax.device_put(experts, jax.NamedSharding(mesh, jax.P("expert")))
    registry.clear_fallbacks()
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: moe_parallel.moe_experts(
            *a, variant="packed", local_impl=registry.implementation("moe_experts", "pallas"), **ACT))(
            z, ids, w, sharded).astype(jnp.float32)
    assert "moe_experts/pallas" not in registry.fallbacks()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2 ** -7 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_ep_model_with_pallas_moe_matches(interpret_on_many_devices):
    """k3-small (the smallest K3 the Pallas MoE kernel takes) on ep=2, bf16, one decode step at
    batch 2 with the KernelPlan's Pallas moe_experts inside the expert-parallel shard_map: equal
    to the same mesh with the XLA plan to bf16 rounding, and to the single-device XLA model to
    the sharded bf16 model's own distance (1.2e-2 of the largest logit here, from ranks' batch-1
    dense matmuls rounding differently; the float32 sharded model is checked in test_sharding).
    (The whole Pallas plan on this mesh: same logits, 1.15e-2; ~150 s in interpret mode.)"""
    import k3jax
    from flax import nnx

    from k3jax.backend import KernelPlan
    from k3jax.cache import init_state
    from pallas_kernels import registry
    model = k3jax.from_pretrained("k3-small", dtype="bfloat16")
    ids = jax.random.randint(jax.random.key(1), (2, 3), 0, model.cfg.vocab_size)
    _, state = jax.jit(lambda mdl, i, st: mdl.forward(i, st))(model, ids, init_state(model.cfg, 2, 8, model.dtype))

    def step(graphdef, params, tok, state):
        return nnx.merge(graphdef, params).forward(tok, sharding.constrain_state(state))[0]

    graphdef, params = nnx.split(model)
    single = np.asarray(jax.jit(step, static_argnums=0)(graphdef, params, ids[:, -1:], state), np.float32)
    mesh = sharding.make_mesh("ep=2")
    got = {}
    for name in ("xla", "pallas"):
        model.plan = KernelPlan.for_backend("xla", moe_experts=name)
        graphdef, params = nnx.split(model)
        params = jax.device_put(params, sharding.param_shardings(params, mesh))
        registry.clear_fallbacks()
        with jax.set_mesh(mesh):
            got[name] = np.asarray(jax.jit(step, static_argnums=0)(graphdef, params, ids[:, -1:], state), np.float32)
    assert registry.fallbacks() == {}
    scale = float(np.abs(single).max())
    np.testing.assert_allclose(got["pallas"], got["xla"], rtol=0, atol=2 ** -7 * scale)
    np.testing.assert_allclose(got["pallas"], single, rtol=0, atol=2 ** -5 * scale)
    assert (got["pallas"].argmax(-1) == single.argmax(-1)).all()


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
