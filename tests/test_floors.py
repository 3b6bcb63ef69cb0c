"""benchmarks/floors.py: the ceilings benchmark runs, checks its outputs and names bad input."""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mgpu

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "floors.py"
_SPEC = importlib.util.spec_from_file_location("floors", _PATH)
floors = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(floors)


def test_slab_copy_moves_every_slab_unchanged():
    state = jax.random.normal(jax.random.key(1), (2, 3, 64, 64), jnp.float32)
    with mgpu.race_detection():
        _copies_unchanged(state)
        assert not mgpu.races_found()


def _copies_unchanged(state):
    for splits in (1, 2, 4):
        out = jax.jit(lambda s, splits=splits: floors.slab_copy(s, splits))(state)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(state))
    # Persistent programs: fewer items than slots, several rounds of the slots, a ragged last round.
    for splits, programs in ((1, 6), (2, 1), (4, 5)):
        out = jax.jit(lambda s, splits=splits, programs=programs: floors.persistent_slab_copy(s, splits, programs))(state)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(state))


def test_copies_export_for_cuda_at_k3_sizes():
    state = jax.ShapeDtypeStruct((1, 96, 128, 128), jnp.float32)
    with mgpu.compile_for_gpu():
        jax.export.export(jax.jit(lambda s: floors.slab_copy(s, 4)), platforms=["cuda"])(state)
        jax.export.export(jax.jit(lambda s: floors.persistent_slab_copy(s, 4, 132)), platforms=["cuda"])(state)


def test_rows_cover_every_measurement():
    rows = floors.measure([1, 3], heads=2, head_dim=64, weight_mib=(1,), rounds=1, log=lambda _: None)
    names = [r["name"] for r in rows]
    # Two (sequence, head) pairs are fewer than the SMs: `plan` gives 4 splits, the only slab row per batch.
    assert names == ["state_update_b1", "state_slabs_b1_s4", "state_slabs_persistent_b1_s4",
                     "state_update_b3", "state_slabs_b3_s4", "state_slabs_persistent_b3_s4",
                     "weight_read_1MiB", "smallest_kernel"]
    assert rows[0]["bytes"] == 2 * 4 * 2 * 64 * 64
    assert all(r["device_s"] > 0 and r["frac_copy_bw"] > 0 for r in rows)


def test_mla_tensor_ceilings_at_k3_shapes():
    kernel, seesaw, heads_n, unpadded = floors.mla_tensor_ceilings(heads=96, latent=512, rope=64)
    # 96 heads padded to 128, scores in both consumers: 2.04x the useful MMA work (mla_decode's doc).
    assert kernel["mma_flops_per_tile"] / unpadded["mma_flops_per_tile"] == 2 * (2 * 576 + 512) / (96 / 64 * 1088)
    assert unpadded["mma_flops_per_tile"] == 2 * 64 * 96 * (576 + 512)
    # heads_n: unpadded scores, the weighted sum over 2 groups of 64 rows.
    assert heads_n["mma_flops_per_tile"] == 2 * 64 * (96 * 576 + 128 * 512)
    # At the H200's spec peak the kernel's schedule cannot reach 70% of the byte roofline; the others can.
    assert kernel["max_frac_roofline"] < 0.7 < seesaw["max_frac_roofline"] <= unpadded["max_frac_roofline"] == 1.0
    assert kernel["efficiency_for_70pct"] > 1 > seesaw["efficiency_for_70pct"] > unpadded["efficiency_for_70pct"]
    # SMEM operand bytes a tile, 2 groups x 2 consumers x: heads_m q block + latent tile + C half;
    # heads_n latent tile + 24 q rows + p [64, 64] + C half; its p^T form latent tile + 24 q rows
    # + C half + p^T per M group.
    assert kernel["smem_operand_bytes_per_tile"] == 2 * 2 * (64 * 576 + 64 * 576 + 64 * 256) * 2
    assert heads_n["smem_operand_bytes_per_tile"] == 2 * 2 * (64 * 576 + 24 * 576 + 64 * 64 + 64 * 256) * 2
    assert unpadded["smem_operand_bytes_per_tile"] == 2 * 2 * (64 * 576 + 24 * 576 + 256 * 64 + 4 * 64 * 48) * 2
    # heads_m is bound by its MMAs (62%), both heads_n forms by their SMEM reads, higher (93%, 83.5%).
    assert kernel["max_frac_roofline_both"] == kernel["max_frac_roofline"] < kernel["max_frac_roofline_smem"]
    for form in (heads_n, unpadded):
        assert form["max_frac_roofline_both"] == form["max_frac_roofline_smem"] < form["max_frac_roofline"]
    assert kernel["max_frac_roofline_both"] < 0.65 and 0.8 < unpadded["max_frac_roofline_both"] < 0.85
    assert 0.9 < heads_n["max_frac_roofline_both"] < 0.95


def test_writes_json_and_names_bad_input(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(floors, "WEIGHT_MIB", (1,))
    monkeypatch.setattr(floors, "measure", lambda b, h, d, w, r: [{"name": "x", "b": b, "h": h, "d": d, "w": w}])
    out = tmp_path / "f.json"
    assert floors.main(["--batches", "2", "--rounds", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["preset"] == "k3-h200"
    ceilings = len(floors.mla_tensor_ceilings(96, 512, 64))
    assert [r["name"].split(":")[0] for r in data["rows"][:ceilings]] == ["mla_tensor_ceiling"] * ceilings
    assert data["rows"][ceilings:] == [{"name": "x", "b": [2], "h": 96, "d": 128, "w": [1]}]
    assert floors.main(["--batches", "1,x"]) == 2
    assert "--batches must be comma-separated integers" in capsys.readouterr().err
    assert floors.main(["--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert floors.main(["--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
