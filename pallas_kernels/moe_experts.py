"""Routed experts at decode: y = sum_k w[n,k] * down(glu(gate(z), up(z))) of the selected experts.

z [N, M] bf16, ids/weights [N, k], experts either in the
compressed-tensors MXFP4 layout (packed uint8 [E, out, in/2], scales uint8 [E, out, in/32]; see
k3jax.mxfp4; W4A16) or bf16 (w1/w3 [E, I, M], w2 [E, M, I]; Kimi-Linear's checkpoint, K3's bf16 ablation). Same contract and
dispatch as k3jax.ops.moe_experts' decode schedule: the distinct selected experts (static bound
U = min(E, N*k), padded with E) run on every token, and a [U, N] coefficient matrix
(ops.expert_dispatch) combines them - no sort, no scatter. One token takes its routing weights
as they are, one scalar per slot (no XLA launch pads them into a matrix).

Two Mosaic GPU kernels, one warpgroup per program; every selected expert's bytes are read
exactly once per call, padded expert slots read nothing:
  * gate/up: grid (I/64, U). A program streams 64 rows of w1 and w3 of its expert (TMA,
    `emit_pipeline`, 512 input columns = 256 packed bytes + 16 scale bytes per row per step),
    dequantises them in registers and multiplies them by wgmma (swap-AB: weights on the M side,
    tokens padded to 8 on N; up to 8 tokens by mma.sync, below). The epilogue applies ops.glu (the same jnp formula, on registers,
    float32) and the token's routing coefficient, and writes h [U, Np, I] bf16 (token-major:
    its [64, Np] tile stored through a transposed SMEM view).
  * down: grid (M/64, S). A program owns 64 output features and U/S experts; for each valid
    expert it streams w2 the same way against h and accumulates sum_u coef * h_u @ w2_u.T in one
    float32 wgmma accumulator, so the combine is fused. S splits the experts so the grid fills
    the 132 SMs; a small XLA epilogue sums the S float32 partials, transposes and casts.

The decode (compiled path) works on whole 32-bit words, 8 codes at a time, by bit placement:
the bf16 bits (sign << 15) | (e1 e0 m << 6) of a code are its E2M1 value times 2^-126 (a bf16
subnormal for e = 0, exactly as E2M1's own subnormals). Per pair of codes (c_a, c_a+4): one `and`
isolates the two nibbles, one integer multiply by 2^(12-4a) + 2^(6-4a) moves the signs and the
magnitudes into place at once (the two shifted copies do not overlap, so the sum is their or),
one `and` keeps the bf16 bits, and one `fma.rn.bf16x2` multiplies by the group's power-of-two
factor 2^(scale - 1), which folds in the 2^126: 17 instructions per word, and every wgmma
product equals the reference's. Experts in tiles store each code's bits already placed
(mxfp4.TILE_PAIR_BITS): per pair `and` and `fma`, pairs 1 and 2 a shift before, pair 3 a shift
and a multiply: 13 instructions per word (session 40). Exact for scale codes in EXACT_SCALES =
[2, 128] (groups up to 12 in magnitude; random and real MXFP4 weights sit near 2^-7;
k3jax.mxfp4; until session 21 the factor was 2^(scale - 65) with the activations times 2^64:
codes 59..192, one XLA multiply). The
bf16 pairs go straight into the register operand (A) of wgmma: no staging through shared
memory. Each thread decodes the 16-byte groups its WGMMA register layout owns, which orders the
contraction dimension differently from memory: within every 128 input columns, column
32q + 8k + a + 4n of the weights lands at position 32k + 8a + 2q + n (q: thread's column quad,
k: word, a: pair, n: which code of the pair). The activations (z, and h for the down kernel) are
permuted the same way by XLA before the kernels (`permute_k`, a reshape/transpose of a few KB),
which leaves the matrix product unchanged (experts in tiles, whose word pairs a are columns 2a,
2a + 1: column 32q + 8k + 2a + n lands there, `permute_k(tiled=True)`). In interpret mode (CPU)
the interpreter cannot run inline PTX or register-A wgmma, so the same permuted tiles are
produced with mxfp4.dequantize and staged through SMEM. The decode programs are data
(mxfp4.DECODE_PROGRAMS, shared with the CuTe kernels): `mxfp4.decode_word_ptx` emits them, and
the tests run a numpy model of them (with the register placement of `_decode_quad`) against
mxfp4.dequantize + permute_k, bit for bit, for every code in every position at the scale codes in
use and both ends of EXACT_SCALES (and show its top is tight), in row order and in tiles.
Stages (`OCCUPANCY`): as many as keep three programs resident per SM (136 registers), so one
decodes while the others wait on their loads: 1 for gate/up and 2 for down from 1 to 16 tokens.
MX_STEP (input columns per step) is 512 (256 and 128 measured no faster).

For experts in tiles, up to MMA_SYNC_MAX_TOKENS = 8 tokens per call or slot (batch 1-8, the
grouped schedule's slots), the compiled kernels multiply by warp-level `mma.sync.m16n8k16` instead
(`_mma_sync_step`): the same decoded pairs are its A fragments (a warp's 16 rows of the WGMMA
register layout are the mma.sync fragment), each thread reads its B fragments from SMEM, the
activations of its own 32 columns in column order (TMA-tiled and swizzled: no XLA permutation of
z or h), and the float32 accumulators are the pipeline's carry.
No wgmma means no SMEM descriptors: Mosaic hoisted a step's 32 of them into 64 registers and
moved two into uniform registers per wgmma (R2UR / UMOV, 13% of the gate/up kernel's
instructions at batch 1); the mma.sync kernels run in 64 (gate/up) and 48 (down) registers (ncu), and
both take 256-column steps in one stage (GATE_UP_SYNC_* / DOWN_SYNC_*), so batch 1's 768 gate/up
and 896 down programs are each resident at once instead of in two waves.

Bytes at K3 shapes (M 3584, I 3072): 16.5 MB packed + 0.5 MB scales per expert; batch 1 reads
16 experts (~280 MB, ~65 us at 4.3 TB/s); h, partials and z are < 1% of that. Time has followed
the decode's instructions per word (29 -> 21 -> 17; tile words 13); the measurements of each
decode, stage count and layout: docs/pallas.md (`moe_experts`) and BENCHMARKS.md.

MXFP4 experts stored in tiles (ExpertWeights.tiled, k3jax.mxfp4.to_tiles; the K3 default since
session 23) are read as [E, out/64, in/128, 64, 64] codes and [E, out/64, in/128, 256] scales
(`_operands`): a step's TMA brings 4 whole chunks (16 KB contiguous, against 64 rows of 256 B
1.8 KB apart in row order) and `_decode_quad` reads chunk `quad` instead of column group 4 quad;
their tile words change only the decode program and the activations' permutation
(`permute_k(tiled=True)`).

bf16 experts use the same grids, dispatch, epilogues and pipelines; only the weight step
differs: TMA brings a [64, 128] bf16 tile of each matrix straight from the stacked [E, out, in]
weights (the expert picked by its id, as above: no gather copy, which is most of the XLA
reference's time on the H200) and one wgmma multiplies it from SMEM with the unpermuted
activations [Np, 128] (tiles swizzled for wgmma; no decode, no `permute_k`). 128 columns per step
(BF16_STEP): a gate/up step is 2 x 16 KB of weights + Np x 256 B of activations, so 1-16 tokens
run 3 stages in <= 108 KB (two programs per SM, each with two steps = 64 KB of loads in flight
while it multiplies) and 32-64 tokens 2 stages in <= 96 KB; the down kernel (one matrix) runs 4
stages in <= 96 KB up to 32 tokens (3 at 64). A 256-column step would leave one stage per program
at the two-programs budget (or one program per SM); 128 also divides Kimi-Linear's M = 2304.

Past 32 tokens (MXFP4; bf16 past MAX_TOKENS = 64: GROUPED_FROM) the same kernels run the
grouped schedule (`_moe_groups`): each selected expert only on its own tokens. ops.expert_groups
gives every choice (token, j) a column of a slot of at most SLOT_TOKENS = 8 tokens of its expert
(an expert with more tokens takes several slots, side by side); z is gathered per slot [S, 8, M],
the gate/up kernel reads each slot's own activations and coefficients, the down kernel stores
each slot's own partial [M, 8] (a program takes DOWN_SLOTS_PER_PROGRAM = 8 slots, strided) and
each token sums its k partial rows in choice order (a gather: deterministic, no scatter-add). The row schedule runs every distinct
expert on all N tokens: at 32 tokens ~19x the needed wgmma work (~309 of 448 experts x 32 tokens
for 32 x 16 choices), and past 64 tokens it took several calls, each reading its experts again.
Calls of at most ops.GROUPED_MAX_TOKENS = 256 tokens bound the per-slot buffers: S x 8 rows
(ops.expert_groups_bound slots, at most (N*k + 7 min(E, N*k)) / 8, rounded up to a multiple of
DOWN_SLOTS_PER_PROGRAM) of z in bf16 and of partials in float32. From 17 to 32 tokens (MXFP4:
GROUPED_DOWN_FROM) the schedule is mixed: the row schedule's gate/up (one z shared by every
program), then each choice's h row gathered into its slot and the grouped down. Measurements:
docs/pallas.md ("The grouped MoE schedule").

Anything else (float32 experts, M or I not a multiple of the step: 512 for MXFP4, 128 for bf16;
non-bf16 z) runs the reference; `covers()` says which, and the first fallback per reason is logged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import mxfp4, ops
from k3jax.presets import get_preset
from pallas_kernels import mgpu, registry


BLOCK = 64                 # weight rows per program (wgmma M) and columns per wgmma K-tile
MX_STEP = 512              # unpacked input columns per MXFP4 pipeline step: 256 packed bytes per row
SCALE_COLS = 512           # input columns per scale block: 16 bytes per row, the narrowest TMA box
SCALE_STEPS = SCALE_COLS // MX_STEP    # steps sharing one scale block
KTILES = MX_STEP // BLOCK
BF16_STEP = 128            # input columns per pipeline step for bf16 experts (SMEM: module doc)
QUADS = MX_STEP // 128     # 128-column blocks per step: one 16-byte group per thread and row each
# Experts in tiles (mxfp4.to_tiles): a quad is one tile chunk, per row TILE_CODES code bytes and TILE_SCALES scales.
TILE_CODES, TILE_SCALES = mxfp4.TILE_COLS // 2, mxfp4.TILE_COLS // mxfp4.GROUP
MAX_TOKENS = 64
# Tokens from which each expert runs only on its own tokens (`_moe_groups`), by is_mxfp4: MXFP4
# past 32 (at 32 the two schedules tie, K3 E=448 in tiles, session 28: rows / grouped 2350 / 2355
# us on the H200, 2475 / 2500 on the H100; at 128 tokens grouped is 3.4x / 2.6x faster), bf16 past
# one call of MAX_TOKENS (at 32 tokens the row schedule already runs at the copy rate: Kimi-Linear 91%).
GROUPED_FROM = {True: 33, False: MAX_TOKENS + 1}
# Tokens from which the row schedule's down kernel runs grouped, by is_mxfp4 (`_moe_rows`: every
# distinct expert's gate/up on all tokens, then each choice's h column gathered into its slot and
# each slot's down on its own tokens: the "mixed" schedule). Up to 32 tokens the row gate/up is the
# faster (its programs share one z; the grouped one reads a per-slot copy), from 17 the grouped
# down (N = 8 per slot, not N = Np per expert). H100, session 30, K3 E=448 tiles, op us rows /
# mixed / grouped: 16 tokens 1354 / 1431 / 1520, 20 1748 / 1708 / 1818, 24 1929 / 1899 / 2025,
# 28 2373 / 2148 / 2245, 32 2458 / 2320 / 2424, 40 3062 / 2876 / 2681.
GROUPED_DOWN_FROM = {True: 17, False: MAX_TOKENS + 1}
# Tokens per slot of the grouped schedule. 8 keeps the kernels at their batch-8 form (gate/up 168
# registers, three programs per SM); slots of 16 ran slower although they read each expert about
# once (H100, session 28: 4586 vs 3703 us at 128 tokens, 4874 vs 4586 at 256, where slots of 8
# read ~1.6 slots per expert), probably as their larger accumulators cost the third program.
SLOT_TOKENS = 8
# Slots per program of the grouped schedule's down kernel (strided, `_down`): one slot's 64 rows
# of w2 are a short stream, and eight per program amortise the pipeline's fill (H100, session 29, K3
# E=448 MXFP4: op 3111 vs 3276 us at 64 tokens, 3550 vs 3697 at 128, 4473 vs 4522 at 256; eight
# consecutive slots per program: 3073, 3514, but 4812 at 256, where an expert's two slots then
# run apart and read its weights twice).
DOWN_SLOTS_PER_PROGRAM = 8
assert max(GROUPED_FROM.values()) <= MAX_TOKENS + 1     # the row schedule takes at most MAX_TOKENS
assert min(GROUPED_DOWN_FROM.values()) > 1              # _moe_rows' gather needs expert_dispatch's sorted uniq
SMEM_PER_SM = 225 * 1024   # the H200's 228 KB per SM, less 1 KB reserved per resident block
# SMEM budgets per program, most wanted first, each with the stage counts to try. The MXFP4
# kernels are decode-latency bound: a third resident program (the register limit: 136 registers x
# 128 threads) beats a second pipeline stage (measured on the H200, session 5: gate/up 1 stage +
# down 2 stages at batch 1 / 8: 128 / 700 us, against 137 / 759 us for 2 + 4 stages at two
# programs per SM, and 171 / 997 us for 3 + 4 stages at one). bf16 experts run at the copy rate
# with two programs of 2-4 stages (budgets as measured in session 4).
OCCUPANCY = {True: ((SMEM_PER_SM // 3, (4, 3, 2, 1)), (SMEM_PER_SM // 2, (4, 3, 2, 1)), (220 * 1024, (2, 1))),
             False: ((110 * 1024, (4, 3, 2)), (220 * 1024, (2, 1)))}
# wgmma groups left in flight after each quad below 32 tokens (2: the next quad's decode overlaps
# the previous quad's wgmma; from 32 tokens 0, see _dequant_mma).
WGMMA_PENDING = 2
# Up to this many tokens per call or slot (N = 8: 1-8 tokens and the grouped schedule's slots) the
# compiled MXFP4 kernels multiply by warp-level mma.sync with B fragments read from SMEM
# (`_mma_sync_step`), not by wgmma: no SMEM descriptors (Mosaic hoists a step's 32 B descriptors
# out of the loop into 64 registers, and every wgmma moves two into uniform registers: 13% of
# the gate/up kernel's instructions at batch 1, ncu, session 37), 63 registers instead of 163.
# 0: wgmma everywhere (the ablation).
MMA_SYNC_MAX_TOKENS = 8
# The mma.sync gate/up kernel's step and stages: 256 columns, one stage (21 KB of SMEM), so the
# register limit (8 programs per SM) sets residency and batch 1's 768 programs run in one wave
# (H100 at the SM base clock, ncu, session 37, gate/up us: wgmma 81.1, mma.sync 512 columns one
# stage 93.5 (5 per SM: 1.16 waves) / padded to 3 per SM 80.2, 256 columns one stage 75.8,
# CuTe 75.9). Prefetching the next step at the same residency does not pay (H100 at boost, session
# 41, op us b1 / b8: shipped 109.3 / 703.7, 128 columns x 2 stages 111.1 / 706.8, x 3 113.6 / 708.1).
GATE_UP_SYNC_COLS, GATE_UP_SYNC_STAGES = 256, 1
# The mma.sync down kernel's step and stages: as gate/up's, 256 columns in one stage (13 KB), so
# batch 1's 896 programs are resident at once (512 x 2 stages: 4 per SM, 1.7 waves). H100 at
# boost, session 38, down us 512 x 2 -> 256 x 1: b1 39.1 -> 37.7, b8 266.3 -> 241.6, b32 (grouped
# slots) 774.7 -> 754.6, b128 1196.8 -> 1113.3. Session 41, op us b1 / b8, shipped 109.3 / 703.7:
# 128 columns x 2 stages 108.6 / 710.4, x 3 109.9 / 721.6 (no gain).
DOWN_SYNC_COLS, DOWN_SYNC_STAGES = 256, 1
TILED = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))
WGMMA = plgpu.Layout.WGMMA
COL = WGMMA.reduce(0)      # one value per accumulator column


def _lane_params() -> plgpu.CompilerParams:
    # Lane semantics: explicit register layouts (WGMMA) for the in-register decode.
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def unsupported(z, experts: ops.ExpertWeights) -> str | None:
    """Why the kernel does not cover z [N, M] with these experts (None: it does)."""
    n, m = z.shape
    inter = experts.w1.shape[1]
    if not experts.is_mxfp4 and experts.w1.dtype != jnp.bfloat16:
        return f"experts are {experts.w1.dtype}, the kernel takes MXFP4 or bfloat16"
    if z.dtype != jnp.bfloat16:
        return f"z is {z.dtype}, the kernel takes bfloat16"
    if n < 1:
        return "no tokens"
    unit = SCALE_COLS if experts.is_mxfp4 else BF16_STEP
    if m % unit or inter % unit:
        return f"M={m} or I={inter} not a multiple of {unit}"
    return None


def covers(z, experts) -> bool:
    return unsupported(z, experts) is None


def _step(mxfp4: bool) -> int:
    """Input columns per pipeline step."""
    return MX_STEP if mxfp4 else BF16_STEP


def _operands(experts: ops.ExpertWeights) -> tuple[tuple[jax.Array, ...], ...]:
    """Per matrix (w1, w3, w2), the arrays its pipeline steps read: (packed, scales) or (bf16,).
    Experts in tiles are viewed as codes [E, out/64, in/128, 64, 64] and scales [E, out/64,
    in/128, 256] (a reshape: mxfp4.to_tiles' order), so a step's weights are whole chunks."""
    if not experts.is_mxfp4:
        return (experts.w1,), (experts.w3,), (experts.w2,)
    pairs = (experts.w1, experts.s1), (experts.w3, experts.s3), (experts.w2, experts.s2)
    if not experts.tiled:
        return pairs
    tiles = lambda a, row: a.reshape(a.shape[0], a.shape[1] // BLOCK, -1, *row)      # noqa: E731
    return tuple((tiles(w, (BLOCK, TILE_CODES)), tiles(sc, (BLOCK * TILE_SCALES,))) for w, sc in pairs)


def permute_k(x: jax.Array, tiled: bool = False) -> jax.Array:
    """x [..., D] (D a multiple of 128) -> its columns in the kernels' contraction order: within
    each 128 columns, column 32q + 8k + a + 4n moves to 32k + 8a + 2q + n (see module doc); tiled
    (tile words: pair a of a word is columns 2a, 2a + 1): column 32q + 8k + 2a + n does."""
    *lead, d = x.shape
    nl = len(lead)
    if tiled:
        y = x.reshape(*lead, d // 128, 4, 4, 4, 2)                       # (q, k, a, n)
        return y.transpose(*range(nl + 1), nl + 2, nl + 3, nl + 1, nl + 4).reshape(*lead, d)
    y = x.reshape(*lead, d // 128, 4, 4, 2, 4)                           # (q, k, n, a)
    return y.transpose(*range(nl + 1), nl + 2, nl + 4, nl + 1, nl + 3).reshape(*lead, d)


def _k_tiles(x: jax.Array, tiled: bool) -> jax.Array:
    """x [..., Np, D] -> [..., D/64, Np, 64]: permuted columns (permute_k), 64-column wgmma K-tiles
    outermost (a pipeline step's tiles are contiguous; wgmma operands cannot be strided views)."""
    *lead, n, d = x.shape
    return jnp.swapaxes(permute_k(x, tiled).reshape(*lead, n, d // BLOCK, BLOCK), -3, -2)


# ------------------------------------------------------------------ the word decode (PTX)
# The one-fma decode, its programs and its exact range: k3jax.mxfp4 (shared with the CuTe kernels).
SCALE_BIAS = mxfp4.DECODE_FACTOR_BIAS
EXACT_SCALES = mxfp4.DECODE_EXACT_SCALES


def quad_addressing(w_strides: tuple[int, ...], s_strides: tuple[int, ...], quad: int) -> dict[str, int]:
    """Where `_decode_quad` finds quad `quad` of a step in SMEM, from the strides (elements) of the
    codes and scales buffers: row r's group q (q < 4) of codes starts at byte
    code_base + r * code_row + (group0 + q) * 16, its scale byte at scale_base + r * scale_row + group0 + q.
    Row order: w [64, 256], s [64, 16]; tiles: w [4, 64, 64], s [4, 256] (one chunk per quad)."""
    if len(w_strides) == 3:
        return dict(code_row=w_strides[1], code_base=quad * w_strides[0], scale_row=TILE_SCALES,
                    scale_base=quad * s_strides[0], group0=0)
    return dict(code_row=w_strides[0], code_base=0, scale_row=s_strides[0], scale_base=0, group0=4 * quad)


def _thread_rows():
    """(lane % 4, row g of the thread's 16-row warp slice): WGMMA / mma.sync fragment coordinates."""
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: mgpu_utils.c(v, i32)
    tid = mgpu_utils.thread_idx()
    lane, warp = arith.remui(tid, c(32)), arith.remui(arith.divui(tid, c(32)), c(4))
    return arith.remui(lane, c(4)), arith.addi(arith.muli(warp, c(16)), arith.divui(lane, c(4)))


def _lane(vec, j: int):
    """Element j of an MLIR vector value (a static extract)."""
    return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([j]))


def _decoded_pairs(w_ref, s_ref, quad: int) -> list[list[list[ir.Value]]]:
    """Inside an inline_mgpu body: the thread's decoded code pairs of quad `quad` of a step,
    pairs[r][k][a] (i32 = bf16x2: pair a of word k of its 16-byte group - row order: nibbles a,
    a + 4; tiles: columns 2a, 2a + 1 - in row 16 warp + lane // 4 + 8 r). Refs and layout as
    `_decode_quad`."""
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    c = lambda v: mgpu_utils.c(v, i32)
    w_strides, s_strides = (tuple(ir.MemRefType(r.type).get_strides_and_offset()[0]) for r in (w_ref, s_ref))
    at = quad_addressing(w_strides, s_strides, quad)
    q, row0 = _thread_rows()
    group = arith.addi(q, c(at["group0"]))       # the 16-byte group in the row
    w_ptr, s_ptr = mgpu_utils.memref_ptr(w_ref), mgpu_utils.memref_ptr(s_ref)
    words_ty = ir.VectorType.get((4,), i32)
    ptx = mxfp4.decode_word_ptx(tiled=len(w_strides) == 3)       # experts in tiles: tile words
    pairs = []
    for r in range(2):
        row = arith.addi(row0, c(8 * r))
        w_off = arith.addi(arith.muli(row, c(at["code_row"])), arith.addi(arith.muli(group, c(16)), c(at["code_base"])))
        words = llvm.load(words_ty, mgpu_utils.getelementptr(w_ptr, [w_off], i8), alignment=16)
        s_off = arith.addi(arith.muli(row, c(at["scale_row"])), arith.addi(group, c(at["scale_base"])))
        code = arith.extui(i32, llvm.load(i8, mgpu_utils.getelementptr(s_ptr, [s_off], i8)))
        # bf16 bits of 2^(code - 1) in both halves (the decode programs' factor)
        scale = arith.muli(arith.addi(code, c(SCALE_BIAS)), c(0x00800080))
        pairs.append([list(mgpu_utils.inline_ptx(ptx, _lane(words, k), scale, result_types=[i32] * 4))
                      for k in range(4)])
    return pairs


def _decode_quad(w_s, s_s, quad: int):
    """Compiled decode of K-tiles 2*quad and 2*quad+1 of a step: two bf16 [64, 64] arrays in the
    WGMMA register layout (A operands). w_s [64, 256] uint8 and s_s [64, 16] uint8 in SMEM, or for
    experts in tiles w_s [4, 64, 64] and s_s [4, 256] (chunk, then row: `_operands`).

    Thread (warp w, lane l) holds rows 16w + l//4 (+8) and, per K-tile, column pairs 8j + 2q
    (q = l % 4, j = 0..7); it reads the 16-byte group 4*quad + q of its rows (4 words, 32 codes,
    one scale) and puts word k's code pair a (codes a, a + 4) at j = 4(k%2) + a of K-tile 2*quad + k//2.
    """
    tile = plgpu.ShapeDtypeStruct((BLOCK, BLOCK), jnp.bfloat16, layout=WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=(tile, tile))
    def decode(_, w_ref, s_ref):
        pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = [np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape((BLOCK, BLOCK)), object) for _ in range(2)]
        for r, words in enumerate(_decoded_pairs(w_ref, s_ref, quad)):
            for k, pairs in enumerate(words):
                for a, p in enumerate(pairs):
                    regs[k // 2][0, 4 * (k % 2) + a, 0, 0, r, 0, 0, 0, 0] = mgpu_utils.bitcast(p, pair_ty)
        return tuple(mgpu_fa.FragmentedArray(_registers=x, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None)
                     for x in regs)

    return decode(w_s, s_s)


MMA_PTX = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
           "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")


def _mma_sync_step(accs, mats, x_s):
    """One pipeline step by mma.sync (warp-level m16n8k16, B fragments from SMEM: no wgmma
    descriptors). accs: float32 [64, Np] arrays in the WGMMA layout (the mma.sync C fragment of
    each warp's 16 rows), one per matrix; mats: (codes, scales) SMEM refs per matrix of experts in
    tiles; x_s [Np, cols] bf16, the step's activations in column order, tiled (8, 64) and swizzled
    (TILED). Returns accs + W_step @ x_step.

    Codes in tiles are tile words (pair a = columns 2a, 2a + 1): word k of the thread's 16-byte group (columns
    32q..32q+31 of a quad) decodes to columns 8k + 2a, +1, so its activations are the 16 bytes
    8k.. of the same columns: chunk k of the thread's 64 bytes, in K-tile 2 quad + q // 2 of the
    row, chunk 4 (q % 2) + k, which the 128-byte swizzle stores at chunk (4 (q % 2) + k) ^ (row % 8).
    mma step i of the quad's K-tile h takes word k = 2h + i // 2, pairs a0 = 2 (i % 2), a0 + 1 as A
    (rows g, g + 8) and words a0, a0 + 1 of chunk k as B: the wgmma register order of `_decode_quad`."""
    n_m, n_pad = len(mats), x_s.shape[0]
    acc_t = plgpu.ShapeDtypeStruct((BLOCK, n_pad), jnp.float32, layout=WGMMA)

    @plgpu.inline_mgpu(arg_types=((WGMMA,) * n_m, (plgpu.RefType(),) * (2 * n_m), plgpu.RefType(transforms=TILED)),
                       return_type=(acc_t,) * n_m)
    def step(_, accs, refs, x_ref):
        i8, i32, f32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32), ir.F32Type.get()
        c = lambda v: mgpu_utils.c(v, i32)
        row_tiles, ktiles, *tile = ir.MemRefType(x_ref.type).shape
        assert tile == [8, BLOCK] and row_tiles == n_pad // 8, ir.MemRefType(x_ref.type)
        q, row0 = _thread_rows()
        g = arith.remui(row0, c(8))                     # the thread's token in each 8-token tile
        x_ptr = mgpu_utils.memref_ptr(x_ref)
        lane = arith.addi(arith.muli(arith.divui(q, c(2)), c(1024)), arith.muli(g, c(128)))
        chunk = [arith.addi(lane, arith.muli(arith.xori(arith.addi(arith.muli(arith.remui(q, c(2)), c(4)), c(k)), g), c(16)))
                 for k in range(4)]                     # byte offsets of chunks k = 0..3 in K-tile pair 0
        vec_ty = ir.VectorType.get((4,), i32)
        regs = [np.array(a.registers, copy=True) for a in accs]
        for quad in range(ktiles // 2):
            pairs = [_decoded_pairs(refs[2 * m], refs[2 * m + 1], quad) for m in range(n_m)]
            b = [[llvm.load(vec_ty, mgpu_utils.getelementptr(x_ptr, [arith.addi(off, c((nt * ktiles + 2 * quad) * 1024))], i8),
                            alignment=16) for off in chunk] for nt in range(n_pad // 8)]     # b[nt][k]: 4 words
            for i in range(8):                          # mma step: K-tile i // 4, word k, pairs a0, a0 + 1
                k, a0 = 2 * (i // 4) + (i % 4) // 2, 2 * (i % 2)
                for m in range(n_m):
                    p = pairs[m]
                    a_regs = [p[0][k][a0], p[1][k][a0], p[0][k][a0 + 1], p[1][k][a0 + 1]]
                    for nt in range(n_pad // 8):
                        acc = [_lane(regs[m][0, nt, 0, 0, r, 0, 0, 0, 0], e) for r in range(2) for e in range(2)]
                        d = mgpu_utils.inline_ptx(MMA_PTX, *a_regs, _lane(b[nt][k], a0), _lane(b[nt][k], a0 + 1), *acc,
                                                  result_types=[f32] * 4)
                        for r in range(2):
                            regs[m][0, nt, 0, 0, r, 0, 0, 0, 0] = vector.from_elements(
                                ir.VectorType.get((2,), f32), [d[2 * r], d[2 * r + 1]])
        return tuple(mgpu_fa.FragmentedArray(_registers=x, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None)
                     for x in regs)

    return step(tuple(accs), tuple(r for m in mats for r in m), x_s)


def _dequant_mma(acc, k, w_s, s_s, x_s, stage_s) -> None:
    """acc[64, Np] += W_step @ x_step for pipeline step k: W_step = w_s [64, MX_STEP/2] packed codes
    and its part of s_s [64, SCALE_COLS/32] (the scale block steps k - k % SCALE_STEPS.. share),
    x_s [KTILES, Np, 64] permuted activation K-tiles. stage_s None: compiled (register A operands);
    else an SMEM [64, 64] bf16 tile (interpret mode: mxfp4.dequantize, permuted, staged)."""
    tiled = len(w_s.shape) == 3
    s_s = _step_scales(s_s, k, tiled)
    if stage_s is None:
        # A quad's wgmma overlaps the next quad's decode while the accumulators are small; from 32
        # tokens the registers that overlap holds cost occupancy (H200, session 5: gate/up at batch
        # 32 1744 -> 1506 us with the wait, batch 1 / 8 ~2% slower with it).
        pending = WGMMA_PENDING if acc.shape[1] < 32 else 0
        for quad in range(QUADS):
            for h, tile in enumerate(_decode_quad(w_s, s_s, quad)):
                plgpu.wgmma(acc, tile, x_s.at[2 * quad + h].T)
            plgpu.wgmma_wait(pending)    # (2: the previous quad's registers are free again)
        return
    codes, scales = w_s[...], s_s[...]
    if tiled:               # the step is one row tile's chunks: back to rows, [64, 256] codes and [64, 16] scales
        codes = mxfp4.from_tiles(codes.reshape(BLOCK, -1))
        scales = mxfp4.from_tiles(scales.reshape(BLOCK, -1), scales=True)
    w = permute_k(mxfp4.dequantize(codes, scales), tiled).astype(jnp.bfloat16)
    for t in range(KTILES):
        stage_s[...] = w[:, t * BLOCK:(t + 1) * BLOCK]
        plgpu.commit_smem()
        plgpu.wgmma(acc, stage_s, x_s.at[t].T)
        plgpu.wgmma_wait(0)


def _mma(acc, k, w_s, x_s, stage_s) -> None:
    """acc[64, Np] += pipeline step k of a matrix: w_s its weight refs, (packed, scales) (see
    _dequant_mma) or (a [64, 128] bf16 tile,), against x_s (that format's activation block)."""
    if len(w_s) == 2:
        _dequant_mma(acc, k, *w_s, x_s, stage_s)
    else:
        plgpu.wgmma(acc, w_s[0], x_s.T)


def _stages(n_pad: int, matrices: int, mxfp4: bool = True) -> int:
    """Pipeline stages: the most that fit the first budget of OCCUPANCY[mxfp4] any option fits.
    MXFP4 charges interpret mode's 8 KB staging tile in both modes (compiled, it is the margin for
    the epilogue tile and barriers)."""
    if mxfp4:   # + interpret mode's staging tile
        step, extra = matrices * (BLOCK * MX_STEP // 2 + BLOCK * SCALE_COLS // 32), BLOCK * BLOCK * 2
    else:
        step, extra = matrices * BLOCK * BF16_STEP * 2, 0
    step += n_pad * _step(mxfp4) * 2                          # the activations' bf16 block
    for budget, options in OCCUPANCY[mxfp4]:
        for stages in options:
            if stages * step + extra <= budget:
                return stages
    raise AssertionError("unreachable: one stage of a 64-token step fits")


def _weight_specs(mxfp4: bool, tiled: bool = False, cols: int = MX_STEP):
    """A matrix's blocks per step of `cols` input columns (MXFP4: codes, scales; bf16: the tile)."""
    if tiled:               # whole chunks of the expert's row tile (`_operands`)
        return [plgpu.BlockSpec((cols // 128, BLOCK, TILE_CODES), lambda k: (k, 0, 0)),
                plgpu.BlockSpec((cols // 128, BLOCK * TILE_SCALES), lambda k: (k, 0))]
    if mxfp4:
        return [plgpu.BlockSpec((BLOCK, cols // 2), lambda k: (0, k)),
                plgpu.BlockSpec((BLOCK, SCALE_COLS // 32), lambda k: (0, k // (SCALE_COLS // cols)))]
    return [plgpu.BlockSpec((BLOCK, BF16_STEP), lambda k: (0, k), transforms=TILED)]


def _x_spec(n_pad: int, mxfp4: bool, mma_sync: bool = False, cols: int = MX_STEP):
    """The activations' block per step: MXFP4 reads permuted K-tiles [cols/64, Np, 64] (`_x_layout`),
    or by mma.sync a plain [Np, cols] slice; bf16 a plain [Np, 128] slice (wgmma transposes it as
    the B operand). Plain slices are tiled (8, 64) and swizzled in SMEM."""
    if mxfp4 and not mma_sync:
        return plgpu.BlockSpec((cols // BLOCK, n_pad, BLOCK), lambda k: (k, 0, 0), transforms=TILED)
    if mxfp4:
        return plgpu.BlockSpec((n_pad, cols), lambda k: (0, k), transforms=TILED)
    return plgpu.BlockSpec((n_pad, BF16_STEP), lambda k: (0, k), transforms=TILED)


def _x_layout(x: jax.Array, experts: ops.ExpertWeights, mma_sync: bool = False) -> jax.Array:
    """x [..., Np, D] -> the layout `_x_spec` slices: [..., D/64, Np, 64] permuted (MXFP4 by wgmma)
    or x (bf16; MXFP4 by mma.sync: column order)."""
    return _k_tiles(x, experts.tiled) if experts.is_mxfp4 and not mma_sync else x


def _x_columns(xt: jax.Array, mxfp4: bool, mma_sync: bool) -> int:
    """The input columns D of activations xt in `_x_layout` (permuted K-tiles [..., D/64, Np, 64]
    for MXFP4 by wgmma, else [..., Np, D])."""
    return xt.shape[-3] * BLOCK if mxfp4 and not mma_sync else xt.shape[-1]


def _by_mma_sync(mxfp4_tiles: bool, n_pad: int) -> bool:
    """Whether the kernels multiply by mma.sync (compiled, MXFP4 experts in tiles, MMA_SYNC_MAX_TOKENS)
    or by wgmma."""
    return mxfp4_tiles and n_pad <= MMA_SYNC_MAX_TOKENS and mgpu.interpret_params() is None


def _step_scales(s_s, k, tiled: bool, cols: int = MX_STEP):
    """The scales of pipeline step k of `cols` columns: in row order its columns of the scale block
    s_s [64, SCALE_COLS/32] (SCALE_COLS / cols steps share it); in tiles s_s itself."""
    if tiled:
        return s_s
    groups = cols // 32
    return s_s.at[:, pl.ds(jax.lax.rem(k, SCALE_COLS // cols) * groups, groups)]


def _staging(body, staged: bool):
    """Runs body(stage_s): a scoped SMEM staging tile when `staged` (interpret-mode MXFP4), else None."""
    if not staged:
        return body(None)
    return pl.run_scoped(body, plgpu.SMEM((BLOCK, BLOCK), jnp.bfloat16, transforms=TILED))


def _gate_up(zt, uniq, coef, gate, up, *, act, beta, linear_beta, per_slot: bool = False, n_pad: int | None = None):
    """h [U, Np, I] bf16 = coef[u, n] * glu(z w1_u.T, z w3_u.T) for every slot u (0 for padding);
    coef [U, Np] float32, or [U] (one token: a scalar per slot, which also multiplies the padding
    columns, whose h is 0: their z rows are).
    Token-major: each program stores its [64, Np] tile transposed, so the down kernel's layout is
    a permutation within rows of I and the mixed schedule gathers whole rows (H100, session 30,
    against [U, I, Np]: 16 tokens op 1354 vs 1443 us, gate/up 852 vs 942; 1 and 8 tokens equal;
    128 grouped +0.5%). zt: z [Np, M] in `_x_layout`, or per_slot each slot's own tokens
    [U, Np, M] in `_x_layout`; by mma.sync z [N, M] unpadded may come with n_pad = Np (the TMA
    zero-fills rows N..Np-1: no XLA pad before the kernel); gate, up: `_operands` of w1, w3."""
    u_n, n_pad = uniq.shape[0], n_pad or zt.shape[-2]
    tiled = gate[0].ndim == 5
    n_exp, inter = gate[0].shape[0], gate[0].shape[1] * (BLOCK if tiled else 1)
    mx = len(gate) == 2
    staged = mx and mgpu.interpret_params() is not None
    sync = _by_mma_sync(tiled, n_pad)
    cols = GATE_UP_SYNC_COLS if sync else _step(mx)
    steps = _x_columns(zt, mx, sync) // cols
    stages = GATE_UP_SYNC_STAGES if sync else _stages(n_pad, 2, mx)
    specs = _weight_specs(mx, tiled, cols) * 2 + [_x_spec(n_pad, mx, sync, cols)]

    def moe_gate_up(zt_g, uniq_g, coef_g, *refs):
        *w_g, h_g = refs
        oi, ui = jax.lax.axis_index("o"), jax.lax.axis_index("u")
        eid = uniq_g[ui]
        rows = pl.ds(oi * BLOCK, BLOCK)
        operands = (*(w.at[eid, oi if tiled else rows] for w in w_g), zt_g.at[ui] if per_slot else zt_g)

        def by_wgmma(acc_g, acc_u, stage_s):
            def step(idx, *smem):
                *w_s, x_s = smem
                _mma(acc_g, idx[0], w_s[:len(gate)], x_s, stage_s)
                _mma(acc_u, idx[0], w_s[len(gate):], x_s, stage_s)
                plgpu.wgmma_wait(0)      # the step's slots are refilled after it
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=stages)(*operands)
            return acc_g[...], acc_u[...]

        def by_mma_sync():
            def step(idx, *args):
                *w_s, x_s, accs = args
                return _mma_sync_step(accs, [(w_s[0], _step_scales(w_s[1], idx[0], tiled, cols)),
                                             (w_s[2], _step_scales(w_s[3], idx[0], tiled, cols))], x_s)
            zero = plgpu.layout_cast(jnp.zeros((BLOCK, n_pad), jnp.float32), WGMMA)
            return plgpu.emit_pipeline(step, grid=(steps,), in_specs=specs, max_concurrent_steps=stages,
                                       init_carry=(zero, zero))(*operands)

        def scoped(o_s):
            o_t = o_s.transpose((1, 0))     # [64, Np]: the accumulator's orientation
            @pl.when(eid < n_exp)
            def _compute():
                if sync:
                    g, u = by_mma_sync()
                else:
                    g, u = pl.run_scoped(
                        lambda a, b: _staging(functools.partial(by_wgmma, a, b), staged),
                        plgpu.ACC((BLOCK, n_pad)), plgpu.ACC((BLOCK, n_pad)))
                # The reference's formula on registers: bf16 projections, float32 activation.
                h = ops.glu(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16), act, beta, linear_beta)
                if coef.ndim == 1:
                    cf = coef_g[ui]
                else:
                    cf = jax.lax.broadcast_in_dim(plgpu.load(coef_g.at[ui], layout=COL, optimized=False), h.shape, (1,))
                o_t[...] = (h.astype(jnp.float32) * cf).astype(jnp.bfloat16)

            @pl.when(eid >= n_exp)
            def _padding():
                o_t[...] = plgpu.layout_cast(jnp.zeros((BLOCK, n_pad), jnp.bfloat16), WGMMA)

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s, h_g.at[ui, :, rows])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((n_pad, BLOCK), jnp.bfloat16))

    return plgpu.kernel(
        moe_gate_up, out_type=jax.ShapeDtypeStruct((u_n, n_pad, inter), jnp.bfloat16),
        grid=(inter // BLOCK, u_n), grid_names=("o", "u"),
        compiler_params=_lane_params(), interpret=mgpu.interpret_params(),
    )(zt, uniq, coef, *gate, *up)


def down_splits(out_tiles: int, inter: int, slots: int, n_pad: int, sms: int, weight_bytes: float = 0.5) -> int:
    """Expert splits S of the down kernel: the divisor of the slot count maximising whole-wave SM
    fill x (weight bytes / (weight + float32 partial bytes)); ties go to the smaller split.
    weight_bytes: bytes per w2 element (0.5 packed MXFP4, 2 bf16)."""
    weight = slots * out_tiles * BLOCK * inter * weight_bytes   # w2 bytes if every slot is used
    best = (0.0, 1)
    for s in range(1, slots + 1):
        if slots % s:
            continue
        blocks = out_tiles * s
        fill = blocks / (math.ceil(blocks / sms) * sms)
        useful = weight / (weight + 2 * s * out_tiles * BLOCK * n_pad * 4)   # partials: written + read
        if fill * useful > best[0] + 1e-9:
            best = (fill * useful, s)
    return best[1]


def _down(ht, uniq, down, programs: int, *, n_pad: int, per_slot: bool = False):
    """float32 partials of w2_u @ h_u, a program per 64 output rows and U/programs slots u:
    [programs, M, Np], each the sum over its program's consecutive slots; or, per_slot, [U, M, Np],
    each valid slot's own (a program's slots strided by `programs`: one expert's slots, adjacent,
    run side by side and share its weight reads in L2; unused slots' rows are left unwritten).
    ht: h [U, Np, I] in `_x_layout` (per slot); down: `_operands` of w2."""
    u_n = uniq.shape[0]
    tiled = down[0].ndim == 5
    n_exp, m = down[0].shape[0], down[0].shape[1] * (BLOCK if tiled else 1)
    per = u_n // programs
    mx = len(down) == 2
    staged = mx and mgpu.interpret_params() is not None
    sync = _by_mma_sync(tiled, n_pad)
    cols = DOWN_SYNC_COLS if sync else _step(mx)
    steps = _x_columns(ht, mx, sync) // cols
    stages = DOWN_SYNC_STAGES if sync else _stages(n_pad, 1, mx)

    def moe_down(ht_g, uniq_g, *refs):
        *w_g, o_g = refs
        oi, si = jax.lax.axis_index("o"), jax.lax.axis_index("s")
        rows = pl.ds(oi * BLOCK, BLOCK)

        def add_slot(acc, stage_s, u, eid):
            """acc += w2_eid's rows @ h_u, streamed (wgmma into an accumulator ref)."""
            def step(idx, *smem):
                *w_s, x_s = smem
                _mma(acc, idx[0], w_s, x_s, stage_s)
                plgpu.wgmma_wait(0)
            plgpu.emit_pipeline(
                step, grid=(steps,),
                in_specs=_weight_specs(mx, tiled) + [_x_spec(n_pad, mx)], max_concurrent_steps=stages,
            )(*(w.at[eid, oi if tiled else rows] for w in w_g), ht_g.at[u])

        def add_slot_sync(acc, u, eid):
            """acc + w2_eid's rows @ h_u, streamed (mma.sync; acc a value)."""
            def step(idx, *args):
                *w_s, x_s, (a,) = args
                return _mma_sync_step((a,), [(w_s[0], _step_scales(w_s[1], idx[0], tiled, cols))], x_s)
            return plgpu.emit_pipeline(
                step, grid=(steps,), max_concurrent_steps=stages, init_carry=(acc,),
                in_specs=_weight_specs(mx, tiled, cols) + [_x_spec(n_pad, mx, mma_sync=True, cols=cols)],
            )(*(w.at[eid, oi if tiled else rows] for w in w_g), ht_g.at[u])[0]

        def accumulated(body):
            """body(acc, stage_s) in a fresh float32 accumulator ref -> its value."""
            return pl.run_scoped(lambda a: _staging(functools.partial(body, a), staged), plgpu.ACC((BLOCK, n_pad)))

        zero = lambda: plgpu.layout_cast(jnp.zeros((BLOCK, n_pad), jnp.float32), WGMMA)     # noqa: E731

        def one_slot(u, eid):
            """w2_eid's rows @ h_u [64, Np] float32."""
            if sync:
                return add_slot_sync(zero(), u, eid)
            def one(acc, stage_s):
                add_slot(acc, stage_s, u, eid)
                return acc[...]
            return accumulated(one)

        def program_slots():
            """The sum over this program's consecutive slots of w2 @ h [64, Np] float32 (padded
            slots read no weights)."""
            if sync:
                def slot(u, acc):
                    eid = uniq_g[u]
                    return jax.lax.cond(eid < n_exp, lambda a: add_slot_sync(a, u, eid), lambda a: a, acc)
                return jax.lax.fori_loop(si * per, (si + 1) * per, slot, zero())

            def summed(acc, stage_s):
                @pl.loop(si * per, (si + 1) * per)
                def _slot(u):
                    eid = uniq_g[u]

                    @pl.when(eid < n_exp)
                    def _():
                        add_slot(acc, stage_s, u, eid)
                return acc[...]
            return accumulated(summed)

        if per_slot:
            @pl.loop(0, per)
            def _slot(j):
                u = si + j * programs
                eid = uniq_g[u]

                @pl.when(eid < n_exp)      # unused slots read no weights and write nothing
                def _():
                    mgpu.store_tile(one_slot(u, eid), o_g.at[u, rows])
            return
        mgpu.store_tile(program_slots(), o_g.at[si, rows])

    return plgpu.kernel(
        moe_down, out_type=jax.ShapeDtypeStruct((u_n if per_slot else programs, m, n_pad), jnp.float32),
        grid=(m // BLOCK, programs), grid_names=("o", "s"),
        compiler_params=_lane_params(), interpret=mgpu.interpret_params(),
    )(ht, uniq, *down)


def moe_experts(z: jax.Array, ids: jax.Array, weights: jax.Array, experts: ops.ExpertWeights, *,
                act: str, beta: float, linear_beta: float | None, expert_chunk: int = 64) -> jax.Array:
    """Same contract as k3jax.ops.moe_experts: z [N, M], ids/weights [N, k] -> [N, M] in z's dtype.
    Below GROUPED_FROM tokens the distinct experts run on every token (`_moe_rows`; its down half
    grouped from GROUPED_DOWN_FROM); from there each expert on its own tokens (`_moe_groups`), in
    equal calls of at most ops.GROUPED_MAX_TOKENS rows (ops.map_token_chunks), each reading its
    selected experts once (an expert with more tokens than a slot holds: once per slot)."""
    why = unsupported(z, experts)
    if why is not None:
        return registry.fallback("moe_experts", "pallas", why)(z, ids, weights, experts, act=act, beta=beta,
                                                             linear_beta=linear_beta, expert_chunk=expert_chunk)
    act_kw = dict(act=act, beta=beta, linear_beta=linear_beta)
    if z.shape[0] < GROUPED_FROM[experts.is_mxfp4]:
        return _moe_rows(z, ids, weights, experts, **act_kw)
    return ops.map_token_chunks(lambda zc, ic, wc: _moe_groups(zc, ic, wc, experts, **act_kw),
                                z, ids, weights, ops.GROUPED_MAX_TOKENS)


def _moe_groups(z, ids, weights, experts: ops.ExpertWeights, *, act: str, beta: float,
                linear_beta: float | None) -> jax.Array:
    """The grouped schedule over at most ops.GROUPED_MAX_TOKENS tokens: each slot (ops.expert_groups)
    runs its expert on its own <= SLOT_TOKENS tokens only: the same two kernels, the activations
    and coefficients per slot (`_grouped_down` from there). z [N, M] -> [N, M] in z's dtype."""
    n_exp = experts.w1.shape[0]
    gate, up, _ = _operands(experts)
    uniq, choices, where = ops.expert_groups(ids, n_exp, SLOT_TOKENS, DOWN_SLOTS_PER_PROGRAM)
    zs = jnp.pad(z, ((0, 1), (0, 0)))[choices // ids.shape[1]]           # [S, G, M]; unused columns 0
    coef = jnp.pad(weights.reshape(-1).astype(jnp.float32), (0, 1))[choices]
    h = _gate_up(_x_layout(zs, experts, _by_mma_sync(experts.is_mxfp4 and experts.tiled, zs.shape[1])), uniq, coef, gate, up,
                 act=act, beta=beta, linear_beta=linear_beta, per_slot=True)
    return _grouped_down(h, uniq, where, experts).astype(z.dtype)


def _grouped_down(hs: jax.Array, uniq: jax.Array, where: jax.Array, experts: ops.ExpertWeights) -> jax.Array:
    """The grouped schedule's down half: hs [S, G, I] bf16 (each slot's coefficient-weighted h on
    its own tokens), uniq [S] and where [N, k] from ops.expert_groups -> [N, M] float32. The down
    kernel stores each slot's partial [M, G]; each token sums its k partial rows in choice order
    (a gather: deterministic)."""
    slots, g, _ = hs.shape
    _, _, down = _operands(experts)
    m = down[0].shape[1] * (BLOCK if experts.tiled else 1)
    part = _down(_x_layout(hs, experts, _by_mma_sync(experts.is_mxfp4 and experts.tiled, g)), uniq, down,
                 slots // DOWN_SLOTS_PER_PROGRAM, n_pad=g, per_slot=True)
    rows = jnp.pad(jnp.swapaxes(part, 1, 2).reshape(slots * g, m), ((0, 1), (0, 0)))       # + a zero row
    return rows[where].sum(1)


def _moe_rows(z, ids, weights, experts: ops.ExpertWeights, *, act: str, beta: float,
              linear_beta: float | None) -> jax.Array:
    """The row schedule, one kernel pair over at most MAX_TOKENS tokens: z [N, M] -> [N, M] in z's
    dtype. From GROUPED_DOWN_FROM tokens the down half runs grouped: each choice's h row, taken
    from its expert's, fills its slot's column (ops.expert_groups; a token's repeated id, which top-k
    never gives, keeps its summed coefficient in the last of its choices and zero in the others:
    ops.repeated_later)."""
    n, k = ids.shape
    n_exp, inter = experts.w1.shape[:2]
    m = z.shape[1]
    mx = experts.is_mxfp4
    gate, up, down = _operands(experts)
    n_pad = max(8, -(-n // 8) * 8)
    slots = min(n_exp, n * k)
    uniq, coef = ops.expert_dispatch(ids, weights, n_exp, slots)
    if ops.dispatch_in_choice_order(ids, slots):
        # Slot j's coefficient is routing weight j, a scalar the kernel reads itself - no XLA
        # launch for the padded matrix (an id >= E is a padding slot the kernel skips: its
        # weight is never read).
        coef = weights[0].astype(jnp.float32)
    else:
        coef = jnp.pad(coef, ((0, 0), (0, n_pad - n)))
    sync = _by_mma_sync(mx and experts.tiled, n_pad)      # the kernels decide the same; the layouts of z and h follow it
    zt = z if sync else _x_layout(jnp.pad(z, ((0, n_pad - n), (0, 0))), experts)   # mma.sync: padded by the TMA
    h = _gate_up(zt, uniq, coef, gate, up, act=act, beta=beta, linear_beta=linear_beta, n_pad=n_pad)
    if n >= GROUPED_DOWN_FROM[mx]:
        slot_expert, choices, where = ops.expert_groups(ids, n_exp, SLOT_TOKENS, DOWN_SLOTS_PER_PROGRAM)
        row = jnp.searchsorted(uniq, slot_expert)        # each slot's expert's row of h (uniq sorted: n > 1)
        skip = jnp.pad(ops.repeated_later(ids).reshape(-1), (0, 1), constant_values=True)[choices]  # repeats, unused
        token = jnp.where(skip, n_pad, choices // k)                      # n_pad: past h, read as zeros
        hs = h.at[row[:, None], token].get(mode="fill", fill_value=0)      # [S, G, I]
        return _grouped_down(hs, slot_expert, where, experts).astype(z.dtype)
    ht = _x_layout(h, experts, sync)                                      # per slot, as z
    splits = down_splits(m // BLOCK, inter, slots, n_pad, mgpu.num_sms(), 0.5 if mx else 2.0)
    part = _down(ht, uniq, down, splits, n_pad=n_pad)
    return part.sum(0).T[:n].astype(z.dtype)


registry.register("moe_experts", "pallas", moe_experts)

# ------------------------------------------------------------------ validation / benchmark spec
_K3 = get_preset("k3-full")
ACT = tuple(_K3.activation.items())
K3_M, K3_I, K3_K = _K3.moe_hidden_size, _K3.moe_intermediate_size, _K3.num_experts_per_token
BENCH_BATCHES = (1, 8, 32, 64, 128, 256)
_KL = get_preset("kimi-linear-48b")      # bf16 experts, SwiGLU
KL_SHAPE = (_KL.moe_hidden_size, _KL.moe_intermediate_size, _KL.num_experts, _KL.num_experts_per_token)
KL_ACT = tuple(_KL.activation.items())


def _make(n: int, m: int, inter: int, n_exp: int, k: int, fmt: str = "mxfp4"):
    def make(key):
        kz, kr, kw, k1, k2, k3 = jax.random.split(key, 6)
        z = jax.random.normal(kz, (n, m), jnp.float32).astype(jnp.bfloat16)
        # Distinct experts per token, routing weights summing to 1 (as ops.route renormalises).
        ids = jax.vmap(lambda kk: jax.random.permutation(kk, n_exp)[:k])(jax.random.split(kr, n)).astype(jnp.int32)
        w = jax.random.uniform(kw, (n, k), jnp.float32, 0.1, 1.0)
        w = w / w.sum(-1, keepdims=True)
        # Scales ~ 1/sqrt(fan-in): hidden and output activations of order one.
        if fmt in ("mxfp4", "mxfp4-tiles"):
            (p1, q1), (p3, q3), (p2, q2) = (
                mxfp4.random_packed(kk, shape, scale_exp=round(-0.5 * math.log2(shape[-1])) - 1)
                for kk, shape in ((k1, (n_exp, inter, m)), (k2, (n_exp, inter, m)), (k3, (n_exp, m, inter))))
            experts = ops.ExpertWeights(p1, p3, p2, q1, q3, q2)
            if fmt == "mxfp4-tiles":
                experts = experts.in_tiles()
        else:
            experts = ops.ExpertWeights(*(
                (jax.random.normal(kk, shape, jnp.float32) * shape[-1] ** -0.5).astype(jnp.bfloat16)
                for kk, shape in ((k1, (n_exp, inter, m)), (k2, (n_exp, inter, m)), (k3, (n_exp, m, inter)))))
        return z, ids, w, experts
    return make


def cases() -> list[registry.Case]:
    small = [registry.Case(f"n{n}_m{m}_i{i}_e{e}_k{k}", _make(n, m, i, e, k), ACT, batch=n)
             for n, m, i, e, k in ((1, 512, 512, 4, 1), (2, 512, 512, 8, 2), (3, 1024, 512, 6, 2),
                                   (9, 512, 1024, 16, 4))]
    # The grouped schedule (from GROUPED_FROM tokens): ~17 tokens per expert, each in 2-3 slots;
    # bf16 past one row-schedule call.
    small.append(registry.Case("grouped_n69", _make(69, 512, 512, 8, 2), ACT, batch=69))
    # Row gate/up, grouped down (from GROUPED_DOWN_FROM tokens), experts in tiles.
    small.append(registry.Case("mixed_n20", _make(20, 512, 1024, 8, 2, "mxfp4-tiles"), ACT, batch=20))
    small.append(registry.Case("bf16_grouped_n70", _make(70, 128, 256, 8, 2, "bf16"), ACT, batch=70))
    small.append(registry.Case("silu_n1", _make(1, 512, 512, 4, 1), (("act", "silu"), ("beta", 1.0),
                                                                      ("linear_beta", None)), batch=1))
    small += [registry.Case(f"bf16_n{n}_m{m}_i{i}_e{e}_k{k}", _make(n, m, i, e, k, "bf16"), ACT, batch=n)
              for n, m, i, e, k in ((1, 256, 128, 4, 1), (2, 128, 256, 8, 2), (3, 384, 128, 6, 2),
                                    (9, 256, 256, 16, 4))]
    small.append(registry.Case("tiles_n2_m512_i1024_e8_k2", _make(2, 512, 1024, 8, 2, "mxfp4-tiles"), ACT, batch=2))
    small.append(registry.Case("bf16_silu_n2", _make(2, 128, 128, 4, 2, "bf16"), KL_ACT, batch=2))
    # Outside the kernel's coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_bf16_m192", _make(2, 192, 64, 4, 2, "bf16"), ACT, batch=2))
    small.append(registry.Case("fallback_m96", _make(2, 96, 64, 4, 2), ACT, batch=2))
    k3 = [registry.Case(f"k3_e{e}_b{b}", _make(b, K3_M, K3_I, e, K3_K), ACT, batch=b, sizes=frozenset({"k3"}))
          for e in (448, 896) for b in BENCH_BATCHES]
    k3 += [registry.Case(f"k3_e448_tiles_b{b}", _make(b, K3_M, K3_I, 448, K3_K, "mxfp4-tiles"), ACT, batch=b,
                         sizes=frozenset({"k3"})) for b in (1, 8, 32, 128, 256)]   # experts in tiles (mxfp4.to_tiles)
    m, i, e, k = KL_SHAPE
    k3 += [registry.Case(f"kimi_linear_bf16_e{e}_b{b}", _make(b, m, i, e, k, "bf16"), KL_ACT, batch=b,
                         sizes=frozenset({"k3"})) for b in (1, 8, 32)]
    # K3 with bf16 experts (expert_format "bf16"): the MXFP4-vs-bf16 ablation, 29.6 GB of experts.
    k3 += [registry.Case(f"k3_bf16_e448_b{b}", _make(b, K3_M, K3_I, 448, K3_K, "bf16"), ACT, batch=b,
                         sizes=frozenset({"k3"})) for b in (1, 8)]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """Packed weight + scale bytes of the distinct selected experts, plus z in and y out."""
    z, ids, _, experts = args
    n, m = z.shape
    distinct = len(set(map(int, jax.device_get(ids).reshape(-1))))
    per_expert = sum(w[0].size * w.dtype.itemsize for w in (experts.w1, experts.w3, experts.w2))
    if experts.is_mxfp4:
        per_expert += sum(s[0].size for s in (experts.s1, experts.s3, experts.s2))
    inter = experts.w1.shape[1]
    return float(distinct * per_expert + 2 * z.size * z.dtype.itemsize), 6.0 * n * ids.shape[1] * m * inter


registry.register_spec(registry.OpSpec(
    name="moe_experts", reference=ops.moe_experts, cases=cases, cost=cost,
    notes="MXFP4 or bf16 experts, bf16 z, M and I multiples of 512 (MXFP4) / 128 (bf16) in the kernel "
          "(grouped by expert past 32 tokens, bf16 past 64: slots of 8; calls of at most 256 tokens); "
          "else the reference",
))
