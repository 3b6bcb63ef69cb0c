"""Meshes, partition rules and sharded models on 8 fake CPU devices.

A sharded tiny model must give the single-device logits (float32 rounding) for prefill and decode
steps. CI checks pure expert parallel and all three axes combined; K3JAX_MESH_SWEEP=1 checks all
18 meshes that divide the tiny preset on 8 devices (~13 min on 2 cores; all pass).
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k3jax
from k3jax import sharding
from k3jax.cache import init_state
from k3jax.presets import get_preset
from k3jax.weights import abstract_model


def test_parse_and_format():
    assert sharding.parse_mesh("ep=2,tp=2") == {"data": 1, "expert": 2, "tensor": 2}
    assert sharding.parse_mesh("data=2, expert=4") == {"data": 2, "expert": 4, "tensor": 1}
    mesh = sharding.make_mesh("dp=2,ep=2,tp=2")
    assert mesh.axis_names == ("data", "expert", "tensor") and mesh.size == 8
    assert sharding.format_mesh(mesh) == "dp=2,ep=2,tp=2"
    for bad, msg in (("ep", "NAME=SIZE"), ("xp=2", "NAME=SIZE"), ("ep=two", "integer"), ("ep=0", ">= 1"),
                     ("ep=2,ep=4", "twice"), ("ep=16", "needs 16 devices")):
        with pytest.raises(sharding.MeshError, match=msg):
            sharding.make_mesh(bad)


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny", "k3-h200x2", "kimi-linear-48b"])
def test_every_parameter_has_a_rule(preset):
    mesh = sharding.make_mesh("ep=2,tp=4")
    state = nnx.state(abstract_model(get_preset(preset)))
    specs = sharding.param_shardings(state, mesh)
    leaves = jax.tree_util.tree_leaves_with_path(specs)
    by_path = {sharding.param_path(p): s.spec for p, s in leaves}
    experts = [s for p, s in by_path.items() if ".experts." in p]
    assert experts and all(s[0] == ("expert", "tensor") for s in experts)     # no expert weight held twice
    assert any(s == jax.P("tensor", None) for p, s in by_path.items() if p.endswith("q_proj.weight"))
    assert any(s == jax.P(None, "tensor") for p, s in by_path.items() if p.endswith("o_proj.weight"))


def test_h200x2_fits_two_gpus_expert_parallel():
    cfg = get_preset("k3-h200x2")
    total = k3jax.weights.param_bytes(cfg)
    per_gpu = sharding.per_device_param_bytes(cfg, jnp.bfloat16, sharding.make_mesh("ep=2"))
    assert total > 150e9 and per_gpu < 120e9      # does not fit one H200; half the experts each does
    per_gpu_tp = sharding.per_device_param_bytes(cfg, jnp.bfloat16, sharding.make_mesh("tp=2"))
    assert per_gpu_tp < 0.6 * total               # tp=2: dense weights split too, experts still halved


def test_unknown_parameter_is_an_error():
    with pytest.raises(sharding.MeshError, match="no partition rule"):
        sharding.param_spec("layers.1.block_sparse_moe.new_thing", (4,), sharding.make_mesh("ep=2"))


def test_state_specs():
    cfg = get_preset("k3-tiny")
    mesh = sharding.make_mesh("dp=2,ep=2,tp=2")
    specs = sharding.state_specs(init_state(cfg, 4, 8), mesh)
    kinds = cfg.layer_kinds
    assert specs.lengths == jax.P(("data", "expert"))
    kda = specs.layers[kinds.index("kda")]
    assert kda.recurrent == jax.P(("data", "expert"), "tensor", None, None)
    assert specs.layers[kinds.index("mla")].latent == jax.P(("data", "expert"), None, None)
    # Batch 2 splits over data only; batch 1 is replicated.
    assert sharding.state_specs(init_state(cfg, 2, 8), mesh).lengths == jax.P("data")
    assert sharding.state_specs(init_state(cfg, 1, 8), mesh).lengths == jax.P(None)


def _prefill_and_decode(graphdef):
    """(params, ids) -> logits of the prefill and of two decode steps: a jitted prefill and one
    jitted step called twice, as generate runs them (a third of the compile time of one jit
    holding all three forwards: ep=8 27 -> 17 s)."""
    @jax.jit
    def prefill(params, ids):
        model = nnx.merge(graphdef, params)
        state = sharding.constrain_state(init_state(model.cfg, ids.shape[0], ids.shape[1] + 2, model.dtype))
        return model.forward(ids, state)

    @jax.jit
    def step(params, tokens, state):
        return nnx.merge(graphdef, params).forward(tokens, sharding.constrain_state(state))

    def run(params, ids):
        logits, state = prefill(params, ids)
        step1, state = step(params, ids[:, -1:], state)
        step2, _ = step(params, ids[:, :1], state)
        return logits, step1, step2
    return run


@pytest.fixture(scope="module")
def reference(tiny_model):
    model = tiny_model("k3-tiny")
    graphdef, params = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (4, 5), 0, model.cfg.vocab_size)
    fn = _prefill_and_decode(graphdef)
    return fn, params, ids, [np.asarray(x) for x in fn(params, ids)]


def dividing_meshes():
    """(dp, ep, tp) with dp*ep*tp dividing 8, ep | 16 experts, tp | 4 heads; not all 1."""
    out = []
    for dp, ep, tp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4)):
        if 8 % (dp * ep * tp) == 0 and dp * ep * tp > 1:
            out.append(sharding.format_mesh({"data": dp, "expert": ep, "tensor": tp}))
    return out


CI_MESHES = ["ep=8", "dp=2,ep=2,tp=2", "tp=2"]     # tp=2: two GPUs vLLM-style (dense TP, experts split)
MESHES = dividing_meshes() if os.environ.get("K3JAX_MESH_SWEEP") == "1" else CI_MESHES


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_model_matches_single_device(reference, spec):
    fn, params, ids, want = reference
    mesh = sharding.make_mesh(spec)
    sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
    with jax.set_mesh(mesh):
        got = fn(sharded, jax.device_put(ids, sharding.batch_sharding(mesh, ids.shape)))
    for name, g, w in zip(("prefill", "decode 1", "decode 2"), got, want):
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=2e-6 * scale, err_msg=f"{spec} {name}")


@pytest.mark.slow
def test_from_pretrained_mesh_creates_sharded_and_generates_same_tokens():
    """Sharded creation (jit with out_shardings) gives the unsharded weights; generate() on the
    mesh (state sharded, expert dispatch a2a on CPU) gives the single-device tokens."""
    mesh = sharding.make_mesh("ep=4,tp=2")
    model = k3jax.from_pretrained("kimi-linear-tiny", dtype="float32", mesh=mesh)
    single = k3jax.from_pretrained("kimi-linear-tiny", dtype="float32")
    assert sharding.model_mesh(model) is mesh and sharding.model_mesh(single) is None
    state = nnx.state(model)
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        want = sharding.param_spec(sharding.param_path(path), x.shape, mesh)
        assert x.sharding.spec == want, sharding.param_path(path)
    experts = state["layers"][1]["block_sparse_moe"]["experts"]["w1"][...]
    assert experts.addressable_shards[0].data.shape[0] == experts.shape[0] // 8     # over ep x tp
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(single))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    want = k3jax.generate(single, prompts, 4)
    np.testing.assert_array_equal(k3jax.generate(model, prompts, 4), want)
    sharding.set_ep_variant(model, "allgather")
    assert {m.ep_variant for _, m in nnx.iter_graph(model) if hasattr(m, "ep_variant")} == {"allgather"}
    with pytest.raises(ValueError, match="unknown expert-parallel variant"):
        sharding.set_ep_variant(model, "nccl")


def test_checkpoint_streams_onto_mesh():
    """from_pretrained(dir, mesh=) places each tensor in its shards and matches the unsharded model."""
    import numpy as np

    import k3jax
    from k3jax.sharding import param_spec

    single = k3jax.from_pretrained("checkpoints/k3-tiny", dtype="float32")
    sharded = k3jax.from_pretrained("checkpoints/k3-tiny", dtype="float32", mesh="ep=8")
    experts = sharded.layers[1].block_sparse_moe.experts.w1_packed[...]
    assert experts.sharding.spec == param_spec("layers.1.block_sparse_moe.experts.w1_packed", experts.shape,
                                               experts.sharding.mesh)
    assert len(experts.sharding.device_set) == 8
    ids = np.arange(1, 9)[None]
    np.testing.assert_allclose(np.asarray(sharded(ids)), np.asarray(single(ids)), rtol=1e-5, atol=1e-5)


def test_experts_in_tiles_shard_over_the_expert_axis():
    """expert_layout="tiles" on an ep=2 mesh: the tiled arrays shard on the expert axis and the
    model decodes the same tokens as the unsharded row-order model (the same weights)."""
    kw = dict(dtype="float32", seed=0, moe_intermediate_size=128, routed_expert_hidden_size=128)
    rows = k3jax.from_pretrained("k3-tiny", **kw)
    tiles = k3jax.from_pretrained("k3-tiny", expert_layout="tiles", mesh="ep=2", **kw)
    w = tiles.layers[1].block_sparse_moe.experts.w1_packed[...]
    assert w.sharding.spec[0] == "expert"
    ids = jnp.array([[1, 2, 3, 4]])
    np.testing.assert_allclose(np.asarray(tiles(ids)), np.asarray(rows(ids)), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(k3jax.generate(tiles, [[1, 2, 3]], 6)),
                                  np.asarray(k3jax.generate(rows, [[1, 2, 3]], 6)))
