"""k3jax: a JAX research port of the Kimi K3 decode path.

    model = k3jax.from_pretrained("k3-tiny")            # preset (random weights) or checkpoint dir
    logits = model(input_ids)                           # [B, T] -> float32 [B, T, V]
    new_ids = k3jax.generate(model, input_ids, max_new_tokens=16)
"""

from k3jax.cache import DecodeState, init_state
from k3jax.config import ConfigError, K3Config
from k3jax.generation import GenerationResult, SamplingParams, generate, generate_with_stats
from k3jax.model import K3Model
from k3jax.presets import PRESETS, get_preset
from k3jax.weights import OutOfMemoryError, from_pretrained

__all__ = [
    "ConfigError", "DecodeState", "GenerationResult", "K3Config", "K3Model", "OutOfMemoryError", "PRESETS",
    "SamplingParams", "from_pretrained", "generate", "generate_with_stats", "get_preset", "init_state",
]
