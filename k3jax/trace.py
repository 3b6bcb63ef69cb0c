"""Looking inside a forward: which experts each token was routed to and how AttnRes mixed depth.

    rec = k3jax.trace.trace_forward(model, input_ids)
    rec.routing[i]   -> (layer, ids [B*T, k], weights [B*T, k]) for the i-th MoE layer
    rec.attn_res[j]  -> (name, probs [N, B, T]) softmax over the N candidates of the j-th mix

It runs the model eagerly (op by op, no jit) through a recording KernelPlan, so use it on small
models and short inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from k3jax import ops
from k3jax.backend import KernelPlan
from k3jax.cache import init_state
from k3jax.model import K3Model, check_token_ids


@dataclasses.dataclass
class ForwardRecord:
    logits: np.ndarray
    routing: list[tuple[np.ndarray, np.ndarray]]   # per MoE layer: expert ids, routing weights
    attn_res: list[np.ndarray]                     # per AttnRes mix: probs [N, B, T]
    moe_layers: list[int]
    num_layers: int

    def attn_res_names(self) -> list[str]:
        """Labels of the AttnRes mixes in order (layer 0 has no mix before attention: no block yet)."""
        names = [n for i in range(self.num_layers) for n in ((f"L{i}.attn",) if i else ()) + (f"L{i}.mlp",)]
        return names + ["final"] if self.attn_res else []


class _RecordingPlan:
    """Delegates to a KernelPlan and records the routing and AttnRes weights it sees."""

    def __init__(self, plan: KernelPlan):
        self.plan, self.routing, self.attn_res = plan, [], []

    def runs_kernel(self, op: str) -> bool:
        return self.plan.runs_kernel(op)

    def __call__(self, op: str):
        fn = self.plan(op)
        if op == "route":
            def route(*args, **kwargs):
                ids, weights = fn(*args, **kwargs)
                self.routing.append((np.asarray(ids), np.asarray(weights)))
                return ids, weights
            return route
        if op in ("attn_res_mix", "attn_res_mix_norm"):
            def mix(candidates, norm_weight, query, *rest):     # rest: (eps,) or (out_norm, eps)
                self.attn_res.append(np.asarray(ops.attn_res_weights(candidates, norm_weight, query, rest[-1])))
                return fn(candidates, norm_weight, query, *rest)
            return mix
        return fn


def trace_forward(model: K3Model, input_ids) -> ForwardRecord:
    """Full-sequence forward of `input_ids` [B, T] that records routing and AttnRes weights."""
    ids = check_token_ids(input_ids, model.cfg.vocab_size)
    recording = _RecordingPlan(model.plan)
    saved, model.plan = model.plan, recording
    try:
        with jax.disable_jit():
            logits, _ = model.forward(ids, init_state(model.cfg, ids.shape[0], ids.shape[1], model.dtype))
    finally:
        model.plan = saved
    cfg = model.cfg
    return ForwardRecord(logits=np.asarray(logits), routing=recording.routing, attn_res=recording.attn_res,
                         moe_layers=[i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)],
                         num_layers=cfg.num_hidden_layers)
