#!/usr/bin/env bash
# Sets up .venv with the test extras and runs the test suite (CPU, 8 fake devices per worker).
# pytest's exit code 5 (no tests collected) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
# `cute`: CI builds the CuTe kernel library (no GPU needed) and exports it for CUDA.
# `notebooks`: matplotlib + nbclient, so tests/test_notebooks.py executes notebooks/ top to bottom.
# `tokenizer`: tiktoken, for the Kimi tokenizer test.
bash scripts/setup.sh test,cute,notebooks,tokenizer || exit 1
# Two pytest-xdist workers (K3JAX_TEST_WORKERS; 0 = in this process): a test keeps one core busy
# (XLA:CPU compiles and the Pallas interpreter are single-threaded), and CI has two.
# worksteal: the few long tests (whole-model interpret runs, subprocess jobs) do not queue up.
.venv/bin/python -m pytest -n "${K3JAX_TEST_WORKERS:-2}" --dist worksteal "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
