"""MXFP4 (compressed-tensors mxfp4-pack-quantized): hand-computed values, the NumPy reference,
round trips, and errors. Dequantisation is exact (every E2M1 value times a power of two is
representable), so comparisons are exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_numpy as ref
from k3jax import mxfp4, ops


def test_dequantize_hand_computed():
    # Row 0, group 0: bytes 0x21 (even col: code 1 = 0.5, odd col: code 2 = 1.0),
    #                 0x9F (even: code 15 = -6, odd: code 9 = -0.5), 0x70 (0, 6); scale 127 -> x1.
    # Row 0, group 1: byte 0x4B (even: code 11 = -1.5, odd: code 4 = 2); scale 129 -> x4.
    # Row 1: bytes 0x86 (4, -0) / 0x35 (3, 1.5); scales 125 -> x1/4 and 128 -> x2.
    packed = np.zeros((2, 32), np.uint8)
    packed[0, :3] = [0x21, 0x9F, 0x70]
    packed[0, 16] = 0x4B
    packed[1, 0], packed[1, 16] = 0x86, 0x35
    scale = np.array([[127, 129], [125, 128]], np.uint8)
    w = np.asarray(mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32))
    want = np.zeros((2, 64), np.float32)
    want[0, :6] = [0.5, 1.0, -6.0, -0.5, 0.0, 6.0]
    want[0, 32:34] = [-1.5 * 4, 2.0 * 4]
    want[1, 0:2] = [4.0 / 4, -0.0]
    want[1, 32:34] = [3.0 * 2, 1.5 * 2]
    np.testing.assert_array_equal(w, want)
    np.testing.assert_array_equal(ref.mxfp4_dequantize(packed, scale), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_matches_reference(dtype):
    packed, scale = mxfp4.random_packed(jax.random.key(0), (3, 8, 96))
    w = mxfp4.dequantize(packed, scale, dtype)
    assert w.shape == (3, 8, 96) and w.dtype == dtype
    np.testing.assert_array_equal(np.asarray(w, np.float64), ref.mxfp4_dequantize(packed, scale))


def test_every_code_and_nibble_position():
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes[:, None] | (codes[None, ::-1] << 4)).reshape(1, 256)[:, :16]   # 16 bytes, 32 values
    w = np.asarray(mxfp4.dequantize(jnp.asarray(packed), jnp.full((1, 1), 127, jnp.uint8), jnp.float32))
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -.5, -1, -1.5, -2, -3, -4, -6])
    np.testing.assert_array_equal(w[0, 0::2], table[packed[0] & 15])
    np.testing.assert_array_equal(w[0, 1::2], table[packed[0] >> 4])


def test_quantize_dequantize_round_trip():
    """Codes whose 32-groups each contain a +-4 or +-6 use their group's top exponent: exact."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (4, 5, 64)).astype(np.uint8)
    codes[codes == 8] = 0                                   # -0 re-quantises to +0
    codes[..., ::32] = rng.choice([6, 7, 14, 15], codes[..., ::32].shape)
    packed = mxfp4.pack_codes(jnp.asarray(codes))
    scale = jnp.asarray(rng.integers(100, 140, (4, 5, 2)).astype(np.uint8))
    p2, s2 = mxfp4.quantize(mxfp4.dequantize(packed, scale, jnp.float32))
    np.testing.assert_array_equal(np.asarray(p2), np.asarray(packed))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_codes(packed)), codes)


def test_quantize_rounds_to_nearest():
    w = jax.random.normal(jax.random.key(1), (16, 128)) * 0.03
    p, s = mxfp4.quantize(w)
    deq = ref.mxfp4_dequantize(p, s)
    wn = np.asarray(w, np.float64)
    # Per group the grid is E2M1 * 2^e with amax in [4, 8) * 2^e: no grid value is closer.
    step = np.repeat(np.exp2(np.asarray(s, np.float64) - 127), 32, axis=-1)
    grid = np.concatenate([ref.E2M1, -ref.E2M1])
    nearest = np.min(np.abs(wn[..., None] / step[..., None] - grid), axis=-1) * step
    np.testing.assert_allclose(np.abs(deq - wn), nearest, rtol=0, atol=1e-12)
    assert np.max(np.abs(deq - wn)) < 0.25 * np.max(np.abs(wn))


def test_bad_width_raises():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(jnp.ones((4, 48)))


def test_dequantize_checks_its_operands():
    """A scale without the expert axis would broadcast (every expert on one set of scales), a
    float scale would decode to zeros: both are refused, naming the shapes or dtypes."""
    packed, scale = mxfp4.random_packed(jax.random.key(3), (2, 8, 64))
    with pytest.raises(ValueError, match=r"weight_scale \[2, 8, 2\], got \[8, 2\]"):
        mxfp4.dequantize(packed, scale[0])
    with pytest.raises(ValueError, match=r"weight_scale \[2, 8, 2\], got \[2, 8, 1\]"):
        mxfp4.dequantize(packed, scale[..., :1])
    with pytest.raises(ValueError, match="must be uint8, got uint8 and float32"):
        mxfp4.dequantize_halves(packed, scale.astype(jnp.float32))


def test_expert_weights_gather_dequantises():
    packed, scale = mxfp4.random_packed(jax.random.key(2), (5, 32, 64))
    ew = ops.ExpertWeights(packed, packed, packed, scale, scale, scale)
    w1, _, _ = ew.gather(jnp.array([3, 0]), jnp.float32)
    np.testing.assert_array_equal(np.asarray(w1, np.float64), ref.mxfp4_dequantize(packed, scale)[[3, 0]])


def test_tile_order_layout_and_round_trip():
    """to_tiles puts each 64-row x 128-input tile's 64 code bytes (4 scale bytes) per row together,
    chunk after chunk, codes as tile words; from_tiles undoes it; numpy and jax arrays alike."""
    packed, scale = mxfp4.random_packed(jax.random.key(3), (2, 128, 256))       # [E, out, in/2], [E, out, in/32]
    tp, ts = mxfp4.to_tiles(packed), mxfp4.to_tiles(scale, scales=True)
    assert tp.shape == packed.shape and ts.shape == scale.shape
    flat_p, flat_s = np.asarray(tp).reshape(2, -1), np.asarray(ts).reshape(2, -1)
    paired = np.asarray(mxfp4.tile_words(packed))
    for e, t, c, r in ((0, 0, 0, 0), (1, 1, 1, 63), (1, 0, 1, 5)):          # expert, row tile, chunk, row
        start = ((t * 2 + c) * 64 + r) * 64
        np.testing.assert_array_equal(flat_p[e, start:start + 64], paired[e, 64 * t + r, 64 * c:64 * c + 64])
        start = ((t * 2 + c) * 64 + r) * 4
        np.testing.assert_array_equal(flat_s[e, start:start + 4], np.asarray(scale)[e, 64 * t + r, 4 * c:4 * c + 4])
    np.testing.assert_array_equal(mxfp4.from_tiles(tp), packed)
    np.testing.assert_array_equal(mxfp4.from_tiles(np.asarray(ts), scales=True), np.asarray(scale))


def test_tile_words_place_each_code_bit_where_the_decode_reads_it():
    """tile_words: bit b of column 2a + h's code lands at TILE_PAIR_BITS[a][b] + 16 h of its word
    (all 32 bits used once); inverse undoes it; numpy and jax agree; a partial word is refused."""
    assert sorted(b + 16 * h for pair in mxfp4.TILE_PAIR_BITS for b in pair for h in (0, 1)) == list(range(32))
    for col in range(8):
        for bit in range(4):
            codes = np.zeros(8, np.uint8)
            codes[col] = 1 << bit
            word = mxfp4.tile_words(np.asarray(mxfp4.pack_codes(codes))).view("<u4")[0]
            assert word == 1 << mxfp4.TILE_PAIR_BITS[col // 2][bit] + 16 * (col % 2), (col, bit, hex(word))
    packed, _ = mxfp4.random_packed(jax.random.key(8), (3, 16, 64))
    words = mxfp4.tile_words(packed)
    assert isinstance(words, jax.Array) and isinstance(mxfp4.tile_words(np.asarray(packed)), np.ndarray)
    np.testing.assert_array_equal(np.asarray(words), mxfp4.tile_words(np.asarray(packed)))
    np.testing.assert_array_equal(np.asarray(mxfp4.tile_words(words, inverse=True)), np.asarray(packed))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        mxfp4.tile_words(np.zeros((4, 8), np.uint8)[:, :6])


def test_tiles_need_64_rows_and_128_inputs():
    packed, _ = mxfp4.random_packed(jax.random.key(0), (96, 256))
    with pytest.raises(ValueError, match="64 | out and 128 | in"):
        mxfp4.to_tiles(packed)


def test_tiled_expert_weights_gather_the_same_weights():
    packed, scale = mxfp4.random_packed(jax.random.key(4), (3, 64, 384))
    rows = ops.ExpertWeights(packed, packed, packed, scale, scale, scale)
    tiled = rows.in_tiles()
    assert tiled.tiled and tiled.w2.shape == packed.shape
    with pytest.raises(ValueError, match="row order"):
        tiled.in_tiles()
    ids = jnp.array([2, 0])
    for a, b in zip(rows.gather(ids, jnp.float32), tiled.gather(ids, jnp.float32)):
        np.testing.assert_array_equal(a, b)
    # the reference's matmul straight from the tiles (no untiling) = the dense matmul, both orders
    dense = rows.gather(ids, jnp.float32)
    for x in (jax.random.normal(jax.random.key(6), (5, 384)), jax.random.normal(jax.random.key(7), (2, 5, 384))):
        spec = "ni,uoi->uno" if x.ndim == 2 else "uni,uoi->uno"
        for matrix in range(3):
            want = jnp.einsum(spec, x, dense[matrix], precision="highest")
            for w in (rows, tiled):
                got = w.parts_matmul(x, w.gather_parts(ids, jnp.float32)[matrix])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_tile_words_dequantise_to_eight_column_parts():
    """dequantize_tile_words (what the reference's gather_parts reads from tiles) of tile words =
    the dequantised matrix's columns j::8, part j = 2a + h; under jit too; bad shapes are named."""
    packed, scale = mxfp4.random_packed(jax.random.key(9), (3, 512))
    words = mxfp4.tile_words(packed)
    want = np.asarray(mxfp4.dequantize(packed, scale, jnp.float32))
    parts = jax.jit(lambda w, s: mxfp4.dequantize_tile_words(w, s, jnp.float32))
    for got in (mxfp4.dequantize_tile_words(words, scale, jnp.float32), parts(words, scale)):
        assert len(got) == 8
        for j, part in enumerate(got):
            np.testing.assert_array_equal(part, want[:, j::8])
    with pytest.raises(ValueError, match="divisible by 16"):
        mxfp4.dequantize_tile_words(words[:, :8], scale[:, :1])
