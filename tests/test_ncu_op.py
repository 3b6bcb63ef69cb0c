"""benchmarks/ncu_op.py (the process put under Nsight Compute): runs a registered case and checks it."""
import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parent.parent / "benchmarks" / "ncu_op.py"
_SPEC = importlib.util.spec_from_file_location("ncu_op", _PATH)
ncu_op = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_op)


def test_runs_a_case_and_reports_its_error(capsys):
    assert ncu_op.run("route", "rows1_e128_d256_k4", "xla", 1) == 0
    assert "route rows1_e128_d256_k4 xla: 2 calls, error 0.00e+00" in capsys.readouterr().out


@pytest.mark.parametrize("args, match", [
    (("route", "nope", "xla", 1), r"unknown case \['nope'\]"),
    (("nope", "x", "xla", 1), r"unknown op \['nope'\]"),
    (("route", "rows1_e128_d256_k4", "triton", 1), "route has no 'triton' implementation"),
    (("route", "rows1_e128_d256_k4", "xla", -1), "--calls must be >= 0"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(ValueError, match=match):
        ncu_op.run(*args)
