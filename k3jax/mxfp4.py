"""MXFP4 in the compressed-tensors `mxfp4-pack-quantized` layout (Kimi K3's routed experts).

A weight W [out, in] is stored as
  * `weight_packed` uint8 [out, in/2]: two FP4 (E2M1) codes per byte, the low nibble is the even
    column; a code is sign (bit 3) and a magnitude index (bits 0-2) into E2M1_VALUES;
  * `weight_scale`  uint8 [out, in/32]: one UE8M0 power-of-two scale per 32 consecutive inputs,
    value 2^(scale - 127).
4.25 bits per weight. Leading axes (e.g. experts [E, out, in/2]) are carried through.

Tiled storage (`to_tiles` / `from_tiles`; the routed experts' `expert_layout = "tiles"`): the same
two arrays, same shapes, with their bytes in tile order - per block of TILE_ROWS = 64 output rows,
per TILE_COLS = 128 inputs, the 64 rows' 64 code bytes and their 4 scale bytes contiguous
([out/64, in/128, 64, 64] and [out/64, in/128, 64, 4] read as [out, in/2] and [out, in/32]) - and
each 32-bit word of codes in tile-word form (`tile_words`): its 8 columns as 4 pairs (2a, 2a + 1),
each code's sign and magnitude bits where the kernels' decode wants them (TILE_PAIR_BITS). A decode
kernel then streams 4 KB of codes (and 256 B of scales) per chunk in memory order instead of
64-byte pieces of 64 rows a row apart (DRAM locality, +6% for the CuTe kernels: H200, session 20,
BENCHMARKS.md), its bf16 pair a of a word holds columns 2a, 2a + 1 (the kernels take the
activations in column order: no XLA permutation), and it decodes a word in 13 instructions
instead of 17 (DECODE_PROGRAMS). Needs out % 64 == 0 and in % 128 == 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = np.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), np.float32)  # code -> value
_E2M1_MAX_EXP = 2            # 6 = 1.5 * 2^2: the largest E2M1 exponent
SCALE_BIAS = 127
# The GPU kernels' decode (Pallas and CuTe moe_experts): a code's bits placed in a bf16 read as
# E2M1 x 2^-126, one fma by the group's factor 2^(scale - 1) (bf16 exponent field scale +
# DECODE_FACTOR_BIAS) gives the weight itself, so every product with a bf16 activation is the
# reference's. Exact for scale codes DECODE_EXACT_SCALES (2..128, i.e. groups up to 12 in
# magnitude: past 128 the factor's exponent field passes 254; below 2, E2M1 0.5 x 2^(code - 127)
# is a float32 subnormal, which XLA's dequantize flushes to 0 and the decode keeps; real and
# random MXFP4 weights sit near 2^-7, codes ~120). Code 0, which `dequantize` reads as 0: the
# CuTe kernels give 0, the Pallas kernels E2M1 x 2^-127.
DECODE_FACTOR_BIAS = 126
DECODE_EXACT_SCALES = (2, 254 - DECODE_FACTOR_BIAS)
PAIR_BITS = 0x81C081C0      # bf16x2 bits of two codes: sign 15, magnitude (e1 e0 m) 8..6; +16 for the high half
NEG_ZERO2 = 0x80008000      # fma addend: x * s + (-0) = x * s exactly, signed zeros kept


def _interleave(even: jax.Array, odd: jax.Array) -> jax.Array:
    """[..., n] and [..., n] -> [..., 2n] in column order (even[0], odd[0], even[1], ...)."""
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], even.shape[-1] * 2)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """uint8 [..., in/2] -> FP4 codes uint8 [..., in] (low nibble first)."""
    return _interleave(packed & 0x0F, packed >> 4)


def pack_codes(codes: jax.Array) -> jax.Array:
    """FP4 codes uint8 [..., in] (values 0..15) -> uint8 [..., in/2]."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _pow2(exponent_field: jax.Array) -> jax.Array:
    """2^(field - 127) as float32, built from its bits (0 for field 0): field is uint 0..254."""
    return jax.lax.bitcast_convert_type(exponent_field.astype(jnp.uint32) << 23, jnp.float32)


def e2m1_values(e: jax.Array, m: jax.Array, negative: jax.Array) -> jax.Array:
    """E2M1 fields (exponent e 0..3, mantissa m 0..1, sign) -> their values in float32, unscaled:
    m/2 for e = 0, else (1 + m/2) * 2^(e-1)."""
    m = m.astype(jnp.float32)
    magnitude = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * _pow2(e.astype(jnp.uint32) + 126))
    return jnp.where(negative, -magnitude, magnitude)


def code_values(codes: jax.Array) -> jax.Array:
    """FP4 codes (any integer dtype, values 0..15: sign bit 3, e bits 2-1, m bit 0) -> their E2M1
    values in float32, unscaled."""
    return e2m1_values((codes >> 1) & 3, codes & 1, codes >= 8)


def dequantize_halves(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """(weight_packed [..., out, in/2], weight_scale [..., out, in/32]) -> the even and the odd
    input columns of W, each [..., out, in/2] in dtype (low and high nibbles of each byte).

    Pure integer/float elementwise arithmetic on the packed bytes (no table lookup, no
    interleaving), so XLA fuses each half into one pass over the bytes. An E2M1 code (sign s,
    exponent e, mantissa m) is m/2 for e = 0 and (1 + m/2) * 2^(e-1) otherwise; multiplying by
    the power-of-two scale is exact in float32 for scale codes 1..254.
    """
    _check_packed(packed, scale)
    per_byte = _pow2(jnp.repeat(scale, GROUP // 2, axis=-1))              # one scale per packed byte
    return tuple((code_values(c) * per_byte).astype(dtype) for c in (packed & 0x0F, packed >> 4))


def _check_packed(packed, scale) -> None:
    """ValueError naming the problem unless packed is uint8 [..., out, in/2] and scale uint8
    [..., out, in/32] over the same leading dims (a scale without the expert axis would broadcast)."""
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 codes and scales must be uint8, got {packed.dtype} and {scale.dtype}")
    want = (*packed.shape[:-1], packed.shape[-1] * 2 // GROUP)
    if packed.ndim < 2 or packed.shape[-1] % (GROUP // 2) or tuple(scale.shape) != want:
        raise ValueError(f"MXFP4 weight_packed {list(packed.shape)} needs a last dimension divisible by "
                         f"{GROUP // 2} and weight_scale {list(want)}, got {list(scale.shape)}")


def dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """(weight_packed [..., out, in/2], weight_scale [..., out, in/32]) -> W [..., out, in] in dtype:
    `dequantize_halves` interleaved back into column order."""
    return _interleave(*dequantize_halves(packed, scale, dtype))


TILE_ROWS = 64       # output rows per tile
TILE_COLS = 128      # inputs per tile: 64 code bytes and 4 scale bytes per row
TILE_VERSION = 3     # of `to_tiles`' image, recorded with stored tiles; 1: codes in byte order, 2: in pair order
# Tile words: where pair a's low column keeps its code bits (m, e0, e1, sign), the high column 16
# bits above. Pair 0 sits at PAIR_BITS, pairs 1 and 2 three and six bits below it (the decode
# shifts them up), pair 3 in the bits left, placed for one shift, mask and multiply (DECODE_PROGRAMS).
TILE_PAIR_BITS = ((6, 7, 8, 15), (3, 4, 5, 12), (0, 1, 2, 9), (14, 10, 11, 13))
assert all(e1 == e0 + 1 for _, e0, e1, _ in TILE_PAIR_BITS)       # the exponent's two bits adjacent


def _tile_order(a: jax.Array, per_tile_row: int, inverse: bool) -> jax.Array:
    """a [..., out, c] with per_tile_row entries of each row per tile -> the same shape with its
    entries in tile order (inverse: back to row order)."""
    *lead, out, c = a.shape
    if out % TILE_ROWS or c % per_tile_row:
        raise ValueError(f"tiled MXFP4 needs {TILE_ROWS} | out and {TILE_COLS} | in, got a [{out}, {c}] "
                         f"array with {per_tile_row} entries per row and tile")
    n = len(lead)
    rows_first = (*lead, out // TILE_ROWS, TILE_ROWS, c // per_tile_row, per_tile_row)   # [.., T, r, C, b]
    tiles_first = (*lead, out // TILE_ROWS, c // per_tile_row, TILE_ROWS, per_tile_row)  # [.., T, C, r, b]
    perm = (*range(n), n, n + 2, n + 1, n + 3)
    return (a.reshape(tiles_first if inverse else rows_first).transpose(perm)).reshape(a.shape)


def tile_view(a, *, scales: bool = False):
    """A tile-ordered weight_packed [..., out, in/2] (scales: weight_scale [..., out, in/32]) as the
    tiles it holds, [..., out/64, in/128, 64 rows, 64 code bytes (scales: 4)]: a reshape, no copy."""
    *lead, out, c = a.shape
    per_tile_row = TILE_COLS // GROUP if scales else TILE_COLS // 2
    return a.reshape(*lead, out // TILE_ROWS, c // per_tile_row, TILE_ROWS, per_tile_row)


def _bit_moves(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A permutation of a word's bits, bit src[i] -> dst[i], as (mask, left shift) per distance."""
    shifts = sorted({d - s for s, d in zip(src, dst)})
    return tuple((sum(1 << s for s, d in zip(src, dst) if d - s == sh), sh) for sh in shifts)


# A tile word's bits against the same word in row order (column c's code bit b at 4c + b), in the
# order (half h, pair a, code bit b): the one permutation `tile_words` applies.
_ROW_ORDER_BITS = tuple(4 * (2 * a + h) + b for h in (0, 1) for a in range(4) for b in range(4))
_TILE_WORD_BITS = tuple(TILE_PAIR_BITS[a][b] + 16 * h for h in (0, 1) for a in range(4) for b in range(4))


def _permutation(inverse: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(source bits, destination bits) of `tile_words` (inverse: back to row order)."""
    return (_TILE_WORD_BITS, _ROW_ORDER_BITS) if inverse else (_ROW_ORDER_BITS, _TILE_WORD_BITS)


@functools.cache
def _half_word_tables(inverse: bool) -> np.ndarray:
    """uint32 [2, 65536]: the permutation of a 32-bit word as the or of one lookup per 16-bit half."""
    values, tables = np.arange(1 << 16, dtype=np.uint32), np.zeros((2, 1 << 16), np.uint32)
    for s, d in zip(*_permutation(inverse)):
        tables[s // 16] |= ((values >> (s % 16)) & 1) << d
    return tables


def tile_words(packed, *, inverse: bool = False):
    """weight_packed [..., in/2] in row order -> each little-endian 32-bit word in tile-word form
    (its columns in pairs, each code's bits at TILE_PAIR_BITS): the bytes `to_tiles` stores, before
    it reorders them; inverse: back. numpy or jax arrays (the type is kept). jax: the bits moved
    in groups of one shift (elementwise, for the device); numpy: two 16-bit table lookups a word
    (host conversion at checkpoint load, one core: ~830 MB/s, 3x session 39's pair-order image)."""
    *lead, n = packed.shape
    if n % 4:
        raise ValueError(f"tile words need whole 32-bit words of codes, got {n} bytes per row")
    if isinstance(packed, np.ndarray):
        halves = np.ascontiguousarray(packed).view("<u2").reshape(*lead, n // 4, 2)
        tables = _half_word_tables(inverse)
        words = (tables[0][halves[..., 0]] | tables[1][halves[..., 1]]).astype("<u4", copy=False)
        return words.view(np.uint8).reshape(packed.shape)
    words = jax.lax.bitcast_convert_type(packed.reshape(*lead, n // 4, 4), jnp.uint32)
    out = jnp.zeros_like(words)
    for mask, shift in _bit_moves(*_permutation(inverse)):
        moved = words & np.uint32(mask)
        out = out | (moved << np.uint32(shift) if shift >= 0 else moved >> np.uint32(-shift))
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(packed.shape)


def dequantize_tile_words(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> tuple[jax.Array, ...]:
    """Tile words (`tile_words`: weight_packed [..., out, in/2], in any byte order that keeps words
    whole) and their weight_scale [..., out, in/32] -> W's input columns in 8 parts, part j =
    columns j, j + 8, ... ([..., out, in/8] in dtype): part 2a + h is code a of each word's half h
    (its low 16 bits: column 8k + 2a; high: + 1). Each part is one elementwise formula with the
    pair's bit positions as constants (exponent, mantissa and sign read from the half-word), so
    XLA fuses the expert gather, this and the matmul over the part (H100, session 40: the op at
    batch 1 464 us, 454 from pair-order nibbles; as two halves with per-pair shifts broadcast 592,
    with codes assembled first 740-1080: XLA wrote them out)."""
    _check_packed(packed, scale)
    *lead, n = packed.shape
    b = packed.reshape(*lead, n // 4, 2, 2).astype(jnp.uint32)          # [..., word, half h, byte]
    per_word = _pow2(jnp.repeat(scale, GROUP // 8, axis=-1))             # a scale group is 4 words
    parts = [None] * 8
    for h in (0, 1):
        half = b[..., h, 0] | (b[..., h, 1] << 8)
        for a, (m_bit, e_bit, _, s_bit) in enumerate(TILE_PAIR_BITS):
            values = e2m1_values((half >> e_bit) & 3, (half >> m_bit) & 1, ((half >> s_bit) & 1) == 1)
            parts[2 * a + h] = (values * per_word).astype(dtype)
    return tuple(parts)


def to_tiles(a, *, scales: bool = False):
    """weight_packed [..., out, in/2] (scales: weight_scale [..., out, in/32]) in row order -> the
    same array in tile order, codes as tile words (module doc). numpy or jax arrays; ValueError
    unless the shape tiles."""
    if scales:
        return _tile_order(a, TILE_COLS // GROUP, inverse=False)
    return _tile_order(tile_words(a), TILE_COLS // 2, inverse=False)


def from_tiles(a, *, scales: bool = False):
    """The inverse of `to_tiles`: a tile-ordered weight_packed (scales: weight_scale) -> row order."""
    if scales:
        return _tile_order(a, TILE_COLS // GROUP, inverse=True)
    return tile_words(_tile_order(a, TILE_COLS // 2, inverse=True), inverse=True)


# The GPU kernels' word decode (Pallas and CuTe moe_experts), as data: one 32-bit word of codes
# "w" and its group's factor "s" (bf16 2^(scale - 1) in both halves) -> "p0".."p3", p_a = a
# bf16 pair, E2M1 x 2^-126 placed at PAIR_BITS, then one exact fma by s (DECODE_FACTOR_BIAS).
# Ops on .b32 values; ints are immediates. `decode_word_ptx` emits a program, tests interpret it.
def _nibble_pair(src: str, a: int, out: str) -> tuple:
    """Nibbles a and a + 4 of src (a in 0, 1) -> out: and isolates the two codes, one multiply =
    two shifts summed (signs to bits 15 / 31, magnitudes to 8..6 / 24..22: no overlap, no carry)."""
    n, b = (f"{v}{out}" for v in "nb")
    return (("and", n, src, 0x000F000F << 4 * a), ("mul", b, n, (1 << 12 - 4 * a) + (1 << 6 - 4 * a)),
            ("and", b, b, PAIR_BITS), ("fma", out, b, "s"))


def _tile_pair(a: int, out: str) -> tuple:
    """Pair a of a tile word -> out. Pairs 0..2 sit 0, 3, 6 bits below PAIR_BITS: (shl), and, fma.
    Pair 3's bits, shifted down 8, are m at 6, e1 e0 at 3, 2 and the sign at 5: one multiply by
    1 + 2^5 + 2^10 adds copies 0, 5 and 10 bits up, none overlapping, and PAIR_BITS keeps m + 0,
    e1 e0 + 5, sign + 10."""
    t, b = (f"{v}{out}" for v in "tb")
    if a < 3:
        shift = 15 - TILE_PAIR_BITS[a][3]                 # the low half's sign bit
        placed = (("shl", t, "w", shift),) if shift else ()
        return (*placed, ("and", b, t if shift else "w", PAIR_BITS), ("fma", out, b, "s"))
    low = sum(1 << (bit - 8 + h) for bit in TILE_PAIR_BITS[3] for h in (0, 16))
    return (("shr", t, "w", 8), ("and", t, t, low), ("mul", t, t, 1 + (1 << 5) + (1 << 10)),
            ("and", b, t, PAIR_BITS), ("fma", out, b, "s"))


DECODE_PROGRAMS: dict[str, tuple] = {
    # row order: p_a = nibbles (a, a + 4), codes 2, 3, 6, 7 from the word shifted by 8; 17 instructions
    "rows": (("shr", "w8", "w", 8), *_nibble_pair("w", 0, "p0"), *_nibble_pair("w", 1, "p1"),
             *_nibble_pair("w8", 0, "p2"), *_nibble_pair("w8", 1, "p3")),
    # tile words (TILE_PAIR_BITS): p_a = columns (2a, 2a + 1); 13 instructions
    "tiles": tuple(op for a in range(4) for op in _tile_pair(a, f"p{a}")),
}
_PTX_OPS = {"and": "and.b32", "shr": "shr.u32", "shl": "shl.b32", "mul": "mul.lo.u32", "fma": "fma.rn.bf16x2"}


def decode_word_ptx(tiled: bool) -> str:
    """DECODE_PROGRAMS["tiles" if tiled else "rows"] as inline PTX: outputs $0..$3 = p0..p3,
    inputs $4 = w, $5 = s (the fma's addend -0 keeps signed zeros)."""
    program = DECODE_PROGRAMS["tiles" if tiled else "rows"]
    names = {"w": "$4", "s": "$5", "p0": "$0", "p1": "$1", "p2": "$2", "p3": "$3"}
    regs = sorted({op[1] for op in program} - set(names))
    arg = lambda a: f"0x{a:08X}" if isinstance(a, int) else names.get(a, f"d_{a}")      # noqa: E731
    lines = ["{", f".reg .b32 {', '.join(map(arg, regs))}, d_nz;", f"mov.b32 d_nz, 0x{NEG_ZERO2:08X};"]
    for op, dst, *src in program:
        lines.append(f"{_PTX_OPS[op]} {', '.join(arg(a) for a in (dst, *src))}" + (", d_nz;" if op == "fma" else ";"))
    return "\n\t".join(lines + ["}"])


def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """W [..., out, in] (float) -> (weight_packed, weight_scale) with OCP MX rounding.

    Per group of 32: shared exponent e = floor(log2(max |w|)) - 2 (clamped to the UE8M0 range),
    then each w / 2^e is rounded to the nearest E2M1 value (saturating at +-6).
    `quantize(dequantize(p, s))` returns (p, s) for any codes whose groups use their top exponent.
    """
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {GROUP}, got {w.shape[-1]}")
    wf = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = jnp.max(jnp.abs(wf), axis=-1)
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))              # amax = m * 2^e, m in [0.5, 1)
    exp = jnp.clip(e - 1 - _E2M1_MAX_EXP, -SCALE_BIAS, 127)
    exp = jnp.where(amax > 0, exp, 0)
    scaled = wf / jnp.ldexp(jnp.ones_like(wf), exp[..., None])
    mags = jnp.asarray(_E2M1_TABLE[:8])
    idx = jnp.argmin(jnp.abs(jnp.abs(scaled)[..., None] - mags), axis=-1)  # ties -> smaller magnitude
    codes = (idx + 8 * (scaled < 0)).astype(jnp.uint8).reshape(w.shape)
    return pack_codes(codes), (exp + SCALE_BIAS).astype(jnp.uint8)


def random_packed(key: jax.Array, shape: tuple[int, ...], scale_exp: int = -7) -> tuple[jax.Array, jax.Array]:
    """Random MXFP4 weights for `shape` [..., out, in]: uniform codes, scales 2^(scale_exp + {-1,0,1}).

    Generated where jit places it (on device), never on the host.
    """
    k1, k2 = jax.random.split(key)
    # Draw 32-bit words and reinterpret them as bytes: no temporary larger than the result.
    words = jax.random.bits(k1, (*shape[:-1], shape[-1] // 8), jnp.uint32)
    packed = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*shape[:-1], shape[-1] // 2)
    scale = (SCALE_BIAS + scale_exp + jax.random.randint(
        k2, (*shape[:-1], shape[-1] // GROUP), -1, 2, jnp.int32)).astype(jnp.uint8)
    return packed, scale
