#!/usr/bin/env bash
# Sets up .venv with the test extras and runs the test suite (CPU, 8 fake devices).
# pytest's exit code 5 (no tests collected) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
# `cute`: CI builds the CuTe kernel library (no GPU needed) and exports it for CUDA.
# `notebooks`: matplotlib + nbclient, so tests/test_notebooks.py executes notebooks/ top to bottom.
# `tokenizer`: tiktoken, for the Kimi tokenizer test.
bash scripts/setup.sh test,cute,notebooks,tokenizer || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
