"""Device meshes and partition rules: how every parameter and decode-state array is laid out.

Mesh axes are always ("data", "expert", "tensor"); a spec string names the sizes that are not 1:

    mesh = make_mesh("ep=8")            # 8-way expert parallel
    mesh = make_mesh("ep=2,tp=2")       # 2 expert groups x 2-way tensor parallel (4 devices)
    model = k3jax.from_pretrained("k3-h200x2", mesh=mesh)   # parameters created sharded

Layout (logical axis -> mesh axes, one table: LOGICAL_AXES):
- "batch" (sequences and tokens) -> ("data", "expert"): attention runs data-parallel over the
  expert groups, the usual layout for expert-parallel decode; axes that do not divide the batch
  are dropped (batch 1 runs replicated).
- "experts" (routed experts) -> ("expert", "tensor"): each expert rank owns E / ep experts,
  split further over its tensor ranks (E / (ep * tp) each), so no expert weight is held twice;
  the token dispatch is an explicit shard_map (k3jax.moe_parallel), and the tensor ranks of an
  expert group, which share its tokens, each run their own experts' rows and sum them (one
  all-reduce of the routed rows). `tp=2` on two GPUs is thus vLLM's layout: attention and dense
  weights tensor-parallel, routed experts expert-parallel, over the same GPUs.
- "heads" (KDA / MLA heads, their projections) and "mlp" (dense MLP, shared experts) -> "tensor":
  column-parallel in-projections, row-parallel out-projections, so a decode step needs one
  all-reduce after each o_proj / down_proj (placed by the SPMD partitioner); "vocab" -> "tensor"
  for the embedding and lm_head.
Every parameter path must match one rule in PARAM_RULES (an unmatched path is an error, so a new
parameter cannot silently stay replicated). A dimension that a mesh axis does not divide stays
unsharded along that axis.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k3jax.cache import DecodeState, KDAState, MLAState

AXES = ("data", "expert", "tensor")
_ALIASES = {"dp": "data", "data": "data", "ep": "expert", "expert": "expert", "tp": "tensor", "tensor": "tensor"}

LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "expert"),
    "experts": ("expert", "tensor"),
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}

# (regex on the parameter path, logical axis per dimension). First match wins.
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"experts\.w[123](_packed|_scale)?$", ("experts", None, None)),
    (r"^(embed_tokens|lm_head\.weight)$", ("vocab", None)),
    # Column-parallel: the output dimension is heads / MLP width.
    (r"self_attn\.([qkvg]_proj|f_b_proj|g_b_proj|b_proj|q_b_proj|kv_b_proj)\.weight$", ("heads", None)),
    (r"(mlp|shared_experts)\.(gate_proj|up_proj)\.weight$", ("mlp", None)),
    # Row-parallel: the input dimension is heads / MLP width (all-reduce after).
    (r"self_attn\.o_proj\.weight$", (None, "heads")),
    (r"(mlp|shared_experts)\.down_proj\.weight$", (None, "mlp")),
    # Small or shared-by-all-heads weights: replicated.
    (r"self_attn\.(q_a_proj|kv_a_proj_with_mqa|f_a_proj|g_a_proj)\.weight$", (None, None)),
    (r"self_attn\.[qkv]_conv1d$", (None, None)),
    (r"block_sparse_moe\.(gate\.weight|routed_expert_down_proj\.weight|routed_expert_up_proj\.weight)$",
     (None, None)),
    (r"(layernorm\.weight|norm\.weight|_res_norm|_res_proj|A_log|dt_bias|o_norm|e_score_correction_bias)$",
     (None,)),
)


class MeshError(ValueError):
    """A mesh spec that cannot be built or does not fit the model."""


def parse_mesh(spec: str) -> dict[str, int]:
    """'ep=2,tp=2' -> {'data': 1, 'expert': 2, 'tensor': 2}. Names: dp|data, ep|expert, tp|tensor."""
    sizes = dict.fromkeys(AXES, 1)
    seen = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, value = part.partition("=")
        axis = _ALIASES.get(name.strip().lower())
        if not eq or axis is None:
            raise MeshError(f"bad mesh spec {spec!r}: each item must be NAME=SIZE with NAME one of dp, ep, tp")
        if axis in seen:
            raise MeshError(f"bad mesh spec {spec!r}: axis {axis!r} given twice")
        try:
            size = int(value)
        except ValueError:
            raise MeshError(f"bad mesh spec {spec!r}: size of {name!r} must be an integer, got {value!r}") from None
        if size < 1:
            raise MeshError(f"bad mesh spec {spec!r}: size of {name!r} must be >= 1")
        sizes[axis] = size
        seen.add(axis)
    return sizes


def make_mesh(spec: str | dict[str, int], devices=None) -> Mesh:
    """A ("data", "expert", "tensor") mesh with Auto axis types (the SPMD partitioner places the
    dense collectives; only the expert dispatch is an explicit shard_map).

    Uses the first dp*ep*tp devices of `devices` (default: all devices of all processes; in a
    multi-process run the mesh must span every device).
    """
    if not isinstance(spec, (str, dict)):
        raise MeshError(f"a mesh is a spec like 'ep=8' (or {{'ep': 8}}) or a jax Mesh, got {type(spec).__name__} {spec!r}")
    # a dict goes through the spec's checks too: names (aliases included) and sizes >= 1
    sizes = parse_mesh(spec if isinstance(spec, str) else ",".join(f"{k}={v}" for k, v in spec.items()))
    n = math.prod(sizes[a] for a in AXES)
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise MeshError(f"mesh {format_mesh(sizes)} needs {n} devices but only {len(devices)} are visible")
    if jax.process_count() > 1 and n != len(devices):
        raise MeshError(f"mesh {format_mesh(sizes)} has {n} devices; a multi-process mesh must use all "
                        f"{len(devices)} devices")
    grid = np.asarray(devices[:n], dtype=object).reshape([sizes[a] for a in AXES])
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def as_mesh(mesh: str | dict[str, int] | Mesh) -> Mesh:
    """A spec ("ep=2,tp=2" or {"ep": 2}) -> make_mesh(spec); a Mesh must have the axes AXES."""
    if not isinstance(mesh, Mesh):
        return make_mesh(mesh)
    if tuple(mesh.axis_names) != AXES:
        raise MeshError(f"a k3jax mesh has the axes {AXES}, got {tuple(mesh.axis_names)}; build it with "
                        f"k3jax.sharding.make_mesh (e.g. make_mesh('ep=2')) or pass the spec")
    return mesh


def format_mesh(mesh_or_sizes) -> str:
    sizes = dict(mesh_or_sizes.shape) if isinstance(mesh_or_sizes, Mesh) else mesh_or_sizes
    short = {"data": "dp", "expert": "ep", "tensor": "tp"}
    return ",".join(f"{short[a]}={sizes[a]}" for a in AXES if sizes.get(a, 1) > 1) or "single"


def _fit(dim: int, axes: tuple[str, ...], sizes: dict[str, int]):
    """The longest prefix of `axes` whose size product divides `dim` (None if empty)."""
    kept: list[str] = []
    for a in axes:
        if sizes.get(a, 1) == 1:
            continue
        if dim % (math.prod(sizes[k] for k in kept) * sizes[a]):
            break
        kept.append(a)
    return None if not kept else kept[0] if len(kept) == 1 else tuple(kept)


def logical_spec(shape, logical: tuple[str | None, ...], mesh: Mesh) -> P:
    """PartitionSpec for an array of `shape` whose dimensions carry `logical` axis names."""
    sizes = dict(mesh.shape)
    return P(*(None if name is None else _fit(dim, LOGICAL_AXES[name], sizes)
               for dim, name in zip(shape, logical)))


def param_path(path) -> str:
    s = jax.tree_util.keystr(tuple(path), simple=True, separator=".")
    return s[:-len(".value")] if s.endswith(".value") else s


def param_spec(path: str, shape, mesh: Mesh) -> P:
    """The PartitionSpec PARAM_RULES give parameter `path` (e.g. 'layers.1.self_attn.q_proj.weight')."""
    for pattern, logical in PARAM_RULES:
        if re.search(pattern, path):
            if len(logical) != len(shape):
                raise MeshError(f"rule {pattern!r} is for {len(logical)}-d arrays; {path} has shape {tuple(shape)}")
            spec = logical_spec(shape, logical, mesh)
            if logical[0] == "experts" and dict(mesh.shape)["expert"] > 1 and spec[0] is None:
                raise MeshError(f"{path}: {shape[0]} experts do not split over expert axis of size "
                                f"{mesh.shape['expert']}")
            return spec
    raise MeshError(f"no partition rule for parameter {path!r}; add one to k3jax.sharding.PARAM_RULES")


def param_shardings(state, mesh: Mesh):
    """NamedSharding for every leaf of an nnx.State (concrete or abstract)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, param_spec(param_path(p), x.shape, mesh)), state)


def checkpoint_sharding(mesh: Mesh):
    """The `sharding` rule for k3jax.checkpoint loaders: each tensor goes straight to its shards."""
    return lambda path, shape, dtype: NamedSharding(mesh, param_spec(".".join(map(str, path)), shape, mesh))


def create_sharded(make_model, mesh: Mesh):
    """Builds `make_model()` with every parameter created directly in its shards: the constructor
    runs under jit with out_shardings, so no device ever holds a whole sharded array (random
    draws are partitionable: the values equal an unsharded creation's)."""
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = param_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.state(make_model()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def model_mesh(model) -> Mesh | None:
    """The mesh the model's parameters live on (None for a single-device model)."""
    leaves = jax.tree.leaves(nnx.state(model))
    s = getattr(leaves[0], "sharding", None) if leaves else None   # all parameters share one mesh
    return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


# ------------------------------------------------------------------ decode state
def state_specs(state: DecodeState, mesh) -> DecodeState:
    """PartitionSpecs for a DecodeState: batch over ("data", "expert"); KDA recurrent heads over
    "tensor". The conv window (q|k|v concatenated) and the MLA latent (shared by all heads) are
    not split over "tensor"."""
    b = state.lengths.shape[0]

    def spec(x, logical):
        return logical_spec(x.shape, logical, mesh)

    layers = []
    for s in state.layers:
        if isinstance(s, KDAState):
            layers.append(KDAState(conv=spec(s.conv, ("batch", None, None)),
                                   recurrent=spec(s.recurrent, ("batch", "heads", None, None))))
        else:
            layers.append(MLAState(latent=spec(s.latent, ("batch", None, None))))
    return DecodeState(lengths=logical_spec((b,), ("batch",), mesh), layers=tuple(layers))


def constrain_state(state: DecodeState) -> DecodeState:
    """Inside jit under an active mesh: pins the state to state_specs (identity without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or set(mesh.axis_names) != set(AXES):
        return state
    return jax.lax.with_sharding_constraint(state, state_specs(state, mesh))


def batch_sharding(mesh: Mesh, shape) -> NamedSharding:
    """Sharding of a [B, ...] input (token ids, lengths): batch over ("data", "expert")."""
    return NamedSharding(mesh, logical_spec(shape, ("batch",) + (None,) * (len(shape) - 1), mesh))


def per_device_param_bytes(cfg, dtype, mesh: Mesh) -> int:
    """Parameter bytes the most loaded device holds under PARAM_RULES on `mesh`."""
    from k3jax.weights import abstract_model
    state = nnx.state(abstract_model(cfg, dtype))
    sizes = dict(mesh.shape)
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        spec = param_spec(param_path(path), x.shape, mesh)
        shards = math.prod(sizes[a] for entry in spec if entry is not None
                           for a in ((entry,) if isinstance(entry, str) else entry))
        total += -(-x.size // shards) * np.dtype(x.dtype).itemsize
    return total


def set_ep_variant(model, variant: str):
    """Selects the expert-parallel dispatch of every LatentMoE (k3jax.moe_parallel.VARIANTS or
    "auto"); a static attribute, so the next jit call retraces."""
    from k3jax.layers import LatentMoE
    from k3jax.moe_parallel import check_available, resolve_variant
    resolve_variant(variant, 1)  # validates the name
    check_available(variant, f"ep variant {variant!r}")     # here, not by XLA after compiling
    for _, module in nnx.iter_graph(model):
        if isinstance(module, LatentMoE):
            module.ep_variant = variant
    return model


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of `x` as numpy on every process (gathers when shards live on other hosts)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
