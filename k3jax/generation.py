"""Generation: one jitted prefill, then jitted one-token decode steps over a donated state.

Nothing syncs with the host inside the decode loop except an early-stop check every
`STOP_CHECK_EVERY` steps when stop tokens are given.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from k3jax import ops, sharding
from k3jax.cache import DecodeState, init_state
from k3jax.model import K3Model, host_token_ids
from k3jax.weights import check_fits, check_int, check_seed, describe

STOP_CHECK_EVERY = 8
# Below this a positive temperature is greedy in effect, and logits / temperature can overflow
# float32 (inf - inf = NaN: token 0); 0 is greedy.
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = no top-k cut; top_p 1 = no nucleus cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{name} must be a number, got {describe(value)}")
        check_int("top_k", self.top_k)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where logits / temperature "
                             f"overflows float32; use 0 for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class GenerationResult:
    """New token ids [B, N] (`pad_id` after a stop token) and per-phase timings in seconds."""

    tokens: np.ndarray
    num_generated: np.ndarray       # [B] tokens up to and including the stop token
    prompt_lengths: np.ndarray      # [B]
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode throughput: B tokens per decode step run over the decode time (a row that has
        stopped still occupies its slot in every step, as it does in the batch's compute)."""
        return self.tokens.shape[0] * self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def step_ms(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else float("nan")

    def as_dict(self) -> dict:
        return {"tokens": self.tokens.tolist(), "num_generated": self.num_generated.tolist(),
                "prompt_lengths": self.prompt_lengths.tolist(), "compile_s": self.compile_s,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s, "decode_steps": self.decode_steps,
                "decode_tokens_per_s": self.decode_tokens_per_s, "step_ms": self.step_ms}


def pad_prompts(prompts, vocab_size: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A [B, T] int array or a list of B token-id lists (any lengths) -> right-padded int32 ids
    [B, T], lengths [B]. Ids are validated on the host (model.host_token_ids; no jax call)."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        ids = host_token_ids(prompts, vocab_size)
        return ids, np.full((ids.shape[0],), ids.shape[1], np.int32)
    text = (str, bytes)
    if (isinstance(prompts, text) or not isinstance(prompts, Sequence) or not prompts
            or not all(isinstance(p, (Sequence, np.ndarray, jax.Array)) and not isinstance(p, text) for p in prompts)):
        raise TypeError(f"input_ids must be a [batch, seq] int array or a non-empty list of token-id lists (one "
                        f"prompt is [[id, ...]]; encode text first, e.g. k3jax.tokenizer), got {describe(prompts)}")
    rows = [np.asarray(p) for p in prompts]
    for i, r in enumerate(rows):
        if r.size == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if r.ndim != 1:
            raise ValueError(f"prompt {i} must be a flat list of token ids, got shape {list(r.shape)}")
    lengths = np.array([r.size for r in rows], np.int32)
    flat = host_token_ids(np.concatenate(rows)[None], vocab_size)[0]   # every id, one check
    ids = np.full((len(rows), int(lengths.max())), pad_id, np.int32)
    for i, row in enumerate(np.split(flat, np.cumsum(lengths)[:-1])):
        ids[i, :row.size] = row
    return ids, lengths


def _stop_ids(stop_tokens) -> tuple[int, ...]:
    """stop_tokens (an id or an iterable of ids) as a tuple of ints."""
    if isinstance(stop_tokens, (np.ndarray, jax.Array)):
        stop_tokens = np.asarray(stop_tokens).reshape(-1).tolist()
    elif isinstance(stop_tokens, (int, np.integer)) and not isinstance(stop_tokens, bool):
        stop_tokens = (stop_tokens,)
    elif isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
        raise TypeError(f"stop_tokens must be a token id or a sequence of token ids, got {describe(stop_tokens)}")
    return tuple(check_int("each of stop_tokens", t) for t in stop_tokens)


def _check_key(key) -> jax.Array:
    """A typed scalar key (jax.random.key) or a legacy uint32 [2] PRNGKey."""
    if isinstance(key, (jax.Array, np.ndarray)):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == np.uint32 and key.shape == (2,):
            return jnp.asarray(key)
    raise TypeError(f"key must be one jax.random.key(seed) (or a jax.random.PRNGKey), got {describe(key)}; "
                    f"for an integer seed pass seed=")


def _temp_bytes(compiled) -> int | None:
    """Bytes of temporaries a compiled function allocates per device (None if XLA does not say)."""
    try:
        return compiled.memory_analysis().temp_size_in_bytes
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return None


@partial(jax.jit, static_argnames=("graphdef", "max_len", "sampling"))
def _prefill(graphdef, params, ids, lengths, key, *, max_len: int, sampling: SamplingParams):
    model = nnx.merge(graphdef, params)
    state = sharding.constrain_state(init_state(model.cfg, ids.shape[0], max_len, model.dtype))
    logits, state = model.forward(ids, state, lengths, last_only=True)
    return ops.sample(logits, key, sampling.temperature, sampling.top_k, sampling.top_p), state


@partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("state", "out", "done"))
def _decode_step(graphdef, params, state: DecodeState, out, done, step, key, stop_ids, pad_id,
                 *, sampling: SamplingParams):
    """Feeds out[:, step] and writes the next token to out[:, step + 1]."""
    model = nnx.merge(graphdef, params)
    token = jax.lax.dynamic_index_in_dim(out, step, axis=1, keepdims=True)
    logits, state = model.forward(token, state)
    nxt = ops.sample(logits[:, 0], jax.random.fold_in(key, step), sampling.temperature,
                     sampling.top_k, sampling.top_p)
    nxt = jnp.where(done, pad_id, nxt)
    done = done | jnp.isin(nxt, stop_ids)
    out = jax.lax.dynamic_update_index_in_dim(out, nxt[:, None], step + 1, axis=1)
    return state, out, done


def check_request(cfg, input_ids, max_new_tokens: int, sampling: SamplingParams, stop_tokens=(),
                  pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Checks a generation request against the model config `cfg` before anything is built or
    run -> (right-padded int32 ids [B, T], lengths [B], stop ids). TypeError/ValueError naming the
    problem: a bad prompt or id, top_k beyond the vocabulary, a stop or pad id outside it, prompt
    plus new tokens beyond max_position_embeddings."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a k3jax.SamplingParams, got {describe(sampling)}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    vocab = cfg.vocab_size
    if sampling.top_k > vocab:
        raise ValueError(f"top_k ({sampling.top_k}) exceeds the vocabulary size ({vocab})")
    pad_id = check_int("pad_id", pad_id, minimum=0)
    if pad_id >= vocab:
        raise ValueError(f"pad_id must be a token id below the vocabulary size {vocab}, got {pad_id}")
    stop_ids = _stop_ids(stop_tokens)
    outside = [t for t in stop_ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"stop token id(s) {outside} outside the vocabulary [0, {vocab}): they could never match")
    ids, lengths = pad_prompts(input_ids, vocab, pad_id)
    max_len = ids.shape[1] + max_new_tokens
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({ids.shape[1]}) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    return ids, lengths, stop_ids


def generate_with_stats(model: K3Model, input_ids, max_new_tokens: int = 32, *,
                        sampling: SamplingParams = SamplingParams(), key: jax.Array | None = None,
                        seed: int = 0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
                        progress: bool = False) -> GenerationResult:
    """Generates up to `max_new_tokens` per prompt; see `generate`. Returns ids and timings.
    Raises TypeError/ValueError naming a bad argument (`check_request`) and OutOfMemoryError
    (before prefill) when the decode state of batch x (prompt + max_new_tokens) tokens cannot fit
    beside the weights."""
    if not isinstance(model, K3Model):
        raise TypeError(f"model must be a k3jax.K3Model (k3jax.from_pretrained), got {type(model).__name__}")
    cfg = model.cfg
    seed = check_seed(seed)
    key = None if key is None else _check_key(key)
    mesh = sharding.model_mesh(model)
    if mesh is not None and jax.sharding.get_abstract_mesh().empty:
        with jax.set_mesh(mesh):  # a sharded model runs on its mesh (expert dispatch, state layout)
            return generate_with_stats(model, input_ids, max_new_tokens, sampling=sampling, key=key, seed=seed,
                                       stop_tokens=stop_tokens, pad_id=pad_id, progress=progress)
    ids, lengths, stop_tokens = check_request(cfg, input_ids, max_new_tokens, sampling, stop_tokens, pad_id)
    prompt_lengths = lengths
    if mesh is not None:
        ids = jax.device_put(ids, sharding.batch_sharding(mesh, ids.shape))
        lengths = jax.device_put(lengths, sharding.batch_sharding(mesh, lengths.shape))
    max_len = ids.shape[1] + max_new_tokens
    b = ids.shape[0]
    check_fits(cfg, model.dtype, mesh=mesh, batch=b, max_len=max_len, params=False)   # before compiling
    key = jax.random.key(seed) if key is None else key
    prefill_key, decode_key = jax.random.split(key)
    graphdef, params = nnx.split(model)
    stop_ids = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)

    t0 = time.perf_counter()
    prefill = _prefill.lower(graphdef, params, ids, lengths, prefill_key, max_len=max_len, sampling=sampling).compile()
    # XLA's own count of the prefill's temporaries (for long prompts far above the state)
    check_fits(cfg, model.dtype, mesh=mesh, batch=b, max_len=max_len, params=False,
               activation_bytes=_temp_bytes(prefill))
    t1 = time.perf_counter()
    first, state = prefill(params, ids, lengths, prefill_key)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_ids)
    jax.block_until_ready((out, state))
    t2 = time.perf_counter()
    compile_s, prefill_s, decode_s, steps = t1 - t0, t2 - t1, 0.0, 0
    if max_new_tokens > 1 and not (stop_tokens and bool(jnp.all(done))):     # every row stopped at once
        step_fn = _decode_step.lower(graphdef, params, state, out, done, 0, decode_key, stop_ids, pad_id,
                                     sampling=sampling).compile()
        t3 = time.perf_counter()
        for step in tqdm(range(max_new_tokens - 1), desc="decode", unit="tok", disable=not progress, leave=False):
            state, out, done = step_fn(params, state, out, done, step, decode_key, stop_ids, pad_id)
            steps += 1
            if stop_tokens and steps % STOP_CHECK_EVERY == 0 and bool(jnp.all(done)):
                break
        jax.block_until_ready(out)
        t4 = time.perf_counter()
        compile_s += t3 - t2
        decode_s = t4 - t3

    tokens = sharding.to_host(out).copy()
    tokens[:, steps + 1:] = pad_id          # positions not reached after an early stop
    num = np.full((b,), max_new_tokens, np.int32)
    for i in range(b):
        hits = np.nonzero(np.isin(tokens[i], list(stop_tokens)))[0] if stop_tokens else []
        if len(hits):
            num[i] = hits[0] + 1
            tokens[i, hits[0] + 1:] = pad_id
    return GenerationResult(tokens=tokens, num_generated=num, prompt_lengths=prompt_lengths, compile_s=compile_s,
                            prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps)


def generate(model: K3Model, input_ids, max_new_tokens: int = 32, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, key: jax.Array | None = None, seed: int = 0,
             stop_tokens: Sequence[int] = (), pad_id: int = 0, progress: bool = False) -> np.ndarray:
    """New token ids [B, max_new_tokens] for a batch of prompts.

    input_ids: a [B, T] int array, or a list of B token-id lists of different lengths (they are
    right-padded; every row's result equals generating it alone). Greedy unless temperature > 0;
    sampling uses `key` (or `jax.random.key(seed)`). After a sequence emits one of `stop_tokens`
    (an id or a sequence of ids) its remaining positions hold `pad_id`. Raises TypeError/ValueError
    naming a bad argument, and OutOfMemoryError before prefill when the decode state cannot fit.
    """
    return generate_with_stats(model, input_ids, max_new_tokens, sampling=SamplingParams(temperature, top_k, top_p),
                               key=key, seed=seed, stop_tokens=stop_tokens, pad_id=pad_id,
                               progress=progress).tokens
