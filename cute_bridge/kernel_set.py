"""The kernel set: every CuTe kernel the shared library holds, with its argument contract.

Pure data (no CuTe DSL import), so the loader on the GPU machine checks calls against the same
specs the build compiled. A dimension is an int (static) or a symbol name (dynamic, bound from
the arrays at call time; one symbol means one size everywhere it appears). Arrays are dense
row-major. Kernel arguments are the inputs, then the outputs, then the stream.
"""

from __future__ import annotations

import dataclasses

from k3jax import mxfp4

Dim = int | str


@dataclasses.dataclass(frozen=True)
class Arg:
    name: str
    dtype: str                 # numpy dtype name: float32, bfloat16, int32, uint8
    shape: tuple[Dim, ...]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """`entry` is "module:function" of a @cute.jit host function under cute_bridge.kernels."""

    name: str
    entry: str
    inputs: tuple[Arg, ...]
    outputs: tuple[Arg, ...]
    divisibility: tuple[tuple[str, int], ...] = ()     # symbol -> required multiple
    smem_carveout: int | None = None                    # preferred shared-memory carveout (percent), set at load

    @property
    def target(self) -> str:
        """The XLA FFI target name."""
        return f"k3cute_{self.name}"

    @property
    def args(self) -> tuple[Arg, ...]:
        return self.inputs + self.outputs

    @property
    def symbols(self) -> dict[str, int]:
        """Every dynamic dimension (in first-use order) -> its divisibility."""
        div = dict(self.divisibility)
        return {d: div.get(d, 1) for a in self.args for d in a.shape if isinstance(d, str)}


GEMV_ROWS = (1, 2, 4, 8)        # batch rows with a compiled GEMV; others pad up or fall back


def _gemv(rows: int, kind: str) -> KernelSpec:
    """kind "": gemv_r{rows} -> y [rows, N] bf16 (one row: the SIMT kernel, more: the MMA one);
    "split": gemv_split_r{rows} -> float32 partials [S, rows, N] over S slices of K (summed by
    the caller)."""
    entry = "gemv_split" if kind else "gemv_simt" if rows == 1 else "gemv"
    return KernelSpec(
        name=f"gemv_{'split_' if kind else ''}r{rows}", entry=f"cute_bridge.kernels.gemv:{entry}",
        inputs=(Arg("x", "bfloat16", (rows, "K")), Arg("w", "bfloat16", ("N", "K"))),
        outputs=(Arg("y", "float32", ("S", rows, "N")) if kind else Arg("y", "bfloat16", (rows, "N")),),
        divisibility=(("K", 8),))


# MXFP4 codes travel as int32 words (8 codes each) so a lane copies a scale group in 16 bytes; the
# activations (z, hid) come with their columns in the decode's pair order (cute_bridge.ops.permute_x;
# experts in tiles hold their codes in that order, so theirs come as they are). One grid row
# per expert (U; past 8 tokens one per 8 of its choices); slots [U, T] names the slot each of T
# token columns fills (-1: none).
MOE_TOKENS = (1, 8)             # token columns a MoE kernel takes; cute_bridge.ops groups more tokens
MOE_BLOCK_ROWS = (16, 64)       # expert rows per block: one MMA row tile, or four sharing each activation read
MOE_WIDE_MULTIPLE = 128         # M and I of the blocks past 16 rows: 64 rows, and whole 4-group scale words


def _moe(tokens: int, rows: int, tiles: bool = False) -> tuple[KernelSpec, KernelSpec]:
    """(moe_gate_up_t{tokens}: z [N, M] -> gate, up [S, I] bf16; moe_down_t{tokens}: hid [S, I],
    weights [S] -> part [S, M] float32), both over experts [U] and slots [U, tokens]; `rows` per
    block (names end in _rows{rows} past 16). Past 16 rows the blocks stage each chunk's scale words
    (4 groups) in shared memory, so the input dimension must hold a multiple of 4 groups (128
    values), and they ask for the largest shared-memory carveout (a fifth block per SM). tiles
    (64 rows; names end in _tiles): experts stored in k3jax.mxfp4.to_tiles' order."""
    route = (Arg("experts", "int32", ("U",)), Arg("slots", "int32", ("U", tokens)))
    suffix = ("" if rows == 16 else f"_rows{rows}") + ("_tiles" if tiles else "")
    wide = rows > MOE_BLOCK_ROWS[0]
    words = lambda groups: ((groups, MOE_WIDE_MULTIPLE // 32),) if wide else ()   # noqa: E731 - scale groups per row
    carveout = 100 if wide else None
    return (
        KernelSpec(
            name=f"moe_gate_up_t{tokens}{suffix}", entry=f"cute_bridge.kernels.mxfp4_moe:gate_up{suffix}",
            inputs=(Arg("z", "bfloat16", ("N", "M")), *route,
                    Arg("w1", "int32", ("E", "I", "M8")), Arg("s1", "uint8", ("E", "I", "M32")),
                    Arg("w3", "int32", ("E", "I", "M8")), Arg("s3", "uint8", ("E", "I", "M32"))),
            outputs=(Arg("gate", "bfloat16", ("S", "I")), Arg("up", "bfloat16", ("S", "I"))),
            divisibility=(("M", 32), ("I", rows), ("M8", 4), *words("M32")), smem_carveout=carveout),
        KernelSpec(
            name=f"moe_down_t{tokens}{suffix}", entry=f"cute_bridge.kernels.mxfp4_moe:down{suffix}",
            inputs=(Arg("hid", "bfloat16", ("S", "I")), *route, Arg("weights", "float32", ("S",)),
                    Arg("w2", "int32", ("E", "M", "I8")), Arg("s2", "uint8", ("E", "M", "I32"))),
            outputs=(Arg("part", "float32", ("S", "M")),),
            divisibility=(("I", 32), ("M", rows), ("I8", 4), *words("I32")), smem_carveout=carveout))


KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec(name="add", entry="cute_bridge.kernels.add:add",
               inputs=(Arg("x", "float32", ("n",)), Arg("y", "float32", ("n",))),
               outputs=(Arg("out", "float32", ("n",)),)),
    *(_gemv(r, kind) for kind in ("", "split") for r in GEMV_ROWS),
    *(spec for r in MOE_BLOCK_ROWS for t in MOE_TOKENS for spec in _moe(t, r)),
    *(spec for t in MOE_TOKENS for spec in _moe(t, MOE_BLOCK_ROWS[-1], tiles=True)),
)

BY_NAME = {k.name: k for k in KERNELS}

# Everything that changes the compiled library: the kernel-set hash covers these and the sources.
ARCH = "sm_90a"
HOST_TARGET = "llvm -mtriple=x86_64-unknown-linux-gnu -mcpu=x86-64-v2"   # portable host launcher code
CUTLASS_DSL_VERSION = "4.8.1"
_HASHED = ("kernel_set.py", "codegen.py", "build.py")


def kernel_set_hash() -> str:
    """sha256 (16 hex digits) of the kernel sources, the glue generator, the build options and the
    MXFP4 word decode the kernels inline (k3jax.mxfp4: its factor bias and both PTX programs)."""
    import hashlib
    import pathlib
    root = pathlib.Path(__file__).parent
    files = sorted([root / f for f in _HASHED] + list((root / "kernels").glob("*.py")))
    decode = "|".join(mxfp4.decode_word_ptx(tiled) for tiled in (False, True))
    h = hashlib.sha256(f"{ARCH}|{HOST_TARGET}|{CUTLASS_DSL_VERSION}|{mxfp4.DECODE_FACTOR_BIAS}|{decode}".encode())
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]
