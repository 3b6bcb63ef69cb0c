"""Atomic file writes: a file is either complete or absent, never half-written."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)
DIR_MODE = 0o777 & ~_UMASK      # what os.mkdir gives a new directory (mkdtemp's is owner-only)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path beside `path`; on success it is fsynced and renamed onto `path`
    (keeping an existing file's permissions, else those of a newly created file: mkstemp's are
    owner-only), on any error it is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, os.stat(path).st_mode & 0o7777 if os.path.exists(path) else 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text(path: str, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def write_json(path: str, payload) -> None:
    """`payload` as JSON; NaN and infinities (not JSON) are written as null."""
    write_text(path, json.dumps(_finite(payload), indent=1, allow_nan=False))


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
