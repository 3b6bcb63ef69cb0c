"""Dense gated MLP at decode (K3's layer-0 MLP and fused shared experts):
y = down(glu(gate(x), up(x))), x [..., D] bf16 (1-256 rows), weights bf16 w_gate/w_up [I, D],
w_down [D, I] (HF [out, in] layout). Same contract as k3jax.ops.gated_mlp.

Two Mosaic GPU kernels:
  * gate/up: grid (I/64, row blocks). A program streams the same 64 rows of w_gate and w_up
    together (TMA, `emit_pipeline`, tiles from `linear.k_tiles`) against the token rows and
    multiplies them swap-AB like `linear` (weights on the wgmma M side, rows padded to 8 on N),
    into two float32 accumulators. The epilogue applies ops.glu (the reference formula, on the
    registers) to the bf16-rounded projections, as the reference does, and writes h [Np, I] bf16
    (each tile stored transposed, `mgpu.store_transposed`; until session 36 [I, Np], which XLA
    transposed for the down projection: one launch more).
    The GLU needs the full dot products, so the input dimension is not split: the dense MLP
    (I = 33792) is 528 programs = 4 whole waves on 132 SMs; the shared experts (I = 6144) are
    96 programs, 73% of the SMs. More than 128 rows are cut into row blocks of <= 128 (two float32
    accumulators of [64, 128] are 128 registers a thread), which reads the weights once per block.
  * down: `linear.linear` (split-K swap-AB GEMV + XLA epilogue) on h's real rows.
h costs 2 * rows * I bytes written and read back; at K3 shapes that is < 0.1% of the weight bytes
at batch 1 (and 1.5% at batch 128).

Anything else (non-bf16, D or I not a multiple of 64, more than 256 rows) runs the reference;
`unsupported()` says why, and the first fallback per reason is logged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from k3jax.presets import get_preset
from pallas_kernels import linear as lin
from pallas_kernels import mgpu, registry


BLOCK_N = 128      # most token rows per program: two [64, BLOCK_N] float32 accumulators in registers


def unsupported(x, w_gate, w_up, w_down) -> str | None:
    """Why the kernels do not cover this call (None: they do)."""
    rows = math.prod(x.shape[:-1])
    inter, d = w_gate.shape
    if any(a.dtype != jnp.bfloat16 for a in (x, w_gate, w_up, w_down)):
        return "x and weights must all be bfloat16"
    if w_up.shape != (inter, d) or w_down.shape != (d, inter) or x.shape[-1] != d:
        return f"shapes x {x.shape}, w_gate {w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape} do not chain"
    if d % 64 or inter % lin.BLOCK_OUT:
        return f"D={d} or I={inter} not a multiple of 64"
    if not 1 <= rows <= lin.MAX_ROWS:
        return f"{rows} rows (the kernels take 1-{lin.MAX_ROWS})"
    return None


def covers(x, w_gate, w_up, w_down) -> bool:
    return unsupported(x, w_gate, w_up, w_down) is None


def row_blocks(rows: int) -> tuple[int, int]:
    """(block_n, blocks): the fewest row blocks of <= BLOCK_N rows, each a multiple of 8."""
    n8 = max(8, -(-rows // 8) * 8)
    blocks = -(-n8 // BLOCK_N)
    return -(-n8 // blocks // 8) * 8 if blocks > 1 else n8, blocks


def _gate_up(xp: jax.Array, w_gate: jax.Array, w_up: jax.Array, block_n: int, *,
             act: str, beta: float, linear_beta: float | None) -> jax.Array:
    """h [Np, I] bf16 = glu(xp @ w_gate.T, xp @ w_up.T), xp [Np, D] bf16 (Np = blocks * block_n): each
    block's [64, block_n] tile stored transposed (token-major, as the down projection reads it)."""
    n_pad, din = xp.shape
    inter = w_gate.shape[0]
    bo = lin.BLOCK_OUT
    block_k, stages = lin.k_tiles(block_n, din, weight_rows=2 * bo)
    k_steps = din // block_k
    stages = min(stages, k_steps)
    # A stage is refilled only after the next step's two wgmmas were issued and the previous
    # step's retired (wgmma_wait(2)); with a single step nothing is refilled.
    delay = 1 if stages >= 2 else 0

    def gated_mlp_kernel(x_g, wg_g, wu_g, h_g):
        oi, ni = jax.lax.axis_index("o"), jax.lax.axis_index("n")
        rows, cols = pl.ds(oi * bo, bo), pl.ds(ni * block_n, block_n)

        def acc_scope(acc_g, acc_u):
            def step(_, wg_s, wu_s, x_s):
                xt = x_s.transpose((1, 0))
                plgpu.wgmma(acc_g, wg_s, xt)
                plgpu.wgmma(acc_u, wu_s, xt)
                plgpu.wgmma_wait(2 * delay)
            w_spec = plgpu.BlockSpec((bo, block_k), lambda k: (0, k), delay_release=delay)
            plgpu.emit_pipeline(
                step, grid=(k_steps,),
                in_specs=[w_spec, w_spec,
                          plgpu.BlockSpec((block_n, block_k), lambda k: (0, k), delay_release=delay)],
                max_concurrent_steps=stages,
            )(wg_g.at[rows], wu_g.at[rows], x_g.at[cols])
            return acc_g[...], acc_u[...]

        gate, up = pl.run_scoped(acc_scope, plgpu.ACC((bo, block_n)), plgpu.ACC((bo, block_n)))
        # The reference's formula on registers: bf16 projections (as ops.linear returns them).
        h = ops.glu(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), act, beta, linear_beta)

        mgpu.store_transposed(h, h_g.at[cols, rows])

    return plgpu.kernel(
        gated_mlp_kernel, out_type=jax.ShapeDtypeStruct((n_pad, inter), jnp.bfloat16),
        grid=(inter // bo, n_pad // block_n), grid_names=("o", "n"),
        compiler_params=mgpu.warpgroup_params(), interpret=mgpu.interpret_params(),
    )(xp, w_gate, w_up)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              act: str, beta: float, linear_beta: float | None) -> jax.Array:
    """Same contract as k3jax.ops.gated_mlp: x [..., D] -> [..., D] in x's dtype."""
    why = unsupported(x, w_gate, w_up, w_down)
    if why is not None:
        return registry.fallback("gated_mlp", "pallas", why)(x, w_gate, w_up, w_down, act, beta, linear_beta)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    block_n, blocks = row_blocks(rows)
    xp = jnp.pad(x.reshape(rows, d), ((0, block_n * blocks - rows), (0, 0)))
    h = _gate_up(xp, w_gate, w_up, block_n, act=act, beta=beta, linear_beta=linear_beta)
    return lin.linear(h[:rows], w_down).reshape(*lead, d)


registry.register("gated_mlp", "pallas", gated_mlp)

# ------------------------------------------------------------------ validation / benchmark spec
_K3 = get_preset("k3-full")
K3_D = _K3.hidden_size
K3_INTER = {"dense": _K3.intermediate_size, "shared": _K3.moe_intermediate_size * _K3.num_shared_experts}
K3_ACT = tuple(_K3.activation.items())
BENCH_BATCHES = (1, 8, 32, 128)


def _make(rows: int, d: int, inter: int, dtype=jnp.bfloat16):
    def make(key):
        kx, kg, ku, kd = jax.random.split(key, 4)
        # Scales 1/sqrt(fan-in): projections and output of order one.
        x = jax.random.normal(kx, (rows, d), jnp.float32).astype(dtype)
        wg, wu = ((jax.random.normal(k, (inter, d), jnp.float32) * d ** -0.5).astype(dtype) for k in (kg, ku))
        wd = (jax.random.normal(kd, (d, inter), jnp.float32) * inter ** -0.5).astype(dtype)
        return x, wg, wu, wd
    return make


def cases() -> list[registry.Case]:
    small = [registry.Case(f"rows{r}_d{d}_i{i}", _make(r, d, i), K3_ACT, batch=r)
             for r, d, i in ((1, 128, 256), (5, 256, 128), (8, 64, 192), (136, 128, 64))]
    small.append(registry.Case("silu_rows3", _make(3, 128, 128), (("act", "silu"), ("beta", 1.0),
                                                                  ("linear_beta", None)), batch=3))
    # Outside the kernels' coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_i96", _make(2, 128, 96), K3_ACT, batch=2))
    k3 = [registry.Case(f"{name}_b{b}", _make(b, K3_D, i), K3_ACT, batch=b, sizes=frozenset({"k3"}))
          for name, i in K3_INTER.items() for b in BENCH_BATCHES]
    return small + k3


def cost(args, kwargs) -> tuple[float, float]:
    """The three weight matrices, x in and y out; 2 FLOPs per weight and row."""
    x, wg, wu, wd = args
    rows = math.prod(x.shape[:-1])
    weights = sum(w.size * w.dtype.itemsize for w in (wg, wu, wd))
    return float(weights + 2 * x.size * x.dtype.itemsize), 2.0 * rows * (wg.size + wu.size + wd.size)


registry.register_spec(registry.OpSpec(
    name="gated_mlp", reference=ops.gated_mlp, cases=cases, cost=cost,
    notes="bf16, D and I multiples of 64, 1-256 rows in the kernels; anything else runs the reference",
))
