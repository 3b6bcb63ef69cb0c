"""`python -m k3jax.decode`: one real subprocess run, and the error paths in-process (each
subprocess costs ~10 s of jax import and compilation)."""

import json
import os
import subprocess
import sys

import pytest

from k3jax import decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_runs_and_writes_json(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "k3jax.decode", "--max-new-tokens", "4", "--output", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "decode tokens/s" in proc.stdout and "bytes / decode step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["model"]["name"] == "k3-tiny"
    assert len(report["tokens"]) == 1 and len(report["tokens"][0]) == 4
    assert report["decode_steps"] == 3 and report["bytes_per_decode_step"] > 0
    assert report["fallbacks"] == {} and set(report["kernels"].values()) == {"xla"}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]     # atomic write cleaned up


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("k3jax.decode: error:"), err
    for n in needles:
        assert n in err, err
    return err


def test_unknown_preset(capsys):
    with pytest.raises(SystemExit) as exc:
        decode.main(["--preset", "k4-huge"])
    assert exc.value.code == 2
    one_line_error(capsys, "k4-huge", "k3-tiny")


@pytest.mark.parametrize("argv,needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--preset", "kimi-linear-tiny", "--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated integers"),
    (["--preset", "kimi-linear-tiny", "--prompt-ids", "1,2,100000"], "outside the vocabulary"),
    (["--preset", "kimi-linear-tiny", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--preset", "k3-full"], "needs ~"),
    (["--checkpoint", "/nonexistent/dir"], "does not exist"),
    (["--processes", "2"], "--processes needs --mesh"),
    (["--processes", "0", "--mesh", "ep=2"], "--processes must be >= 1"),
])
def test_error_paths_exit_2_with_one_line(capsys, argv, needle):
    assert decode.main(argv) == 2
    one_line_error(capsys, needle)


@pytest.mark.parametrize("tool,argv,needle", [
    ("validate", ["--model", "--preset", "nope"], "neither a preset"),
    ("validate", ["--model", "--steps", "0"], "--steps and --batch must be >= 1"),
    ("validate", ["--model", "--backends", "triton"], "unknown backend"),
    ("validate", ["--op", "nope"], "unknown op 'nope'"),
    ("validate", ["--sizes", "huge"], "--sizes takes small and/or k3"),
    ("bench", ["--model", "--preset", "nope"], "neither a preset"),
    ("bench", ["--model", "--backends", "triton"], "unknown backend"),
    ("bench", ["--model", "--batches", "1,x"], "--batches must be comma-separated integers"),
    ("bench", ["--ops", "nope"], "unknown op"),
    ("bench", ["--ops", "linear", "--cases", "k3_("], "is not a regular expression"),
    ("bench", ["--report", "/nonexistent.json"], "no such result file"),
])
def test_validate_and_bench_reject_bad_input_before_running(capsys, tmp_path, tool, argv, needle):
    """Nothing is run or written: one error line, exit status 2."""
    from k3jax import bench, validate
    main = {"validate": validate.main, "bench": bench.main}[tool]
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"k3jax.{tool}: error:") and needle in err, err
    assert os.listdir(tmp_path) == []


def test_atomic_writes_keep_permissions(tmp_path):
    from k3jax import atomic
    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "r.json"
    atomic.write_json(str(path), {"a": 1})
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask          # as open() would create it
    path.chmod(0o640)
    atomic.write_json(str(path), {"a": 2})
    assert path.stat().st_mode & 0o777 == 0o640 and json.loads(path.read_text()) == {"a": 2}


def test_every_tool_lets_xla_take_most_of_the_gpu(monkeypatch):
    """run_cli (every tool's entry) raises XLA's GPU memory fraction before any device use
    (k3-h200's parity run ran out of memory at the default 75%), unless the caller set one."""
    from k3jax.cli import run_cli
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    seen = []
    assert run_cli("t", lambda: seen.append(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) or 0) == 0
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    run_cli("t", lambda: seen.append(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) or 0)
    assert seen == ["0.94", "0.5"]


def test_decode_stops_at_the_models_eos_unless_ignored():
    """A checkpoint's eos_token_id ends a sequence by default; config.json may list several ids,
    and every one is kept."""
    import copy

    from k3jax.config import K3Config
    from k3jax.presets import PRESETS, get_preset
    cfg = get_preset("k3-full")
    parse = decode.build_parser().parse_args
    assert decode.stop_tokens(parse([]), cfg) == [163586]
    assert decode.stop_tokens(parse(["--stop-token", "7", "--stop-token", "163586"]), cfg) == [7, 163586]
    assert decode.stop_tokens(parse(["--ignore-eos", "--stop-token", "7"]), cfg) == [7]
    assert decode.stop_tokens(parse([]), get_preset("k3-tiny")) == []
    assert decode.pad_id(cfg) == 163839 and decode.pad_id(get_preset("k3-tiny")) == 0     # after a stop
    hf = copy.deepcopy(PRESETS["k3-full"])
    hf["text_config"]["eos_token_id"] = [163586, 163585]
    assert K3Config.from_hf(hf).eos_token_ids == (163586, 163585)
