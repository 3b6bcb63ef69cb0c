#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs k3jax (editable) with the given extras.
# Usage: scripts/setup.sh [extras]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

find_python() {
  local candidates=(python3.14 python3.13 python3.12 python3 python)
  for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  for p in "$pyenv_root"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  py="$(find_python)" || {
    echo "error: k3jax needs Python >= 3.12 (jax 0.11 requires it); none found on PATH or under pyenv." >&2
    echo "       Install one (e.g. 'pyenv install 3.12') and run this again." >&2
    exit 1
  }
  echo "setup: creating .venv with $py ($("$py" --version))"
  "$py" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
echo "setup: ready (.venv, extras: ${extras:-none})"
