"""The device-initiated expert dispatch (pallas_kernels.ep_dispatch, moe_parallel variant "device").

jax 0.11.2's Mosaic GPU interpreter implements neither semaphores nor peer refs, so on CPU:
- the variant's bookkeeping (packing, column padding, the per-rank experts, the exact combine)
  runs with `ep_dispatch.exchange` replaced by an emulation of its documented contract built on
  all_gather / all_to_all, against ops.moe_experts and bit for bit against "packed";
- the real kernels are lowered for CUDA (`mgpu.compile_for_gpu()`), at K3 shapes too;
- without a GPU the variant says why it cannot run.
The kernels themselves run in the `gpu` tests (2 GPUs: K3JAX_GPU_TESTS=1) and in
benchmarks/expert_parallel.py, which checks every variant against one device.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import moe_parallel, ops, sharding
from pallas_kernels import ep_dispatch, mgpu
from test_expert_parallel import ACT, E, K, M, experts_for, routing


def emulated_exchange(x, axis, *, all_to_all=False, reply_like=None, num_blocks=None):
    """`exchange`'s contract from XLA collectives (CPU stand-in, and the GPU tests' reference);
    the Pending it returns for `reply_like` holds NaN (the reply must write every row)."""
    out = jax.lax.all_to_all(x, axis, 0, 0, tiled=True) if all_to_all else jax.lax.all_gather(x, axis)
    if reply_like is None:
        return out
    return out, ep_dispatch.Pending(jnp.full(reply_like.shape, jnp.nan, reply_like.dtype),
                                    jnp.zeros((ep_dispatch.FLAGS,), jnp.int32))


def emulated_reply(y, pending, axis, *, num_blocks=None):
    assert y.shape == pending.buf.shape and y.dtype == pending.buf.dtype, (y.shape, pending.buf.shape)
    return jax.lax.all_to_all(y, axis, 0, 0, tiled=True)


@pytest.fixture
def emulate_exchange(monkeypatch):
    def aligned(x, axis, **kw):
        # The variant pads the dispatch rows to the kernel's tile width itself, where XLA fuses
        # the zeros into the packing (exchange would pad them in a separate copy).
        assert kw.get("all_to_all") or x.shape[-1] % ep_dispatch.COL_TILE == 0, x.shape
        return emulated_exchange(x, axis, **kw)
    monkeypatch.setattr(ep_dispatch, "exchange", aligned)
    monkeypatch.setattr(ep_dispatch, "reply", emulated_reply)


def run(mesh_spec, variant, z, ids, w, experts):
    mesh = sharding.make_mesh(mesh_spec)
    experts = jax.device_put(experts, jax.NamedSharding(mesh, jax.P("expert")))
    with jax.set_mesh(mesh):
        return jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant=variant, **ACT))(z, ids, w, experts)


CASES = [  # (mesh, routing, tokens, expert format[, experts])
    ("ep=8", "random", 16, "bf16"),
    ("ep=2", "random", 1, "bf16"),
    ("dp=2,ep=4", "one_expert", 3, "mxfp4"),
    ("ep=2,tp=2", "one_rank", 5, "bf16"),
    ("ep=2", "one_expert", 20, "mxfp4", 256),    # 80 rows per rank in 64-row calls
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_device_variant_exact(case, dtype, emulate_exchange):
    mesh_spec, route_kind, n, fmt, e = case + (E,) * (5 - len(case))
    kz, ki, kw, ke = jax.random.split(jax.random.key(n * 11 + len(route_kind)), 4)
    experts = experts_for(fmt, ke, e)
    z = jax.random.normal(kz, (n, M), dtype)
    ids = routing(route_kind, n, ki, e)
    w = jax.random.uniform(kw, (n, K), jnp.float32, 0.1, 1.0)
    got = run(mesh_spec, "device", z, ids, w, experts)
    want = ops.moe_experts(z, ids, w, experts, **ACT)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool(jnp.all(jnp.isfinite(got)))
    # The same per-slot rows and the same float32 combine as "packed": equal bit for bit.
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(run(mesh_spec, "packed", z, ids, w, experts), np.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2 ** -7    # bf16: per-rank expert calls round differently
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0,
                               atol=tol * float(jnp.abs(want.astype(jnp.float32)).max()))


def _shard(fn, mesh, n_in):
    return jax.shard_map(fn, mesh=mesh, in_specs=(jax.P("expert"),) * n_in, out_specs=jax.P("expert"),
                         check_vma=False)


def _kernel_configs(text: str) -> list[str]:
    return re.findall(r"uses_xla_collective_metadata = (\w+)", text)


@pytest.mark.parametrize("rows,width,a2a", [(1, 3616, False), (4, 3616, False), (32, 3616, False),
                                            (16, 3584, True), (64, 3584, True), (512, 3584, True),
                                            (3, 40, False)])
def test_exchange_lowers_for_cuda(rows, width, a2a):
    """K3 shapes (1, 8 and 64 tokens on ep=2: dispatch rows [n, 3584 + 32 id digits], combine
    rows [n * 16, 3584]) and an unaligned one: one Mosaic GPU kernel using XLA's collective
    metadata (peer addresses) on the mesh's devices."""
    mesh = sharding.make_mesh("ep=2")
    shape = (2 * 2, rows, width) if a2a else (2 * rows, width)
    with mgpu.compile_for_gpu():
        fn = _shard(lambda x: ep_dispatch.exchange(x, "expert", all_to_all=a2a), mesh, 1)
        text = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            jax.ShapeDtypeStruct(shape, jnp.bfloat16)).mlir_module()
    assert _kernel_configs(text) == ["true"]
    assert 'xla_replica_ids = "0,1"' in text


@pytest.mark.parametrize("rows,width,back", [(1, 3616, (16, 3584)), (32, 3616, (512, 3584)), (3, 40, (5, 200))])
def test_exchange_and_reply_lower_for_cuda(rows, width, back):
    """exchange(reply_like=) + reply: the reply kernel skips XLA's device barrier and writes in
    place into the exchange's buffers (both aliased through to its outputs)."""
    mesh = sharding.make_mesh("ep=2")

    def fn(x, y):
        out, pending = ep_dispatch.exchange(x, "expert", reply_like=jax.ShapeDtypeStruct(y.shape, y.dtype))
        return out, ep_dispatch.reply(y, pending, "expert")
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(jax.P("expert"),) * 2, out_specs=(jax.P("expert"),) * 2,
                       check_vma=False)
    with mgpu.compile_for_gpu():
        text = jax.export.export(jax.jit(sm), platforms=["cuda"])(
            jax.ShapeDtypeStruct((2 * rows, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((2 * 2, *back), jnp.bfloat16)).mlir_module()
    assert _kernel_configs(text) == ["true", "true"]
    assert re.findall(r"skip_device_barrier = (\w+)", text) == ["false", "true"]
    reply_call = text[text.index("skip_device_barrier = true"):]
    assert "operand_index = 1" in reply_call and "operand_index = 2" in reply_call


def test_device_variant_lowers_for_cuda():
    """The whole variant on dp=2,ep=2,tp=2 (peers addressed by mesh coordinates): two kernels."""
    mesh = sharding.make_mesh("dp=2,ep=2,tp=2")
    experts = experts_for("mxfp4", jax.random.key(0))
    sharded = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                          sharding=jax.NamedSharding(mesh, jax.P("expert"))), experts)
    avals = (jax.ShapeDtypeStruct((8, M), jnp.bfloat16), jax.ShapeDtypeStruct((8, K), jnp.int32),
             jax.ShapeDtypeStruct((8, K), jnp.float32))
    with jax.set_mesh(mesh), mgpu.compile_for_gpu():
        text = jax.export.export(jax.jit(lambda *a: moe_parallel.moe_experts(*a, variant="device", **ACT)),
                                 platforms=["cuda"])(*avals, sharded).mlir_module()
    assert _kernel_configs(text) == ["true", "true"]
    assert 'xla_replica_ids = "0,1,2,3,4,5,6,7"' in text


def test_unavailable_without_gpu():
    why = moe_parallel.unavailable("device", "cpu")
    assert why and "needs a CUDA GPU" in why and "semaphores" in why
    assert moe_parallel.resolve_variant("auto", 8, "gpu") == "packed"     # never chosen by auto
    experts = experts_for("bf16", jax.random.key(1))
    z, ids, w = jnp.ones((2, M)), jnp.zeros((2, K), jnp.int32), jnp.ones((2, K))
    with pytest.raises(ep_dispatch.DeviceDispatchUnavailable, match="needs a CUDA GPU"):
        run("ep=2", "device", z, ids, w, experts)


def test_exchange_shape_errors():
    mesh = sharding.make_mesh("ep=2")
    with mgpu.compile_for_gpu():
        with pytest.raises(ValueError, match=r"all_to_all exchange takes x \[ep=2, R, W\]"):
            jax.eval_shape(_shard(lambda x: ep_dispatch.exchange(x, "expert", all_to_all=True), mesh, 1),
                           jax.ShapeDtypeStruct((4, 128), jnp.bfloat16))
        with pytest.raises(ValueError, match=r"broadcast exchange takes x \[R, W\]"):
            jax.eval_shape(_shard(lambda x: ep_dispatch.exchange(x, "expert"), mesh, 1),
                           jax.ShapeDtypeStruct((4, 2, 128), jnp.bfloat16))

        def wrong_reply(x):
            _, pending = ep_dispatch.exchange(x, "expert", reply_like=jax.ShapeDtypeStruct((2, 4, 128), x.dtype))
            return ep_dispatch.reply(jnp.zeros((2, 4, 128), jnp.float32), pending, "expert")
        with pytest.raises(ValueError, match=r"reply of \(2, 4, 128\) float32 .* made for \(2, 4, 128\) bfloat16"):
            jax.eval_shape(_shard(wrong_reply, mesh, 1), jax.ShapeDtypeStruct((4, 128), jnp.bfloat16))


def _two_gpus():
    if sum(d.platform == "gpu" for d in jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    return sharding.make_mesh("ep=2")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,a2a", [(1, 3616, False), (3, 200, False), (300, 256, False),
                                            (16, 3584, True), (512, 3584, True)])
def test_exchange_on_gpus(rows, width, a2a):
    """The kernels against XLA's all_gather / all_to_all, bit for bit, on random data."""
    mesh = _two_gpus()
    shape = (4, rows, width) if a2a else (2 * rows, width)
    x = jax.device_put(jax.random.normal(jax.random.key(rows), shape, jnp.bfloat16),
                       jax.NamedSharding(mesh, jax.P("expert")))
    got = jax.jit(_shard(lambda x: ep_dispatch.exchange(x, "expert", all_to_all=a2a), mesh, 1))(x)
    want = jax.jit(_shard(lambda x: emulated_exchange(x, "expert", all_to_all=a2a), mesh, 1))(x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width,back", [(1, 3616, (16, 3584)), (3, 200, (5, 200)), (32, 3616, (512, 3584))])
def test_exchange_and_reply_on_gpus(rows, width, back):
    """exchange(reply_like=) then reply, chained 8 times in a loop (the reply's counters and
    buffer must be fresh each time), against XLA's collectives bit for bit."""
    mesh = _two_gpus()
    kx, ky = jax.random.split(jax.random.key(rows))
    x = jax.device_put(jax.random.normal(kx, (2 * rows, width), jnp.bfloat16), jax.NamedSharding(mesh, jax.P("expert")))
    y = jax.device_put(jax.random.normal(ky, (4, *back), jnp.bfloat16), jax.NamedSharding(mesh, jax.P("expert")))

    def chain(exchange, reply):
        def fn(x, y):
            def body(i, carry):
                x, y = carry
                out, pending = exchange(x, "expert", reply_like=jax.ShapeDtypeStruct(y.shape, y.dtype))
                got = reply(y, pending, "expert")
                return out[(i + 1) % 2], got[::-1] + out[0, :1, :1].astype(y.dtype)
            return jax.lax.fori_loop(0, 8, body, (x, y))
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(jax.P("expert"),) * 2,
                                     out_specs=(jax.P("expert"),) * 2, check_vma=False))
    got = chain(ep_dispatch.exchange, ep_dispatch.reply)(x, y)
    want = chain(emulated_exchange, emulated_reply)(x, y)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_device_variant_on_gpus(n):
    """K3 dispatch shapes (E = 896, k = 16, latent 3584 bf16) with identity experts: equal to "packed"."""
    mesh = _two_gpus()
    e, k, m = 896, 16, 3584
    kz, ki = jax.random.split(jax.random.key(n))
    z = jax.random.normal(kz, (n, m), jnp.bfloat16)
    ids = jax.random.permutation(ki, e)[:k][None].repeat(n, 0).astype(jnp.int32)
    w = jax.random.uniform(ki, (n, k), jnp.float32, 0.1, 1.0)
    experts = jax.device_put(ops.ExpertWeights(*(jnp.zeros((e, 1, 1), jnp.bfloat16) for _ in range(3))),
                             jax.NamedSharding(mesh, jax.P("expert")))
    ident = lambda rows, local_ids, valid, ex: rows  # noqa: E731
    with jax.set_mesh(mesh):
        got, want = (jax.jit(lambda *a, v=v: moe_parallel.moe_experts(*a, variant=v, expert_fn=ident, **ACT))(
            z, ids, w, experts) for v in ("device", "packed"))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
