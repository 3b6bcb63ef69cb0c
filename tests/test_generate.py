"""generate(): batching, sampling reproducibility, stop tokens, top-k (float32 k3-tiny)."""

import jax
import numpy as np
import pytest

import k3jax
from k3jax import ops

PROMPTS = [[5, 17, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]   # 3 and 19 tokens
N = 6


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("k3-tiny")


@pytest.fixture(scope="module")
def greedy(model):
    return k3jax.generate(model, PROMPTS, N)


def test_batch_of_different_lengths_equals_each_alone(model, greedy):
    """The short prompt is right-padded by 16 tokens in the batch; alone it has no padding. (The
    long prompt's row has no padding in either, so one solo run covers the padding path.)"""
    assert greedy.shape == (2, N) and greedy.dtype == np.int32
    np.testing.assert_array_equal(k3jax.generate(model, np.array([PROMPTS[0]]), N)[0], greedy[0])


def test_sampling_is_reproducible_per_seed(model):
    a = k3jax.generate(model, PROMPTS, N, temperature=1.0, seed=3)
    b = k3jax.generate(model, PROMPTS, N, temperature=1.0, seed=3)
    c = k3jax.generate(model, PROMPTS, N, temperature=1.0, seed=4)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert ((a >= 0) & (a < model.cfg.vocab_size)).all()


def test_top_k_1_and_tiny_top_p_equal_greedy():
    """At the sampler (a generate run per sampling setting would cost two compilations each)."""
    logits = jax.random.normal(jax.random.key(0), (4, 512)) * 3.0
    greedy = ops.sample(logits, jax.random.key(1), 0.0, 0, 1.0)
    for seed in range(3):
        key = jax.random.key(seed)
        np.testing.assert_array_equal(ops.sample(logits, key, 1.5, 1, 1.0), greedy)
        np.testing.assert_array_equal(ops.sample(logits, key, 1.5, 0, 1e-6), greedy)
    assert (ops.sample(logits, jax.random.key(5), 5.0, 0, 1.0) != greedy).any()


def test_stop_tokens_pad_after_the_stop(model, greedy):
    stop = int(greedy[0, 2])
    pad = model.cfg.vocab_size - 1
    assert pad not in greedy and stop not in greedy[0, :2]
    res = k3jax.generate_with_stats(model, PROMPTS, N, stop_tokens=stop, pad_id=pad)   # an int or a list
    first = int(np.argmax(greedy[1] == stop)) if stop in greedy[1] else None
    np.testing.assert_array_equal(res.tokens[0, :3], greedy[0, :3])
    assert (res.tokens[0, 3:] == pad).all() and res.num_generated[0] == 3
    if first is None:
        np.testing.assert_array_equal(res.tokens[1], greedy[1])
        assert res.num_generated[1] == N
    else:
        assert (res.tokens[1, first + 1:] == pad).all()


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        k3jax.generate(model, PROMPTS, 0)
    with pytest.raises(ValueError, match="top_p"):
        k3jax.generate(model, PROMPTS, 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="empty"):
        k3jax.generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        k3jax.generate(model, [[1, model.cfg.vocab_size]], 2)
