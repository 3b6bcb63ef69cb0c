"""Bad API input raises a clear error naming the argument, and the memory pre-check
(weights.check_fits) refuses what cannot fit before anything is allocated (float32 k3-tiny, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax
from k3jax import bench, generation, sharding, weights
from k3jax.cache import state_bytes

PROMPTS = [[5, 17, 3], [9, 8]]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("k3-tiny")


def free_memory(monkeypatch, nbytes: int):
    monkeypatch.setattr(weights, "device_memory_bytes", lambda device=None: nbytes)


# ------------------------------------------------------------------ B2: argument errors
@pytest.mark.parametrize("kwargs, error, match", [
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int, got float 2.5"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": -3}, ValueError, "max_new_tokens must be >= 1"),
    ({"input_ids": "hello"}, TypeError, "input_ids must be .* got str 'hello'"),
    ({"input_ids": ["hello"]}, TypeError, "input_ids must be .*encode text first"),
    ({"input_ids": [1, 2, 3]}, TypeError, r"one prompt is \[\[id, ...\]\]"),
    ({"input_ids": [[1, 2], [[3]]]}, ValueError, "prompt 1 must be a flat list"),
    ({"input_ids": np.arange(3)}, ValueError, r"input_ids must have shape \[batch, seq\]"),
    ({"stop_tokens": object()}, TypeError, "stop_tokens must be a token id or a sequence"),
    ({"stop_tokens": "2"}, TypeError, "stop_tokens must be a token id or a sequence"),
    ({"stop_tokens": [2, 2.5]}, TypeError, "each of stop_tokens must be an int"),
    ({"key": 3}, TypeError, "key must be one jax.random.key.*got int 3.*seed="),
    ({"key": jax.random.split(jax.random.key(0))}, TypeError, "key must be one jax.random.key"),
    ({"seed": "x"}, TypeError, "seed must be an int, got str 'x'"),
    ({"pad_id": 10**6}, ValueError, "pad_id must be a token id below the vocabulary size 512"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ({"temperature": "hot"}, TypeError, "temperature must be a number"),
    ({"temperature": 1e-45}, ValueError, "temperature 1e-45 is below 1e-06.*use 0 for greedy"),
])
def test_generate_bad_arguments(model, kwargs, error, match):
    args = {"input_ids": PROMPTS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        k3jax.generate(model, **args)


def test_generate_with_stats_bad_objects(model):
    with pytest.raises(TypeError, match="sampling must be a k3jax.SamplingParams"):
        k3jax.generate_with_stats(model, PROMPTS, 2, sampling={"temperature": 1.0})
    with pytest.raises(TypeError, match="model must be a k3jax.K3Model"):
        k3jax.generate_with_stats("k3-tiny", PROMPTS, 2)


def test_stop_tokens_and_keys_accepted_forms():
    assert generation._stop_ids(2) == (2,)
    assert generation._stop_ids(np.int64(2)) == (2,)
    assert generation._stop_ids([2, np.int32(7)]) == (2, 7)
    assert generation._stop_ids(np.array([3, 4])) == (3, 4)
    assert generation._stop_ids(t for t in (5,)) == (5,)
    assert generation._check_key(jax.random.key(1)).shape == ()
    assert generation._check_key(jax.random.PRNGKey(1)).shape == (2,)


def test_forward_bad_state_or_tokens(model):
    cfg = model.cfg
    with pytest.raises(ValueError, match="state holds 3 sequences .* tokens has batch size 2"):
        model.forward(jnp.ones((2, 1), jnp.int32), k3jax.init_state(cfg, 3, 8))
    with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, seq\], got int32\[2\]"):
        model.forward(jnp.ones((2,), jnp.int32), k3jax.init_state(cfg, 2, 8))
    with pytest.raises(ValueError, match="tokens must be an integer array .* got float32"):
        model.forward(jnp.ones((2, 1)), k3jax.init_state(cfg, 2, 8))
    with pytest.raises(TypeError, match="state must be a k3jax.DecodeState"):
        model.forward(jnp.ones((2, 1), jnp.int32), None)
    with pytest.raises(ValueError, match=r"num_new must have shape \[2\]"):
        model.forward(jnp.ones((2, 1), jnp.int32), k3jax.init_state(cfg, 2, 8), jnp.ones((3,), jnp.int32))


def test_forward_refuses_a_state_or_plan_of_another_config(model):
    """A state from another config (e.g. init_state(get_preset(...)) after from_pretrained(...,
    kv_lora_rank=...)) is named layer by layer, not a broadcasting error deep in the layers; a
    plan that is not a KernelPlan is named too; num_new must hold integers (2.7 was truncated)."""
    import dataclasses
    cfg, dt, ids = model.cfg, model.dtype, jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"layer 3 \(MLA\) latent is \[1, 64, 24\], the config needs \[1, 64, 40\]"):
        model.forward(ids, k3jax.init_state(dataclasses.replace(cfg, kv_lora_rank=16), 1, 8, dt))
    with pytest.raises(ValueError, match=r"layer 0 \(KDA\) conv is"):
        model.forward(ids, k3jax.init_state(dataclasses.replace(cfg, kda_num_heads=2), 1, 8, dt))
    state = k3jax.init_state(cfg, 1, 8, dt)
    swapped = dataclasses.replace(state, layers=(state.layers[3], *state.layers[1:3], state.layers[0], *state.layers[4:]))
    with pytest.raises(ValueError, match="layer 0 is KDA in the config but the state holds a MLAState"):
        model.forward(ids, swapped)
    for counts in (jnp.array([1.7]), jnp.array([True])):
        with pytest.raises(ValueError, match="num_new must hold integer counts"):
            model.forward(ids, state, counts)
    plan = model.plan
    try:
        model.plan = "pallas"
        with pytest.raises(TypeError, match="model.plan must be a KernelPlan, got str 'pallas'"):
            model.forward(ids, state)
    finally:
        model.plan = plan


def test_init_state_checks_its_arguments(model):
    cfg = model.cfg
    for batch, max_len in ((0, 8), (1, -5), (1.5, 8), (True, 8)):
        with pytest.raises(ValueError, match="init_state: (batch_size|max_len) must be an integer >= 1"):
            k3jax.init_state(cfg, batch, max_len)
    with pytest.raises(TypeError, match="init_state takes a K3Config .model.cfg., got K3Model"):
        k3jax.init_state(model, 1, 8)
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        k3jax.init_state(cfg, 1, 8, "half")
    assert k3jax.init_state(cfg, 1, 8, "bf16").layers[0].conv.dtype == jnp.bfloat16


def test_forward_checks_values_it_can_see(model):
    """Concrete (not traced) arguments: ids in the vocabulary, 0 <= num_new <= T, cached + new tokens
    within the MLA cache (a larger T used to run past it silently), the model's cache dtype."""
    cfg, dt = model.cfg, model.dtype
    state = k3jax.init_state(cfg, 1, 8, dt)
    with pytest.raises(ValueError, match=r"100 new token\(s\) after 0 cached exceed the state's MLA cache of 64"):
        model.forward(jnp.ones((1, 100), jnp.int32), state)
    with pytest.raises(ValueError, match="tokens has 2 id.s. outside the vocabulary"):
        model.forward(jnp.full((1, 2), cfg.vocab_size, jnp.int32), state)
    with pytest.raises(ValueError, match=r"num_new must be within \[0, 2\]"):
        model.forward(jnp.ones((1, 2), jnp.int32), state, jnp.array([3]))
    other = jnp.float32 if jnp.dtype(dt) == jnp.bfloat16 else jnp.bfloat16
    with pytest.raises(ValueError, match="state caches are .* but the model computes in"):
        model.forward(jnp.ones((1, 2), jnp.int32), k3jax.init_state(cfg, 1, 8, other))
    _, state = model.forward(jnp.ones((1, 60), jnp.int32), state)
    with pytest.raises(ValueError, match=r"5 new token\(s\) after 60 cached"):
        model.forward(jnp.ones((1, 5), jnp.int32), state)


def test_from_pretrained_bad_arguments():
    with pytest.raises(TypeError, match="seed must be an int, got str 'x'"):
        k3jax.from_pretrained("k3-tiny", seed="x")
    with pytest.raises(TypeError, match="path_or_preset must be a preset name or a checkpoint directory"):
        k3jax.from_pretrained(3)


# ------------------------------------------------------------------ C9: one token-id check
def test_pad_prompts_uses_the_model_token_check():
    ids, lengths = generation.pad_prompts([np.array([1, 2, 3], np.int16), (4,)], 512, pad_id=9)
    np.testing.assert_array_equal(ids, [[1, 2, 3], [4, 9, 9]])
    assert ids.dtype == np.int32 and lengths.tolist() == [3, 1]
    ids, lengths = generation.pad_prompts(np.array([[1, 2]]), 512)
    assert ids.tolist() == [[1, 2]] and lengths.tolist() == [2]
    # The messages of model.check_token_ids, for both input forms.
    for bad in ([[1, 2.5]], np.array([[1.0, 2.0]])):
        with pytest.raises(ValueError, match="input_ids must be integers"):
            generation.pad_prompts(bad, 512)
    for bad in ([[1], [2, 512]], np.array([[-1, 2]])):
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
            generation.pad_prompts(bad, 512)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generation.pad_prompts([[1], []], 512)


# ------------------------------------------------------------------ B1 / C5: one memory check
def test_check_fits_counts_params_state_and_activations(model):
    cfg = model.cfg
    f32 = jnp.float32
    params = weights.param_bytes(cfg, f32)
    assert weights.check_fits(cfg, f32) == params
    state = state_bytes(cfg, 8, 64, 4)
    logits = weights.LOGITS_COPIES * 8 * cfg.vocab_size * 4
    assert weights.check_fits(cfg, f32, batch=8, max_len=64) == params + state + logits
    assert weights.check_fits(cfg, f32, batch=8, max_len=64, params=False, activation_bytes=7) == state + 7
    # Under a mesh: one device's parameter shards, the state split over the batch axes.
    mesh = sharding.make_mesh("dp=8")
    assert weights.check_fits(cfg, f32, mesh=mesh) == sharding.per_device_param_bytes(cfg, f32, mesh)
    assert weights.check_fits(cfg, f32, mesh=mesh, batch=8, max_len=64, params=False) == (state + logits) // 8


def test_from_pretrained_refuses_what_cannot_fit(monkeypatch):
    free_memory(monkeypatch, 1 << 20)
    with pytest.raises(k3jax.OutOfMemoryError, match=r"k3-tiny: needs ~.* GiB parameters\).*use a smaller preset"):
        k3jax.from_pretrained("k3-tiny", dtype="float32")
    with pytest.raises(k3jax.OutOfMemoryError, match="k3-tiny on mesh dp=8"):
        k3jax.from_pretrained("k3-tiny", dtype="float32", mesh="dp=8")


def test_checkpoint_is_refused_before_reading_when_it_cannot_fit(monkeypatch):
    import os
    from k3jax import checkpoint
    free_memory(monkeypatch, 1 << 20)
    monkeypatch.setattr(checkpoint.TensorIndex, "read", lambda *a, **k: pytest.fail("read a tensor"))
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "k3-tiny")
    with pytest.raises(k3jax.OutOfMemoryError, match="k3-tiny: needs ~"):
        k3jax.from_pretrained(tiny)


def test_generate_refuses_a_state_that_cannot_fit(model, monkeypatch):
    free_memory(monkeypatch, 1 << 19)   # beside the placed weights; the state needs ~1 MiB
    with pytest.raises(k3jax.OutOfMemoryError,
                       match=r"decode state for batch 2 x 1003 tokens.*use a smaller batch or fewer tokens"):
        k3jax.generate(model, PROMPTS, 1000)


def test_generate_counts_the_compiled_prefill_temporaries(model, monkeypatch):
    """The estimate fits but XLA's count of the prefill temporaries does not: refused after
    compiling, before running."""
    estimate = weights.check_fits(model.cfg, model.dtype, batch=2, max_len=3 + 2, params=False)
    free_memory(monkeypatch, int((estimate + 1024) / (1 - weights.DECODE_HEADROOM)))
    with pytest.raises(k3jax.OutOfMemoryError, match="activations.*shorter prompts"):
        k3jax.generate(model, PROMPTS, 2)


def test_bench_skips_a_point_that_cannot_fit(model, monkeypatch):
    free_memory(monkeypatch, 1 << 20)
    row = bench._bench_point(model, {}, 64, 1000, 2, 1, 0, 1.0)
    assert row["status"] == "skipped" and "decode state for batch 64" in row["reason"]


def test_mesh_specs_and_meshes_are_checked():
    """A dict spec goes through the string spec's checks (aliases, sizes); a Mesh without the
    k3jax axes is refused with what to do, not a KeyError deep in the sharding rules."""
    from jax.sharding import Mesh
    assert dict(sharding.make_mesh({"ep": 4}).shape) == {"data": 1, "expert": 4, "tensor": 1}
    with pytest.raises(sharding.MeshError, match="size of 'expert' must be >= 1"):
        sharding.make_mesh({"expert": -2})
    with pytest.raises(sharding.MeshError, match="NAME one of dp, ep, tp"):
        sharding.make_mesh({"experts": 2})
    with pytest.raises(sharding.MeshError, match=r"axes \('data', 'expert', 'tensor'\), got \('x',\)"):
        k3jax.from_pretrained("k3-tiny", dtype="float32", mesh=Mesh(np.array(jax.devices()), ("x",)))
    with pytest.raises(sharding.MeshError, match="a mesh is a spec like 'ep=8'.*got int 3"):
        k3jax.from_pretrained("k3-tiny", dtype="float32", mesh=3)


def test_ep_variant_that_cannot_run_here_is_refused(model):
    """As decode --ep-variant: one line when the variant is set, not XLA's UNIMPLEMENTED after compiling."""
    with pytest.raises(ValueError, match="ep variant 'ragged' cannot run here: ragged_all_to_all does not run on XLA:CPU"):
        sharding.set_ep_variant(model, "ragged")


def test_out_of_memory_message_when_the_parameters_alone_do_not_fit(model, monkeypatch):
    """The room quoted is the free memory (it was parameters + 90% of a negative rest: more than free)."""
    free_memory(monkeypatch, 1 << 20)
    with pytest.raises(k3jax.OutOfMemoryError, match=r"more than the ~0.00 GiB a cpu device has for it; use a smaller preset"):
        weights.check_fits(model.cfg, jnp.float32, batch=1, max_len=8)
