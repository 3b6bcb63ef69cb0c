"""A small, strict safetensors reader and streaming writer (no dependency beyond numpy/ml_dtypes).

File layout: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}`,
then the raw little-endian tensor bytes (offsets relative to the end of the header).

Reading is lazy: `SafetensorsFile.read(name)` returns a read-only `np.memmap` view of that one
tensor, so a loader touches one tensor's pages at a time, never the whole file. Every structural
problem (truncation, overlapping or out-of-range offsets, bad JSON, unknown dtype, a shape or
offsets that are not lists of non-negative integers, size/shape mismatch) raises `SafetensorsError`
naming the file and the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from k3jax.atomic import atomic_path

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"), "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # the reference implementation's limit


class SafetensorsError(ValueError):
    """A safetensors file is truncated, corrupt or does not hold what was asked for."""


def dtype_name(dtype) -> str:
    """numpy dtype -> safetensors dtype string ("BF16", "F32", "U8", ...)."""
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    if dt not in _NAMES:
        raise SafetensorsError(f"dtype {dt} has no safetensors name")
    return _NAMES[dt]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str          # safetensors dtype string
    shape: tuple[int, ...]
    offset: int         # absolute byte offset in the file
    nbytes: int


def _naturals(v) -> bool:
    """v is a JSON list of non-negative integers (bools, floats and strings are not)."""
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


class SafetensorsFile:
    """One .safetensors file, header parsed and validated on open; tensors read lazily."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise SafetensorsError(f"{path}: cannot open safetensors file ({e.strerror})") from None
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise SafetensorsError(f"{path}: corrupt: header length {n} exceeds {MAX_HEADER} bytes")
            if 8 + n > size:
                raise SafetensorsError(f"{path}: truncated: header says {n} bytes of JSON but the file has "
                                       f"{size - 8} after the length")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: corrupt: header JSON is not an object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise SafetensorsError(f"{path}: corrupt: __metadata__ is not a JSON object")
        data_start, data_size = 8 + n, size - 8 - n
        self._infos: dict[str, TensorInfo] = {}
        spans = []
        for name, entry in header.items():
            if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
                raise SafetensorsError(f"{path}: corrupt: bad header entry for tensor {name!r}: {entry!r}")
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
            # int() would truncate 2.7 and accept "12": every entry must already be a JSON integer
            if not _naturals(shape):
                raise SafetensorsError(f"{path}: corrupt: tensor {name!r} has shape {shape!r}, "
                                       f"not a list of non-negative integers")
            if not _naturals(offsets) or len(offsets) != 2:
                raise SafetensorsError(f"{path}: corrupt: tensor {name!r} has data_offsets {offsets!r}, "
                                       f"not two non-negative integers")
            (begin, end), shape = offsets, tuple(shape)
            nbytes = math.prod(shape) * DTYPES[dtype].itemsize
            if begin > end or end - begin != nbytes:
                raise SafetensorsError(f"{path}: corrupt: tensor {name!r} {dtype}{list(shape)} needs {nbytes} bytes "
                                       f"but data_offsets are [{begin}, {end}]")
            if end > data_size:
                raise SafetensorsError(f"{path}: truncated: tensor {name!r} ends at data byte {end} but the file "
                                       f"holds only {data_size} data bytes")
            spans.append((begin, end, name))
            self._infos[name] = TensorInfo(name, dtype, shape, data_start + begin, nbytes)
        spans.sort()
        pos = 0
        for begin, end, name in spans:
            if begin != pos:
                what = "overlaps the previous tensor" if begin < pos else f"leaves a gap of {begin - pos} bytes"
                raise SafetensorsError(f"{path}: corrupt: tensor {name!r} at data byte {begin} {what}")
            pos = end
        if pos != data_size:
            raise SafetensorsError(f"{path}: corrupt: {data_size - pos} trailing bytes after the last tensor")

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise SafetensorsError(f"{self.path}: no tensor named {name!r}")
        return self._infos[name]

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (pages are read on first touch)."""
        info = self.info(name)
        dtype = DTYPES[info.dtype]
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=info.offset, shape=info.shape)


# ----------------------------------------------------------------------------------- writing
Producer = Callable[[], np.ndarray]


def write_file(path: str, entries: Iterable[tuple[str, tuple[int, ...], np.dtype, Producer]],
               metadata: Mapping[str, str] | None = None) -> int:
    """Writes tensors one at a time: entries (name, shape, dtype, producer); each producer is
    called once, in order, and its array written before the next is made, so host memory holds
    one tensor. Atomic: a temporary file in the same directory is renamed into place only after
    a full, fsynced write. Returns the file size in bytes."""
    entries = list(entries)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype, _ in entries:
        if name in header:
            raise SafetensorsError(f"{path}: duplicate tensor name {name!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the reference writer does
    with atomic_path(path, suffix=".safetensors") as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, produce in entries:
            arr = np.ascontiguousarray(produce())
            if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise SafetensorsError(f"{path}: tensor {name!r}: producer returned {arr.dtype}{list(arr.shape)}, "
                                       f"declared {np.dtype(dtype)}{list(shape)}")
            f.write(arr.reshape(-1).view(np.uint8).data)  # little-endian host; no copy
    return 8 + len(raw) + offset


def save_file(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Writes in-memory arrays (small files, tests)."""
    return write_file(path, [(k, v.shape, v.dtype, lambda v=v: v) for k, v in tensors.items()], metadata)
