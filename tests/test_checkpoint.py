"""Checkpoint loading/writing: synthetic round trips, strict validation, orbax, tokenizer,
and parity with third-party implementations (fixtures from checkpoints/make_parity_fixtures.py)."""

import base64
import json
import logging
import os
import re
import shutil
import struct

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import k3jax
from k3jax import checkpoint as ckpt
from k3jax.safetensors_io import SafetensorsError, SafetensorsFile, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "checkpoints", "fixtures")
TINY = os.path.join(ROOT, "checkpoints", "k3-tiny")


def load(path, **kw):
    return ckpt.load_hf_checkpoint(path, progress=False, **kw)


def max_rel_err(got, ref):
    """max |got - ref| / max |ref| (the scale of the logits)."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------ third-party parity
@pytest.mark.parametrize("name", ["kimi_linear", "k3"])
def test_parity_with_third_party(name):
    """kimi_linear: HF transformers; k3: Moonshot's K3 modeling (MindSpeed-MM copy)."""
    d = os.path.join(FIXTURES, name)
    exp = np.load(os.path.join(d, "expected.npz"))
    model = k3jax.from_pretrained(d, dtype="float32")
    assert model.cfg.expert_format == ("mxfp4" if name == "k3" else "bf16")
    logits = np.asarray(model(exp["input_ids"]))
    assert max_rel_err(logits, exp["logits"]) < 1e-4
    np.testing.assert_array_equal(logits.argmax(-1), exp["logits"].argmax(-1))
    greedy = np.asarray(k3jax.generate(model, exp["prompt"], max_new_tokens=exp["greedy"].shape[1]))
    np.testing.assert_array_equal(greedy, exp["greedy"])


def test_k3_fixture_is_released_layout():
    st = SafetensorsFile(os.path.join(FIXTURES, "k3", "model.safetensors"))
    info = st.info("language_model.model.layers.0.self_attn.A_log")
    assert (info.dtype, info.shape) == ("F32", (128,))
    packed = st.info("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
    assert packed.dtype == "U8"
    assert st.info("language_model.model.layers.0.self_attn.q_conv1d.weight").shape[1] == 1
    model = load(os.path.join(FIXTURES, "k3"))
    assert model.layers[1].block_sparse_moe.experts.w1_packed[...].dtype == np.uint8  # no dequantisation


# ------------------------------------------------------------------ synthetic + round trips
def test_committed_tiny_checkpoint_matches_writer(tmp_path):
    """checkpoints/k3-tiny is exactly what the synthetic writer makes for (k3-tiny, seed 0)."""
    out = ckpt.write_synthetic_checkpoint(str(tmp_path / "t"), "k3-tiny", seed=0)
    a, b = SafetensorsFile(os.path.join(out, "model.safetensors")), SafetensorsFile(os.path.join(TINY, "model.safetensors"))
    assert sorted(a.keys()) == sorted(b.keys())
    for k in a.keys():
        np.testing.assert_array_equal(a.read(k), b.read(k), err_msg=k)


@pytest.mark.parametrize("preset", ["k3-tiny", "kimi-linear-tiny"])
def test_synthetic_sharded_roundtrip(tmp_path, preset):
    src = ckpt.write_synthetic_checkpoint(str(tmp_path / "src"), preset, seed=3, max_shard_bytes=200_000)
    assert os.path.isfile(os.path.join(src, ckpt.INDEX_FILE))
    model = load(src)
    out = ckpt.save_hf_checkpoint(model, str(tmp_path / "out"), ckpt.read_hf_config(src))
    a, b = ckpt.TensorIndex(src), ckpt.TensorIndex(out)
    text = [n for n in a.where if not n.startswith(ckpt.SKIPPED_ROOTS)]
    assert sorted(text) == sorted(b.where)
    for n in text:
        assert a.dtype(n) == b.dtype(n) and a.shape(n) == b.shape(n), n
        np.testing.assert_array_equal(a.read(n), b.read(n), err_msg=n)


def test_synthetic_is_deterministic_and_seeded(tmp_path):
    e1 = {n: p() for n, _, _, p in ckpt.synthetic_entries(ckpt.synthetic_hf_config("k3-tiny"), 1)[:6]}
    e2 = {n: p() for n, _, _, p in ckpt.synthetic_entries(ckpt.synthetic_hf_config("k3-tiny"), 1)[:6]}
    e3 = {n: p() for n, _, _, p in ckpt.synthetic_entries(ckpt.synthetic_hf_config("k3-tiny"), 2)[:6]}
    for n in e1:
        np.testing.assert_array_equal(e1[n], e2[n])
    assert any(not np.array_equal(e1[n], e3[n]) for n in e1)


@pytest.mark.slow
def test_load_onto_expert_parallel_mesh():
    mesh = Mesh(np.array(jax.devices()), ("ep",))

    def rule(path, shape, dtype):
        return NamedSharding(mesh, PartitionSpec("ep") if "experts" in path else PartitionSpec())

    model, ref = load(TINY, sharding=rule), load(TINY)
    w = model.layers[1].block_sparse_moe.experts.w1_packed[...]
    assert w.sharding.spec == PartitionSpec("ep")
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref.layers[1].block_sparse_moe.experts.w1_packed[...]))
    ids = np.arange(1, 9)[None]
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(ref(ids)))


@pytest.mark.slow
def test_orbax_roundtrip_and_cli(tmp_path):
    from k3jax.convert import main
    orb, hf = str(tmp_path / "orb"), str(tmp_path / "hf")
    assert main(["hf-to-orbax", TINY, orb]) == 0
    assert main(["hf-to-orbax", TINY, orb]) == 2            # exists, no --overwrite
    assert main(["orbax-to-hf", orb, hf]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert all(os.stat(d).st_mode & 0o777 == 0o777 & ~umask for d in (orb, hf))     # not mkdtemp's 0700
    a, b = ckpt.TensorIndex(TINY), ckpt.TensorIndex(hf)
    for n in b.where:
        np.testing.assert_array_equal(a.read(n), b.read(n), err_msg=n)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    model, _ = ckpt.restore_orbax(orb, sharding=lambda p, s, d: NamedSharding(
        mesh, PartitionSpec("ep") if "experts" in p else PartitionSpec()))
    assert model.layers[1].block_sparse_moe.experts.w2_scale[...].sharding.spec == PartitionSpec("ep")
    ids = np.arange(1, 7)[None]
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(load(TINY)(ids)))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    meta_path = os.path.join(orb, "k3jax.json")
    meta = json.load(open(meta_path))
    assert "expert_tile_version" not in meta                # experts in rows
    meta["hf_config"]["text_config"]["vocab_size"] += 64
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ckpt.CheckpointError, match=r"stored arrays in state/ do not match its k3jax.json "
                       r"config .*Requested shape: \(576, 64\)"):
        ckpt.restore_orbax(orb)


@pytest.mark.parametrize("text, match", [
    ("{\"hf_config\": {", "k3jax.json: not valid JSON"),
    ("[]", "k3jax.json: not a JSON object"),
    ('{"hf_config": {}, "dtype": "bfloat16"}', r"k3jax.json: missing key\(s\) \['expert_format'\]"),
    ('{"hf_config": {}, "dtype": "bf17", "expert_format": "bf16"}', "k3jax.json: dtype 'bf17' is not a dtype"),
])
def test_restore_orbax_malformed_metadata(tmp_path, text, match):
    os.makedirs(tmp_path / "orb" / "state")
    (tmp_path / "orb" / "k3jax.json").write_text(text)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.restore_orbax(str(tmp_path / "orb"))


def test_save_refuses_a_config_that_does_not_describe_the_model(tmp_path):
    model, hf = load(TINY), ckpt.read_hf_config(TINY)
    eps = json.loads(json.dumps(hf))
    eps["text_config"]["rms_norm_eps"] = 3e-6
    bf16 = json.loads(json.dumps(hf))
    del bf16["text_config"]["quantization_config"]          # the model holds MXFP4 experts
    with pytest.raises(ckpt.CheckpointError, match=r"does not describe the model being saved:\n"
                       r"  rms_norm_eps: model 1e-05, hf_config 3e-06$"):
        ckpt.save_hf_checkpoint(model, str(tmp_path / "a"), eps)
    with pytest.raises(ckpt.CheckpointError, match="expert_format: model 'mxfp4', hf_config 'bf16'"):
        ckpt.save_hf_checkpoint(model, str(tmp_path / "b"), bf16)
    with pytest.raises(ckpt.CheckpointError, match="rms_norm_eps: model 1e-05, hf_config 3e-06"):
        ckpt.save_orbax(model, str(tmp_path / "c"), eps)
    assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    d = ckpt.write_synthetic_checkpoint(str(tmp_path / "d"), "k3-tiny", seed=1)
    old = ckpt.TensorIndex(d)
    before = {n: np.array(old.read(n)) for n in old.where}
    rename = os.rename

    def failing_rename(src, dst):
        if ".tmp-" in os.path.basename(src):
            raise OSError("rename failed")
        rename(src, dst)
    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="rename failed"):
        ckpt.write_synthetic_checkpoint(d, "k3-tiny", seed=2, overwrite=True)
    assert os.listdir(tmp_path) == ["d"]                    # no .old-* or .tmp-* left behind
    after = ckpt.TensorIndex(d)
    assert sorted(after.where) == sorted(before)
    for n, v in before.items():
        np.testing.assert_array_equal(after.read(n), v, err_msg=n)
    monkeypatch.setattr(os, "rename", rename)
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    out = ckpt.write_synthetic_checkpoint(str(tmp_path / "s"), "k3-tiny", max_shard_bytes=300_000)
    shards = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert len(synced) == len(shards) + 2                   # every shard, the index and config.json


def test_interrupted_write_leaves_nothing(tmp_path):
    entries = ckpt.synthetic_entries(ckpt.synthetic_hf_config("k3-tiny"), 0)

    def boom():
        raise KeyboardInterrupt
    entries[10] = (entries[10][0], entries[10][1], entries[10][2], boom)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_hf_checkpoint(str(tmp_path / "x"), {}, entries)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ strict validation
@pytest.fixture
def copy_tiny(tmp_path):
    def make(shard_bytes=None):
        d = tmp_path / "c"
        if shard_bytes:
            return ckpt.write_synthetic_checkpoint(str(d), "k3-tiny", seed=0, max_shard_bytes=shard_bytes)
        shutil.copytree(TINY, d)
        return str(d)
    return make


def _rewrite(path, drop=(), change=None):
    st = SafetensorsFile(path)
    tensors = {k: np.array(st.read(k)) for k in st.keys() if k not in drop}
    if change:
        tensors.update(change)
    os.remove(path)
    save_file(path, tensors)


def test_missing_and_unexpected_listed(copy_tiny):
    d = copy_tiny()
    f = os.path.join(d, "model.safetensors")
    gone = "language_model.model.layers.2.self_attn.k_proj.weight"
    _rewrite(f, drop=[gone], change={"language_model.model.layers.2.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ckpt.CheckpointError) as e:
        load(d)
    assert "1 missing tensor(s)" in str(e.value) and gone in str(e.value)
    assert "1 unexpected tensor(s)" in str(e.value) and "layers.2.extra.weight" in str(e.value)


def test_wrong_shape_and_dtype(copy_tiny):
    d = copy_tiny()
    f = os.path.join(d, "model.safetensors")
    st = SafetensorsFile(f)
    n1 = "language_model.model.layers.2.self_attn.o_proj.weight"
    n2 = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    _rewrite(f, change={n1: np.zeros((64, 63), np.float32),
                        n2: np.array(st.read(n2)).astype(np.float32)})
    with pytest.raises(ckpt.CheckpointError) as e:
        load(d)
    msg = str(e.value)
    assert f"{n1}: wrong shape: expected [64, 64], got [64, 63]" in msg
    assert f"{n2}: wrong dtype: expected U8" in msg and "got F32" in msg


def test_scale_codes_outside_the_kernels_exact_range_warn(copy_tiny, caplog):
    from k3jax.mxfp4 import DECODE_EXACT_SCALES as EXACT_SCALES
    with caplog.at_level(logging.WARNING, logger="k3jax.checkpoint"):
        load(TINY)
    assert "scale codes" not in caplog.text
    d = copy_tiny()
    f = os.path.join(d, "model.safetensors")
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    scale = np.array(SafetensorsFile(f).read(name))
    scale.flat[5] = EXACT_SCALES[1] + 1
    _rewrite(f, change={name: scale})
    with caplog.at_level(logging.WARNING, logger="k3jax.checkpoint"):
        load(d)
    assert f"span {int(scale.min())}..{EXACT_SCALES[1] + 1}" in caplog.text and "--backend xla" in caplog.text


def test_config_weights_mismatch(copy_tiny):
    d = copy_tiny()
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["text_config"]["num_hidden_layers"] = 8
    la = cfg["text_config"]["linear_attn_config"]
    la["full_attn_layers"], la["kda_layers"] = [4, 8], [1, 2, 3, 5, 6, 7]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ckpt.CheckpointError, match="layers up to 8 but config.json num_hidden_layers is 8"):
        load(d)
    with pytest.raises(ckpt.CheckpointError, match="holds MXFP4 experts") as e:
        load(TINY, expert_format="bf16")
    assert "\n" not in str(e.value) and "missing" in str(e.value)      # one line, with the counts


def test_truncated_and_corrupt_files(copy_tiny, tmp_path):
    d = copy_tiny()
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 100)
    with pytest.raises(SafetensorsError, match="truncated: tensor"):
        load(d)
    with open(f, "r+b") as fh:
        fh.truncate(5)
    with pytest.raises(SafetensorsError, match="shorter than the 8-byte header"):
        load(d)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"{xx}")
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        SafetensorsFile(str(bad))
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(hdr)) + hdr + bytes(12))
    with pytest.raises(SafetensorsError, match="overlaps"):
        SafetensorsFile(str(bad))


@pytest.mark.parametrize("entry, match", [
    ({"dtype": "F32", "shape": [2], "data_offsets": None}, "data_offsets None, not two non-negative integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, r"data_offsets \['0', '8'\], not two"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}, "not two non-negative integers"),
    ({"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}, r"shape \[2.7\], not a list of non-negative"),
    ({"dtype": "F32", "shape": ["12"], "data_offsets": [0, 8]}, r"shape \['12'\], not a list"),
    ({"dtype": "F32", "shape": "12", "data_offsets": [0, 8]}, "shape '12', not a list"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, r"unsupported dtype \['F32'\]"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "truncated: tensor 'a' ends at data byte 16 but"),
    ("F32", "bad header entry for tensor 'a'"),
])
def test_malformed_header_entries(tmp_path, entry, match):
    bad = str(tmp_path / "bad.safetensors")
    hdr = json.dumps({"a": entry}).encode()
    with open(bad, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr + np.random.default_rng(0).standard_normal(2).astype("<f4").tobytes())
    with pytest.raises(SafetensorsError, match=f"{re.escape(bad)}: .*{match}"):
        SafetensorsFile(bad)
    with open(bad, "wb") as f:
        f.write(struct.pack("<Q", 4) + b"[12]")
    with pytest.raises(SafetensorsError, match=f"{re.escape(bad)}: corrupt: header JSON is not an object"):
        SafetensorsFile(bad)


def test_sharded_index_must_cover_the_shards(copy_tiny, monkeypatch):
    d = copy_tiny(shard_bytes=300_000)
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[1]
    extra = "language_model.model.layers.2.extra.weight"
    _rewrite(os.path.join(d, shard), change={extra: np.random.default_rng(0).standard_normal(3).astype(np.float32)})
    save_file(os.path.join(d, "stray.safetensors"), {"x": np.random.default_rng(1).standard_normal(2)})
    with monkeypatch.context() as m:                        # headers only: no tensor data is read
        m.setattr(SafetensorsFile, "read", lambda *a: pytest.fail("read a tensor"))
        index = ckpt.TensorIndex(d)
    assert index.unindexed == {extra: shard} and index.unnamed_files == ["stray.safetensors"]
    with pytest.raises(ckpt.CheckpointError) as e:
        load(d)
    assert f"1 tensor(s) in shards but not in {ckpt.INDEX_FILE}" in str(e.value)
    assert f"{extra} (in {shard})" in str(e.value)
    assert f"1 *.safetensors file(s) that {ckpt.INDEX_FILE} does not name:\n  stray.safetensors" in str(e.value)


def test_malformed_index(copy_tiny):
    d = copy_tiny(shard_bytes=300_000)
    index_path = os.path.join(d, ckpt.INDEX_FILE)
    index = json.load(open(index_path))
    first, second = sorted(set(index["weight_map"].values()))[:2]
    moved = next(n for n, f in index["weight_map"].items() if f == first)
    for weight_map, match in [({**index["weight_map"], moved: second},
                               f"in '{second}' but that file does not hold them:\n  {moved}"),
                              (list(index["weight_map"]), "weight_map must be an object"),
                              ({moved: 3}, f"weight_map\\['{moved}'\\] must be a file name, got 3")]:
        json.dump({**index, "weight_map": weight_map}, open(index_path, "w"))
        with pytest.raises(ckpt.CheckpointError, match=match):
            load(d)


def test_index_points_at_missing_shard(copy_tiny):
    d = copy_tiny(shard_bytes=300_000)
    shard = sorted(f for f in os.listdir(d) if f.startswith("model-"))[1]
    os.remove(os.path.join(d, shard))
    with pytest.raises(ckpt.CheckpointError, match=f"points at missing shard '{shard}'"):
        load(d)


# ------------------------------------------------------------------ tokenizer + CLI
def test_decode_cli_with_checkpoint_and_tiktoken(tmp_path, capsys):
    pytest.importorskip("tiktoken")
    from k3jax.decode import main
    from k3jax.tokenizer import TiktokenTokenizer, tokenizer_for
    d = tmp_path / "ck"
    shutil.copytree(TINY, d)
    assert tokenizer_for(str(d), 512).name == "byte-level fallback"
    # A tiny BPE ranks file: the 256 bytes plus two merges.
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = tokenizer_for(str(d), 512)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.encode("the") == [257] and tok.decode([257, 32]) == "the "
    two_specials = TiktokenTokenizer(str(d / "tiktoken.model"), 260)       # ids 260+ are not in it
    assert two_specials.decode([257, 300, 32]) == "the<300> "
    assert main(["--checkpoint", str(d), "--prompt", "the cat", "--max-new-tokens", "3", "--quiet",
                 "--output", str(tmp_path / "r.json")]) == 0
    report = json.load(open(tmp_path / "r.json"))
    assert report["tokenizer"] == "tiktoken (Kimi)" and report["prompts"][0][0] == 257
    assert main(["--checkpoint", str(tmp_path / "nope")]) == 2


def test_tiled_expert_layout_loads_saves_and_restores(tmp_path):
    """Experts in tiles (the default where the widths are multiples of 128): the checkpoint keeps
    row order on disk, memory holds mxfp4.to_tiles' order, and the model computes the same logits
    as with expert_layout="rows"; HF save and orbax save/restore round-trip."""
    from k3jax import mxfp4
    hf = ckpt.synthetic_hf_config("k3-tiny")
    hf["text_config"].update(moe_intermediate_size=128, routed_expert_hidden_size=128)
    src = ckpt.write_hf_checkpoint(str(tmp_path / "src"), hf, ckpt.synthetic_entries(hf, 5))
    rows, tiles = load(src, dtype="float32", expert_layout="rows"), load(src, dtype="float32")
    assert tiles.cfg.experts_in_tiles and not rows.cfg.experts_in_tiles
    a, b = rows.layers[1].block_sparse_moe.experts, tiles.layers[1].block_sparse_moe.experts
    np.testing.assert_array_equal(np.asarray(b.w2_packed[...]), np.asarray(mxfp4.to_tiles(a.w2_packed[...])))
    np.testing.assert_array_equal(np.asarray(b.w1_scale[...]), np.asarray(mxfp4.to_tiles(a.w1_scale[...], scales=True)))
    ids = np.arange(1, 7)[None]
    # float32: the reference sums each tile's columns in another order than a row's
    want = np.asarray(rows(ids))
    np.testing.assert_allclose(np.asarray(tiles(ids)), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    out = ckpt.save_hf_checkpoint(tiles, str(tmp_path / "out"), hf)
    x, y = ckpt.TensorIndex(src), ckpt.TensorIndex(out)
    for n in y.where:
        np.testing.assert_array_equal(x.read(n), y.read(n), err_msg=n)
    orb = ckpt.save_orbax(tiles, str(tmp_path / "orb"), hf)
    restored, _ = ckpt.restore_orbax(orb)
    assert restored.cfg.expert_layout == "tiles"
    np.testing.assert_array_equal(np.asarray(restored(ids)), np.asarray(tiles(ids)))
    meta_path = os.path.join(orb, "k3jax.json")
    meta = json.load(open(meta_path))
    assert meta["expert_tile_version"] == mxfp4.TILE_VERSION
    for older in (2, None):                     # before tile words placed their bits; before pair order (no key)
        meta.pop("expert_tile_version", None)
        if older:
            meta["expert_tile_version"] = older
        json.dump(meta, open(meta_path, "w"))
        with pytest.raises(ckpt.CheckpointError, match=f"stored in tile image version {older or 1}; this k3jax reads version 3"):
            ckpt.restore_orbax(orb)
    # a model in rows records them; an older checkpoint without the key restores as rows too
    orb_rows = ckpt.save_orbax(rows, str(tmp_path / "orb_rows"), hf)
    meta_path = os.path.join(orb_rows, "k3jax.json")
    meta = json.load(open(meta_path))
    assert meta["expert_layout"] == "rows" and "expert_tile_version" not in meta
    del meta["expert_layout"]
    json.dump(meta, open(meta_path, "w"))
    restored, _ = ckpt.restore_orbax(orb_rows)
    assert restored.cfg.expert_layout == "rows"
    np.testing.assert_array_equal(np.asarray(restored(ids)), np.asarray(rows(ids)))
