"""What the command-line tools share: list flags checked up front and one error path for bad input.

A tool parses its flags with `Parser` and runs its work through `run_cli`, so a bad flag, preset,
shape, file or memory estimate ends as one `k3jax.<tool>: error: ...` line and exit status 2,
never a traceback or a usage dump.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `k3jax.<tool>: error: <message> (see --help)`, exit status 2.
    prog is "python -m k3jax.<tool> [...]" (subcommand parsers inherit it)."""

    def error(self, message: str):
        tool = self.prog.removeprefix("python -m ").split()[0]
        sys.stderr.write(f"{tool}: error: {message} (see --help)\n")
        sys.exit(2)


def int_list(text: str, flag: str, *, minimum: int = 1) -> list[int]:
    """"1,8,32" -> [1, 8, 32]; ValueError naming `flag` for anything else (or a value < minimum)."""
    items = text.replace(" ", "").split(",")
    if items == [""]:
        raise ValueError(f"{flag} is empty")
    try:
        vals = [int(x) for x in items]          # an empty item ("1,,2") is an error, not skipped
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if min(vals) < minimum:
        raise ValueError(f"{flag} needs integers >= {minimum}, got {text!r}")
    return vals


def known(values: list[str], allowed, what: str) -> list[str]:
    """`values` when each is one of `allowed`; else ValueError naming the unknown `what` and the choices."""
    bad = sorted(set(values) - set(allowed))
    if bad:
        raise ValueError(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return values


def at_least(flag: str, value: float, minimum: float) -> None:
    """ValueError naming `flag` unless `value` is a number >= minimum (NaN and infinities fail)."""
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{flag} must be >= {minimum:g}, got {value}")


def check_ep_variant(variant: str, mesh: str | None) -> None:
    """ValueError unless --ep-variant is left at auto or comes with a --mesh."""
    if variant != "auto" and not mesh:
        raise ValueError(f"--ep-variant {variant} needs --mesh (expert dispatch runs only on a mesh)")


def check_writable(path: str, flag: str) -> None:
    """ValueError naming `flag` unless a file can be written at `path`: not a directory, and the
    nearest existing folder above it is a writable folder (the rest is created on writing).
    Checked before any work, so a bad path does not throw a finished run away."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: {folder!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: no permission to write in {folder!r}")


def run_cli(prog: str, work: Callable[[], int]) -> int:
    """work() -> exit status; bad input (ConfigError, ValueError, OSError: a missing or unwritable
    file, OutOfMemoryError) -> one error line on stderr and status 2. Sets XLA's GPU memory
    fraction to 0.94 unless the environment already sets it."""
    from k3jax.config import ConfigError
    from k3jax.launch import ERROR_FILE_ENV
    from k3jax.weights import OutOfMemoryError
    # Before the first device use: big presets fill the GPU, so XLA's allocator may take nearly all
    # of it (its default, 75%, leaves k3-h200 short of memory).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    try:
        return work()
    except (ConfigError, ValueError, OSError, OutOfMemoryError) as e:
        line = f"{prog}: error: {e}\n"
        path = os.environ.get(ERROR_FILE_ENV)
        if path:        # one process of a spawned job: its launcher prints each distinct line once
            with open(path, "w") as f:
                f.write(line)
        else:
            sys.stderr.write(line)
        return 2


def check_preset(name_or_dir: str) -> None:
    """ConfigError unless `name_or_dir` is a known preset or an existing checkpoint directory."""
    from k3jax.config import ConfigError
    from k3jax.presets import PRESETS
    if name_or_dir not in PRESETS and not os.path.isdir(name_or_dir):
        raise ConfigError(f"{name_or_dir!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                          f"nor a checkpoint directory")
