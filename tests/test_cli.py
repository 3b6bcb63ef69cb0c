"""`python -m k3jax.decode`: one real subprocess run, and the error paths in-process (each
subprocess costs ~10 s of jax import and compilation)."""

import json
import os
import subprocess
import sys

import pytest

from k3jax import decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
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
    (["--checkpoint", "k3-small"], "checkpoint 'k3-small' does not exist"),      # a preset name is no directory
    (["--checkpoint", __file__], "is a file, not a checkpoint directory"),
    (["--processes", "2"], "--processes needs --mesh"),
    (["--processes", "0", "--mesh", "ep=2"], "--processes must be >= 1"),
    (["--experts", "mxfp4-tiles"], "moe_hidden_size: must be a multiple of 128 for expert_layout='tiles'"),
])
def test_error_paths_exit_2_with_one_line(capsys, argv, needle):
    assert decode.main(argv) == 2
    one_line_error(capsys, needle)


def test_preset_flag_never_reads_a_folder_of_that_name(monkeypatch, tmp_path):
    """A directory named like the preset (checkpoints/k3-tiny) does not stand in for it."""
    from k3jax.presets import get_preset
    from k3jax.weights import config_of
    (tmp_path / "k3-tiny").mkdir()                      # empty: reading it would fail
    monkeypatch.chdir(tmp_path)
    assert decode.model_source(decode.build_parser().parse_args([])) == ("k3-tiny", "preset")
    assert config_of("k3-tiny", source="preset") == get_preset("k3-tiny")
    with pytest.raises(Exception, match="no config.json"):
        config_of("k3-tiny")                            # the API's "auto": an existing directory wins


def test_convert_names_its_flags_and_presets(capsys, tmp_path):
    from k3jax.convert import main
    for argv, needle in ((["synthetic", str(tmp_path / "a"), "--preset", "k3-nope"], "unknown preset 'k3-nope'"),
                         (["synthetic", str(tmp_path), "--preset", "k3-tiny"], "exists; pass --overwrite to replace it"),
                         (["hf-to-orbax", str(tmp_path / "missing"), str(tmp_path / "b")],
                          f"checkpoint {str(tmp_path / 'missing')!r} does not exist"),
                         (["synthetic", str(tmp_path / "a"), "--max-shard-gb", "0"], "--max-shard-gb must be >= 0.001"),
                         (["synthetic", str(tmp_path / "a"), "--seed", "-1"], "--seed must be >= 0"),
                         (["synthetic", str(tmp_path / "f" / "a")], "is a file, not a folder")):
        (tmp_path / "f").write_text("")
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("k3jax.convert: error:") and needle in err, err
        (tmp_path / "f").unlink()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tool,argv,needle", [
    ("validate", ["--model", "--preset", "nope"], "neither a preset"),
    ("validate", ["--model", "--steps", "0"], "--steps and --batch must be >= 1"),
    ("validate", ["--model", "--backends", "triton"], "unknown backend"),
    ("validate", ["--op", "nope"], "unknown op(s) ['nope']"),
    ("validate", ["--sizes", "huge"], "--sizes takes small and/or k3"),
    ("bench", ["--model", "--preset", "nope"], "neither a preset"),
    ("bench", ["--model", "--backends", "triton"], "unknown backend"),
    ("bench", ["--model", "--batches", "1,x"], "--batches must be comma-separated integers"),
    ("bench", ["--ops", "nope"], "unknown op"),
    ("bench", ["--ops", "linear", "--cases", "k3_("], "is not a regular expression"),
    ("bench", ["--report", "/nonexistent.json"], "no such result file"),
    ("validate", ["--repeats", "0"], "--repeats must be >= 1"),
    ("validate", ["--budget-s", "-1"], "--budget-s must be >= 0"),
    ("validate", ["--op", "linear", "--op", "bogus"], "unknown op(s) ['bogus']"),
    ("validate", ["--model", "--experts", "mxfp4-tiles"], "multiple of 128 for expert_layout='tiles'"),
    ("bench", ["--model", "--steps", "0"], "--steps must be >= 1"),
    ("bench", ["--model", "--warmup", "-1"], "--warmup must be >= 0"),
    ("bench", ["--model", "--budget-s", "nan"], "--budget-s must be >= 0"),
    ("bench", ["--model", "--dtype", "fp16"], "unknown dtype 'fp16'"),
    ("bench", ["--model", "--expert-formats", "mxfp4,mxfp5"], "unknown --expert-formats ['mxfp5']"),
    ("bench", ["--model", "--mesh", "ep=16"], "needs 16 devices"),
    ("profile", ["--ep-variant", "a2a"], "--ep-variant a2a needs --mesh"),
    ("profile", ["--steps", "0"], "--steps must be >= 1"),
])
def test_validate_and_bench_reject_bad_input_before_running(capsys, tmp_path, tool, argv, needle):
    """Nothing is run or written: one error line, exit status 2."""
    from k3jax import bench, profile, validate
    main = {"validate": validate.main, "bench": bench.main, "profile": profile.main}[tool]
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"k3jax.{tool}: error:") and needle in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tool", ["decode", "validate", "bench", "profile", "convert"])
def test_flag_errors_are_one_line(capsys, tmp_path, tool):
    """A malformed flag (argparse's own error) is one line naming it, exit status 2, no usage dump;
    an --out that is a directory is refused before any work."""
    import importlib
    main = importlib.import_module(f"k3jax.{tool}").main
    with pytest.raises(SystemExit) as exc:
        main(["synthetic", "--seed", "x"] if tool == "convert" else ["--steps" if tool != "decode" else "--seed", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"k3jax.{tool}: error:") and "invalid int value: 'x'" in err, err
    if tool in ("validate", "bench", "profile"):
        out = str(tmp_path) + ("/r" if tool == "validate" else "")          # validate's --out is a prefix
        os.mkdir(out + ".json") if tool == "validate" else None
        argv = {"validate": [], "bench": ["--model"], "profile": []}[tool]
        assert main(argv + ["--out", out]) == 2
        assert "is a directory" in capsys.readouterr().err.strip().splitlines()[-1]


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


@pytest.mark.parametrize("argv,needle", [
    (["--top-k", "1000", "--temperature", "1"], "top_k (1000) exceeds the vocabulary size (512)"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--stop-token", "3000000000"], "stop token id(s) [3000000000] outside the vocabulary [0, 512)"),
    (["--ep-variant", "a2a"], "--ep-variant a2a needs --mesh"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "2000000"], "exceeds max_position_embeddings"),
    (["--output", "{tmp}"], "is a directory"),
    (["--output", "{tmp}/file.json/run.json"], "is a file, not a folder"),
    (["--prompt-ids", "1,,2"], "--prompt-ids must be comma-separated integers, got '1,,2'"),
    (["--mesh", "ep=8", "--ep-variant", "ragged"], "--ep-variant ragged cannot run here: ragged_all_to_all"),
    (["--mesh", "ep=8", "--ep-variant", "device"], "--ep-variant device cannot run here"),
    (["--seed", str(2 ** 64)], "seed must be"),
    (["--batch-size", "100000000"], "decode state for batch 100000000"),        # before expanding the prompts
])
def test_request_errors_come_before_the_weights(monkeypatch, capsys, tmp_path, argv, needle):
    """What can be checked from the config, prompts and flags fails before any weight is built."""
    import k3jax
    (tmp_path / "file.json").write_text("{}")
    monkeypatch.setattr(k3jax, "from_pretrained", lambda *a, **k: pytest.fail("weights built before the checks"))
    assert decode.main([a.format(tmp=tmp_path) for a in argv]) == 2
    one_line_error(capsys, needle)


def test_request_checks_do_not_start_jax():
    """decode --processes N checks the request in the launcher, which must not start a jax backend
    (on a GPU it would take the memory its processes need; jax.distributed must come first)."""
    code = ("from k3jax import decode; import jax._src.xla_bridge as xb; "
            "decode.prepare(decode.build_parser().parse_args(['--prompt', 'hi', '--stop-token', '7'])); "
            "assert not xb._backends, 'a jax backend was started'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_sampling_flags_at_temperature_0_are_named(monkeypatch, capsys):
    """--top-k / --top-p do nothing when decoding greedily: the run says so instead of ignoring them."""
    import k3jax
    monkeypatch.setattr(k3jax, "from_pretrained", lambda *a, **k: (_ for _ in ()).throw(ValueError("stop here")))
    assert decode.main(["--top-k", "5"]) == 2
    assert "--top-k / --top-p have no effect at --temperature 0" in capsys.readouterr().err


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


def test_torch_reference_shows_help_and_names_its_install_without_torch(monkeypatch, capsys):
    import importlib.util
    monkeypatch.setitem(sys.modules, "torch", None)         # as on a machine without the torch extra
    spec = importlib.util.spec_from_file_location("torch_reference", os.path.join(ROOT, "benchmarks", "torch_reference.py"))
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    with pytest.raises(SystemExit) as exc:
        ref.main(["--help"])
    assert exc.value.code == 0 and "--model" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="bash scripts/setup.sh torch"):
        ref.main(["--ops"])


def test_spawned_processes_refusing_the_same_input_print_one_line(capfd):
    """`decode --processes N`: every process refuses the same input (e.g. out of memory) - one line,
    as without --processes; lines that differ come each once with their processes."""
    from k3jax import launch
    fail = ("import sys; from k3jax.cli import run_cli; pid = sys.argv[sys.argv.index('--process-id') + 1]; "
            "sys.exit(run_cli('k3jax.x', lambda: (_ for _ in ()).throw(ValueError({}))))")
    assert launch.spawn([sys.executable, "-c", fail.format("'the same for all'")], 2) == 2
    assert capfd.readouterr().err.count("k3jax.x: error: the same for all") == 1
    assert launch.spawn([sys.executable, "-c", fail.format("'only ' + pid")], 2) == 2
    err = capfd.readouterr().err
    assert "k3jax.x: error: only 0 (process 0)" in err and "k3jax.x: error: only 1 (process 1)" in err
