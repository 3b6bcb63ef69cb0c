"""Hugging Face checkpoints <-> k3jax models: strict streaming loader, HF writer, synthetic
checkpoints and orbax save/restore.

The one mapping between the two worlds is `checkpoint_layout(cfg, prefix)`: for every NNX
parameter leaf, the Hugging Face tensor name(s), their on-disk shape and dtype, and how the layout
differs (conv weights [P, 1, K] vs [P, K]; AttnRes queries [1, D] vs [D]; A_log padded [128] or
(1, 1, H, 1) vs [H]; routed experts one tensor per expert vs stacked [E, ...]).

Loading (`load_hf_checkpoint`) reads one tensor at a time from memory-mapped safetensors and puts
it straight onto its target sharding, so host memory stays near one tensor (routed experts: one
chunk of at most EXPERT_CHUNK_BYTES of experts, stacked on the host and written into the
preallocated device array). Every tensor is checked; nothing is silently skipped except the K3
vision tower / projector (`vision_tower.*`, `mm_projector.*`), which is logged.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from k3jax import mxfp4
from k3jax.atomic import DIR_MODE, write_text
from k3jax.config import K3Config
from k3jax.safetensors_io import DTYPES, SafetensorsError, SafetensorsFile, write_file

log = logging.getLogger("k3jax.checkpoint")

K3_PREFIX = "language_model."
SKIPPED_ROOTS = ("vision_tower.", "mm_projector.")   # K3's vision encoder: not part of the text decoder
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EXPERT_CHUNK_BYTES = 256 * 2**20   # host staging bound when stacking per-expert tensors
A_LOG_PAD = 128                    # K3 ships A_log zero-padded to a multiple of 128 (96 real heads)
_FLOAT_KINDS = ("BF16", "F16", "F32")
MXFP4_QUANT_CONFIG = {  # the released K3 text_config.quantization_config
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


class CheckpointError(ValueError):
    """A checkpoint directory does not match its config or is damaged; the message names what."""


# ------------------------------------------------------------------------------------ layout
@dataclasses.dataclass(frozen=True)
class Slot:
    """One NNX parameter leaf and the Hugging Face tensor(s) that hold it.

    kind: "plain" (same shape), "conv" (HF [P, 1, K]), "row" (HF [1, D]), "a_log" (HF padded
    [128k] for K3, (1, 1, H, 1) for Kimi-Linear), "expert" (one HF tensor per expert, stacked on
    axis 0 in NNX). tiles: "codes" / "scales" for MXFP4 expert tensors held in tile order
    (cfg.experts_in_tiles; k3jax.mxfp4.to_tiles): row order on disk, tiled in memory.
    """
    path: tuple
    shape: tuple[int, ...]          # NNX shape
    names: tuple[str, ...]          # HF names (E of them for "expert")
    hf_shape: tuple[int, ...]       # shape written to disk (per expert for "expert")
    hf_dtype: str                   # dtype written to disk: BF16 / F32 / U8
    kind: str
    tiles: str | None = None

    def tiled_in_memory(self, arr, *, inverse: bool = False):
        """arr (this slot's value, or a stack of its experts) from disk order to memory order
        (inverse: back); the identity unless the slot is held in tiles."""
        if self.tiles is None:
            return arr
        return (mxfp4.from_tiles if inverse else mxfp4.to_tiles)(arr, scales=self.tiles == "scales")


def _hf_suffix(path: tuple) -> str:
    """NNX path (without the stacked-expert part) -> dotted HF name relative to `model.`."""
    parts = [str(p) for p in path]
    if parts[-1] != "weight" and parts[-1] not in ("A_log", "dt_bias", "e_score_correction_bias"):
        parts.append("weight")  # Params held directly (conv, o_norm, AttnRes, embed) are `.weight` in HF
    return ".".join(parts)


def hf_prefix(hf_config: dict) -> str:
    """Tensor-name prefix: K3's multimodal wrapper nests the decoder under `language_model.`."""
    return K3_PREFIX if hf_config.get("model_type") == "kimi_k3" else ""


def checkpoint_layout(cfg: K3Config, prefix: str) -> list[Slot]:
    """Every parameter of a model with config `cfg`, in NNX order, with its HF tensors."""
    state = nnx.state(nnx.eval_shape(lambda: _model_cls()(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    slots = []
    for path, var in nnx.to_flat_state(state):
        shape, dtype = tuple(var.get_value().shape), jnp.dtype(var.get_value().dtype)
        hf_dtype = {jnp.dtype(jnp.uint8): "U8", jnp.dtype(jnp.float32): "F32"}.get(dtype, "BF16")
        last, tiles = path[-1], None
        if path[0] in ("lm_head",):
            names, hf_shape, kind = (prefix + _hf_suffix(path),), shape, "plain"
        elif "experts" in path and path[-2] == "experts":
            base = ".".join(str(p) for p in path[:-1])
            m = re.fullmatch(r"(w[123])(?:_(packed|scale))?", last)
            leaf = f"weight_{m.group(2)}" if m.group(2) else "weight"
            names = tuple(f"{prefix}model.{base}.{e}.{m.group(1)}.{leaf}" for e in range(shape[0]))
            hf_shape, kind = shape[1:], "expert"
            if m.group(2) and cfg.experts_in_tiles:
                tiles = "codes" if m.group(2) == "packed" else "scales"
        else:
            name = prefix + "model." + _hf_suffix(path)
            if last in ("q_conv1d", "k_conv1d", "v_conv1d"):
                hf_shape, kind = (shape[0], 1, shape[1]), "conv"
            elif last in ("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"):
                hf_shape, kind = (1, shape[0]), "row"
            elif last == "A_log":
                hf_shape = (-(-shape[0] // A_LOG_PAD) * A_LOG_PAD,) if prefix else (1, 1, shape[0], 1)
                kind = "a_log"
            else:
                hf_shape, kind = shape, "plain"
            names = (name,)
        slots.append(Slot(tuple(path), shape, names, tuple(hf_shape), hf_dtype, kind, tiles))
    return slots


def _model_cls():
    from k3jax.model import K3Model
    return K3Model


def to_hf(slot: Slot, value: np.ndarray) -> list[np.ndarray]:
    """NNX value -> the HF tensor(s) of `slot` in their on-disk layout (dtype not changed)."""
    if slot.kind == "expert":
        return [value[e] for e in range(value.shape[0])]
    if slot.kind == "a_log":
        if len(slot.hf_shape) == 1:
            return [np.concatenate([value, np.zeros(slot.hf_shape[0] - value.shape[0], value.dtype)])]
        return [value.reshape(slot.hf_shape)]
    return [value.reshape(slot.hf_shape)]


def _from_hf(slot: Slot, name: str, arr: np.ndarray) -> np.ndarray:
    """One HF tensor -> its NNX layout (per expert for "expert"); raises on a wrong shape."""
    want = slot.shape[1:] if slot.kind == "expert" else slot.shape
    got = tuple(arr.shape)
    if slot.kind == "a_log":
        h = slot.shape[0]
        if got in ((h,), (1, 1, h, 1), (h, 1)):
            return arr.reshape(h)
        if len(got) == 1 and got[0] > h:
            tail = np.asarray(arr[h:])
            if np.any(tail != 0):
                raise CheckpointError(f"{name}: padded A_log {list(got)} has non-zero entries beyond the "
                                      f"{h} heads of the config (config/weights mismatch?)")
            return arr[:h]
        raise CheckpointError(f"{name}: wrong shape: expected [{h}], (1, 1, {h}, 1) or [{A_LOG_PAD}k] "
                              f"zero-padded, got {list(got)}")
    if slot.kind == "conv" and got in (slot.hf_shape, want):
        return arr.reshape(want)
    if slot.kind == "row" and got in (slot.hf_shape, want):
        return arr.reshape(want)
    if slot.path[-1] == "dt_bias" and len(got) == 2 and got[0] * got[1] == want[0]:
        return arr.reshape(want)  # (H, D) layout of some Kimi-Linear exports
    if got != tuple(want) and got != slot.hf_shape:
        raise CheckpointError(f"{name}: wrong shape: expected {list(slot.hf_shape)}, got {list(got)}")
    return arr.reshape(want)


def _check_dtype(slot: Slot, name: str, dtype: str) -> None:
    if slot.hf_dtype == "U8":
        if dtype != "U8":
            raise CheckpointError(f"{name}: wrong dtype: expected U8 (MXFP4 packed codes / E8M0 scales), got {dtype}")
    elif dtype not in _FLOAT_KINDS:
        raise CheckpointError(f"{name}: wrong dtype: expected a float ({slot.hf_dtype} in the release; "
                              f"BF16/F16/F32 accepted), got {dtype}")


# ------------------------------------------------------------------------------- directory
def checkpoint_config(path: str, hf_config: dict | None = None, **config_changes) -> K3Config:
    """The K3Config of checkpoint directory `path` (its config.json unless `hf_config` is given),
    named after the directory, with `config_changes` applied."""
    cfg = K3Config.from_hf(hf_config or read_hf_config(path), name=os.path.basename(os.path.normpath(path)))
    return cfg.replace(**config_changes) if config_changes else cfg


def read_hf_config(path: str) -> dict:
    """config.json of the checkpoint directory `path`; CheckpointError naming a missing directory,
    a file given for one, a missing or malformed config.json."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} " + ("is a file, not a checkpoint directory" if os.path.exists(path)
                                                         else "does not exist"))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path}: no config.json in the checkpoint directory")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None


class TensorIndex:
    """Name -> (file, SafetensorsFile) for a checkpoint directory, from the index or the files.

    With an index, every shard's header is read too: `unindexed` holds {name: file} of tensors a
    shard holds but the index omits, `unnamed_files` the *.safetensors files it never names
    (`_validate` reports both, as it reports unexpected tensors)."""

    def __init__(self, path: str):
        self.path = path
        self._files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, str] = {}
        self.unindexed: dict[str, str] = {}
        self.unnamed_files: list[str] = []
        index_path = os.path.join(path, INDEX_FILE)
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: weight_map must be an object {{tensor: file}}, "
                                      f"got {type(weight_map).__name__}")
            by_file: dict[str, list[str]] = {}
            for name, fname in weight_map.items():
                if not isinstance(fname, str):
                    raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be a file name, got {fname!r}")
                by_file.setdefault(fname, []).append(name)
            for fname, names in sorted(by_file.items()):
                if not os.path.isfile(os.path.join(path, fname)):
                    raise CheckpointError(f"{index_path}: points at missing shard {fname!r} ({len(names)} tensors, "
                                          f"e.g. {names[0]!r})")
                st = self._open(fname)
                absent = [n for n in names if n not in st]
                if absent:
                    raise CheckpointError(f"{index_path}: says {len(absent)} tensor(s) are in {fname!r} but that "
                                          f"file does not hold them:{_listing(absent)}")
                self.where.update(dict.fromkeys(names, fname))
                self.unindexed.update({n: fname for n in st.keys() if weight_map.get(n) != fname})
            self.unnamed_files = [f for f in files if f not in by_file]
        else:
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
            if len(files) > 1:
                log.info("%s: no %s; reading all %d safetensors files", path, INDEX_FILE, len(files))
            for fname in files:
                for n in self._open(fname).keys():
                    if n in self.where:
                        raise CheckpointError(f"{path}: tensor {n!r} is in both {self.where[n]!r} and {fname!r}")
                    self.where[n] = fname

    def _open(self, fname: str) -> SafetensorsFile:
        if fname not in self._files:
            self._files[fname] = SafetensorsFile(os.path.join(self.path, fname))
        return self._files[fname]

    def dtype(self, name: str) -> str:
        return self._open(self.where[name]).info(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._open(self.where[name]).info(name).shape

    def read(self, name: str) -> np.ndarray:
        return self._open(self.where[name]).read(name)

    def nbytes(self, name: str) -> int:
        return self._open(self.where[name]).info(name).nbytes


def _listing(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return "\n  " + "\n  ".join(names[:limit]) + more


ShardingSpec = jax.sharding.Sharding | Callable[[tuple, tuple, Any], jax.sharding.Sharding] | dict | None


def _sharding_for(sharding: ShardingSpec, path: tuple, shape, dtype) -> jax.sharding.Sharding:
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    if isinstance(sharding, dict):
        return sharding[tuple(path)]
    return sharding(tuple(path), tuple(shape), dtype)


# rows [n, ...] written at buf[start:start+n] in place: buf is donated and keeps its sharding.
_put_rows_jit = jax.jit(lambda buf, rows, start: jax.lax.dynamic_update_slice_in_dim(buf, rows, start, axis=0),
                        donate_argnums=0)


def load_hf_checkpoint(path: str, *, dtype=jnp.bfloat16, sharding: ShardingSpec = None, mesh=None,
                       progress: bool = True, **config_changes):
    """A K3Model from a Hugging Face checkpoint directory (config.json + safetensors).

    dtype: the model dtype for the bf16 tensors (F32-kept params stay F32, MXFP4 stays uint8).
    sharding: None (default device), one Sharding for everything, a dict {nnx_path: Sharding} or
      a callable (nnx_path, shape, dtype) -> Sharding (e.g. an expert-parallel rule).
    mesh: the mesh `sharding` spreads the parameters over, for the memory check (one device's share).
    config_changes: K3Config overrides (e.g. expert_format) applied after reading config.json.
    Raises CheckpointError / SafetensorsError / ConfigError naming every problem found, and
    OutOfMemoryError (weights.check_fits) before any tensor is read.
    """
    from k3jax.weights import check_fits, parse_dtype
    dtype = parse_dtype(dtype)
    hf_config = read_hf_config(path)
    cfg = checkpoint_config(path, hf_config, **config_changes)
    check_fits(cfg, dtype, mesh=mesh)
    prefix = hf_prefix(hf_config)
    index = TensorIndex(path)
    slots = checkpoint_layout(cfg, prefix)
    _validate(path, cfg, slots, index, prefix)

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _model_cls()(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    flat = dict(nnx.to_flat_state(abstract))
    total = sum(index.nbytes(n) for s in slots for n in s.names)
    bar = _progress(total, f"loading {os.path.basename(os.path.normpath(path))}", progress)
    values = {}
    for slot in slots:
        target = flat[slot.path].get_value()
        sh = _sharding_for(sharding, slot.path, target.shape, target.dtype)
        if slot.kind == "expert":
            values[slot.path] = _load_stacked(slot, index, target.dtype, sh, bar)
        else:
            name = slot.names[0]
            arr = _from_hf(slot, name, index.read(name))
            values[slot.path] = jax.device_put(np.asarray(arr).astype(target.dtype), sh)
            bar.update(index.nbytes(name))
    bar.close()
    for p, var in flat.items():
        var.set_value(values[p])
    skipped = sorted(n for n in index.where if n.startswith(SKIPPED_ROOTS))
    if skipped:
        log.info("%s: skipped %d vision tower / projector tensors (%s...)", path, len(skipped),
                 ", ".join(sorted({n.split('.')[0] for n in skipped})))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _load_stacked(slot: Slot, index: TensorIndex, dtype, sharding, bar) -> jax.Array:
    """Stacked experts [E, ...]: chunks of per-expert tensors written into a preallocated
    (sharded) device array; the host holds one chunk (<= EXPERT_CHUNK_BYTES) at a time."""
    e = slot.shape[0]
    per = int(np.prod(slot.shape[1:])) * jnp.dtype(dtype).itemsize
    chunk = max(1, min(e, EXPERT_CHUNK_BYTES // max(per, 1)))
    buf = jnp.zeros(slot.shape, dtype, device=sharding)
    is_scale, scale_range = slot.path[-1].endswith("_scale"), (255, 0)
    for start in range(0, e, chunk):
        names = slot.names[start:start + chunk]
        rows = slot.tiled_in_memory(np.stack([np.asarray(_from_hf(slot, n, index.read(n))).astype(dtype) for n in names]))
        if is_scale:
            scale_range = (min(scale_range[0], int(rows.min())), max(scale_range[1], int(rows.max())))
        buf = _put_rows_jit(buf, rows, start)
        bar.update(sum(index.nbytes(n) for n in names))
    if is_scale:
        _check_scale_range(slot, *scale_range)
    return buf


def _check_scale_range(slot: Slot, lo: int, hi: int) -> None:
    """Warn when MXFP4 scale codes fall outside what the GPU kernels decode exactly."""
    if lo < mxfp4.DECODE_EXACT_SCALES[0] or hi > mxfp4.DECODE_EXACT_SCALES[1]:
        log.warning("%s: MXFP4 scale codes span %d..%d; the Pallas and CuTe moe_experts kernels are exact for "
                    "%d..%d only (k3jax.mxfp4.DECODE_EXACT_SCALES): run this checkpoint with --backend xla",
                    "/".join(map(str, slot.path)), lo, hi, *mxfp4.DECODE_EXACT_SCALES)


def _validate(path: str, cfg: K3Config, slots: list[Slot], index: TensorIndex, prefix: str) -> None:
    """All-or-nothing checks before anything is allocated: names, shapes, dtypes."""
    expected = {n: s for s in slots for n in s.names}
    present = {n for n in index.where if not n.startswith(SKIPPED_ROOTS)}
    missing, unexpected = set(expected) - present, present - set(expected)
    problems = []
    if missing or unexpected:
        hint = _mismatch_hint(cfg, missing, unexpected, prefix)
        if hint:        # one line says it all; the name lists would bury it
            raise CheckpointError(f"{path}: {hint} ({len(missing)} missing, {len(unexpected)} unexpected tensors)")
        if missing:
            problems.append(f"{len(missing)} missing tensor(s):{_listing(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensor(s):{_listing(unexpected)}")
    if index.unindexed:
        problems.append(f"{len(index.unindexed)} tensor(s) in shards but not in {INDEX_FILE} (or mapped to "
                        f"another shard):" + _listing(f"{n} (in {f})" for n, f in index.unindexed.items()))
    if index.unnamed_files:
        problems.append(f"{len(index.unnamed_files)} *.safetensors file(s) that {INDEX_FILE} does not name:"
                        + _listing(index.unnamed_files))
    for name in sorted(set(expected) & present):
        slot = expected[name]
        try:
            _check_dtype(slot, name, index.dtype(name))
            _from_hf(slot, name, np.empty(index.shape(name), np.uint8) if slot.kind != "a_log"
                     else index.read(name))
        except CheckpointError as e:
            problems.append(str(e))
        if len(problems) > 40:
            problems.append("... (stopped after 40 problems)")
            break
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json ({cfg.num_hidden_layers} layers, "
                              f"experts {cfg.expert_format}):\n" + "\n".join(problems))


def _mismatch_hint(cfg: K3Config, missing: set, unexpected: set, prefix: str) -> str | None:
    """One sentence for the common config/weights mismatches (raised alone, with the counts)."""
    if any(n.endswith(".weight_packed") for n in missing) and any(
            re.search(r"experts\.\d+\.w[123]\.weight$", n) for n in unexpected):
        return ("config/weights mismatch: config.json implies MXFP4 experts (quantization_config "
                "mxfp4-pack-quantized) but the checkpoint holds bf16 expert weights; fix quantization_config "
                "or pass expert_format='bf16'")
    if any(re.search(r"experts\.\d+\.w[123]\.weight$", n) for n in missing) and any(
            n.endswith(".weight_packed") for n in unexpected):
        return ("config/weights mismatch: the checkpoint holds MXFP4 experts (weight_packed/weight_scale) "
                "but the config asks for bf16 experts; loading does not dequantise them, so leave out "
                "expert_format='bf16' (--experts bf16)")
    layers = {int(m.group(1)) for n in unexpected if (m := re.search(r"model\.layers\.(\d+)\.", n))}
    if layers and max(layers) >= cfg.num_hidden_layers:
        return (f"config/weights mismatch: the checkpoint has layers up to {max(layers)} but config.json "
                f"num_hidden_layers is {cfg.num_hidden_layers}")
    if missing and unexpected and all(not n.startswith(prefix) for n in unexpected) and prefix:
        return f"config/weights mismatch: config.json is a K3 wrapper (names start with {prefix!r}), the tensors are not"
    if missing and unexpected and any(n.startswith(K3_PREFIX) for n in unexpected) and not prefix:
        return f"config/weights mismatch: the tensors start with {K3_PREFIX!r} but config.json is not a kimi_k3 wrapper"
    return None


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                leave=False)


# ------------------------------------------------------------------------------- writing HF
Entry = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


def write_hf_checkpoint(out_dir: str, hf_config: dict, entries: list[Entry], *,
                        max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> str:
    """Writes config.json + safetensors shards (+ index when more than one) into `out_dir`.

    Entries are produced and written one tensor at a time. Atomic: everything goes into a
    temporary sibling directory that is renamed to `out_dir` only when complete.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = int(np.prod(entry[1], dtype=np.int64)) * np.dtype(entry[2]).itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        names = ([SINGLE_FILE] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        weight_map, total = {}, 0
        for fname, shard in zip(names, shards):
            total += write_file(os.path.join(tmp, fname), shard, {"format": "pt"})
            weight_map.update({e[0]: fname for e in shard})
        if len(shards) > 1:  # write_text fsyncs, as write_file does the shards
            write_text(os.path.join(tmp, INDEX_FILE),
                       json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        write_text(os.path.join(tmp, "config.json"), json.dumps(hf_config, indent=2))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(tmp: str, out_dir: str) -> None:
    """Renames a finished temporary directory into place. An old one is moved aside first and
    moved back if that rename fails, so a failed overwrite keeps the old checkpoint. The new
    directory gets the old one's permissions, else a new directory's (not mkdtemp's owner-only)."""
    os.chmod(tmp, os.stat(out_dir).st_mode & 0o7777 if os.path.exists(out_dir) else DIR_MODE)
    if not os.path.exists(out_dir):
        os.rename(tmp, out_dir)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
    aside = os.path.join(old, "d")
    try:
        os.rename(out_dir, aside)
        os.rename(tmp, out_dir)
    except BaseException:
        if os.path.exists(aside):
            os.rename(aside, out_dir)
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


def model_entries(model, prefix: str) -> list[Entry]:
    """HF entries for a loaded model (each tensor fetched from the device when written)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    entries = []
    for slot in checkpoint_layout(model.cfg, prefix):
        value = flat[slot.path].get_value()
        dt = DTYPES[slot.hf_dtype] if slot.hf_dtype != "BF16" else np.dtype(value.dtype)
        for i, name in enumerate(slot.names):
            def produce(slot=slot, value=value, i=i, dt=dt):
                part = slot.tiled_in_memory(value[i], inverse=True) if slot.kind == "expert" else value
                return to_hf(slot if slot.kind != "expert" else dataclasses.replace(slot, kind="plain"),
                             np.asarray(jax.device_get(part)).astype(dt))[0]
            entries.append((name, slot.hf_shape, dt, produce))
    return entries


def _check_describes(model, hf_config: dict, out_dir: str, expert_format=None) -> None:
    """CheckpointError listing the fields where `hf_config` (to be saved beside the weights) does
    not describe `model.cfg`: otherwise the next load fails, or builds a different model."""
    cfg = K3Config.from_hf(hf_config, name=model.cfg.name, expert_format=expert_format).replace(
        expert_layout=model.cfg.expert_layout)            # in-memory only: config.json has no field for it
    diff = [f"{f.name}: model {getattr(model.cfg, f.name)!r}, hf_config {getattr(cfg, f.name)!r}"
            for f in dataclasses.fields(cfg) if getattr(model.cfg, f.name) != getattr(cfg, f.name)]
    if diff:
        raise CheckpointError(f"{out_dir}: hf_config does not describe the model being saved:{_listing(diff)}")


def save_hf_checkpoint(model, out_dir: str, hf_config: dict, **kw) -> str:
    """Writes a model in the Hugging Face layout of `hf_config` (K3 wrapper or kimi_linear), which
    must describe `model.cfg` (its quantization_config included)."""
    _check_describes(model, hf_config, out_dir)
    return write_hf_checkpoint(out_dir, hf_config, model_entries(model, hf_prefix(hf_config)), **kw)


# ---------------------------------------------------------------------------- synthetic
def _init_value(slot: Slot, name: str, cfg: K3Config, seed: int) -> np.ndarray:
    """Deterministic random value of one HF tensor, from (seed, tensor name) alone."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    last = slot.path[-1]
    shape = slot.hf_shape
    if slot.kind == "a_log":
        h = slot.shape[0]
        return to_hf(slot, np.log(rng.uniform(1.0, 16.0, h)).astype(np.float32))[0]
    if last in ("w1_packed", "w2_packed", "w3_packed"):
        # Quantise a Gaussian weight with the repo's MXFP4 quantiser: realistic codes and scales.
        w = rng.normal(0.0, 0.02, (shape[0], shape[1] * 2)).astype(np.float32)
        return np.asarray(_quantize_jit(w)[0])
    if last in ("w1_scale", "w2_scale", "w3_scale"):
        packed_name = name.replace("weight_scale", "weight_packed")
        rng = np.random.default_rng([seed, zlib.crc32(packed_name.encode())])
        w = rng.normal(0.0, 0.02, (shape[0], shape[1] * mxfp4.GROUP)).astype(np.float32)
        return np.asarray(_quantize_jit(w)[1])
    if last in ("q_conv1d", "k_conv1d", "v_conv1d"):
        std = 1.0 / cfg.kda_conv_size
    elif last == "dt_bias":
        std = 1.0
    elif last == "e_score_correction_bias":
        std = 0.01
    elif last in ("self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"):
        std = cfg.hidden_size ** -0.5
    elif last == "embed_tokens":
        std = 1.0
    elif last in ("o_norm", "self_attention_res_norm", "mlp_res_norm", "output_attn_res_norm") or (
            last == "weight" and "norm" in str(slot.path[-2])):
        return _draw_cast(1.0 + 0.1 * rng.standard_normal(shape), slot.hf_dtype)
    else:
        std = 0.02
    return _draw_cast(std * rng.standard_normal(shape), slot.hf_dtype)


def _draw_cast(values: np.ndarray, hf_dtype: str) -> np.ndarray:
    """float64 draws -> the tensor's dtype through float32: ml_dtypes < 0.7 rounded float64 -> bf16
    through float32 and 0.7 rounds once, so the direct cast's last bit depends on its version."""
    return values.astype(np.float32).astype(DTYPES[hf_dtype])


@jax.jit
def _quantize_jit(w):
    return mxfp4.quantize(w)


def synthetic_entries(hf_config: dict, seed: int = 0) -> list[Entry]:
    """Entries of a synthetic checkpoint: the real names, shapes, dtypes and MXFP4 packing for
    `hf_config`, values drawn per tensor from (seed, name) so any preset size streams."""
    cfg = K3Config.from_hf(hf_config)
    prefix = hf_prefix(hf_config)
    entries: list[Entry] = []
    for slot in checkpoint_layout(cfg, prefix):
        per_expert = dataclasses.replace(slot, kind="plain", shape=slot.shape[1:]) if slot.kind == "expert" else slot
        for name in slot.names:
            entries.append((name, slot.hf_shape, DTYPES[slot.hf_dtype],
                            lambda s=per_expert, n=name: _init_value(s, n, cfg, seed)))
    if prefix:  # a token vision tower and projector, so loaders exercise the skip path
        for name, shape in (("vision_tower.encoder.final_layernorm.weight", (16,)),
                            ("mm_projector.post_norm.weight", (cfg.hidden_size,))):
            entries.append((name, shape, DTYPES["BF16"],
                            lambda shape=shape: np.ones(shape, DTYPES["BF16"])))
    return entries


def synthetic_hf_config(preset: str) -> dict:
    """The preset's config.json, with the released quantization_config when experts are MXFP4."""
    from k3jax.presets import PRESETS, get_preset
    cfg = get_preset(preset)            # ConfigError naming the known presets
    hf = copy.deepcopy(PRESETS[preset])
    if cfg.expert_format == "mxfp4":
        text = hf["text_config"] if "text_config" in hf else hf
        text["quantization_config"] = copy.deepcopy(MXFP4_QUANT_CONFIG)
    return hf


def write_synthetic_checkpoint(out_dir: str, preset: str = "k3-tiny", seed: int = 0, **kw) -> str:
    """A synthetic HF checkpoint of any preset, deterministic from `seed` (streams one tensor at a time)."""
    hf = synthetic_hf_config(preset)
    return write_hf_checkpoint(out_dir, hf, synthetic_entries(hf, seed), **kw)


# -------------------------------------------------------------------------------- orbax
def save_orbax(model, out_dir: str, hf_config: dict, *, overwrite: bool = False) -> str:
    """Saves the model state with orbax plus its config.json (which must describe `model.cfg`, the
    expert format and layout aside: k3jax.json records them); atomic (temporary dir + rename)."""
    import orbax.checkpoint as ocp
    _check_describes(model, hf_config, out_dir, model.cfg.expert_format)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, "state"), nnx.state(model))
            ckptr.wait_until_finished()
        meta = {"hf_config": hf_config, "dtype": jnp.dtype(model.dtype).name,
                "expert_format": model.cfg.expert_format,
                "expert_layout": "tiles" if model.cfg.experts_in_tiles else "rows"}     # resolved: never "auto"
        if model.cfg.experts_in_tiles:
            meta["expert_tile_version"] = mxfp4.TILE_VERSION
        write_text(os.path.join(tmp, "k3jax.json"), json.dumps(meta, indent=2))
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def restore_orbax(path: str, *, sharding: ShardingSpec = None):
    """(model, hf_config) from `save_orbax`, each array restored directly onto its sharding
    (any mesh: the stored layout does not constrain it)."""
    import orbax.checkpoint as ocp
    meta_path = os.path.join(path, "k3jax.json")
    if not os.path.isfile(meta_path) or not os.path.isdir(os.path.join(path, "state")):
        raise CheckpointError(f"{path}: not a complete k3jax orbax checkpoint (needs k3jax.json and state/)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not a JSON object")
    lacking = [k for k in ("hf_config", "dtype", "expert_format") if k not in meta]
    if lacking:
        raise CheckpointError(f"{meta_path}: missing key(s) {lacking}")
    try:
        dtype = jnp.dtype(meta["dtype"])
    except TypeError:
        raise CheckpointError(f"{meta_path}: dtype {meta['dtype']!r} is not a dtype") from None
    cfg = K3Config.from_hf(meta["hf_config"], name=os.path.basename(os.path.normpath(path)),
                           expert_format=meta["expert_format"])
    # The arrays in state/ are stored as they were in memory: rows (older checkpoints) or tiles.
    cfg = cfg.replace(expert_layout=meta.get("expert_layout", "rows"))
    version = meta.get("expert_tile_version", 1)
    if cfg.experts_in_tiles and version != mxfp4.TILE_VERSION:
        raise CheckpointError(f"{path}: its MXFP4 experts are stored in tile image version {version}; this k3jax "
                              f"reads version {mxfp4.TILE_VERSION} (k3jax.mxfp4.to_tiles). Re-create it from the "
                              f"Hugging Face checkpoint: load(...) (experts in tiles by default), then save_orbax")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: _model_cls()(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(abstract)
    for p, var in flat:
        v = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=_sharding_for(sharding, p, v.shape, v.dtype)))
    target = nnx.from_flat_state(flat)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            state = ckptr.restore(os.path.join(os.path.abspath(path), "state"), target)
        except ValueError as e:  # orbax: shape or tree-structure mismatch with the abstract model
            raise CheckpointError(f"{path}: the stored arrays in state/ do not match its k3jax.json config "
                                  f"({cfg.num_hidden_layers} layers, experts {cfg.expert_format}): {e}") from None
    return nnx.merge(graphdef, state), meta["hf_config"]
