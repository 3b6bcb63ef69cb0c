"""One KDA decode step after the projections, as one Mosaic GPU kernel over the recurrent state.

Same contract as k3jax.ops.kda_decode: conv_state [B, K-1, 3P] and qkv [B, 3P] (bf16), conv_w
[3P, K] f32, f, gate [B, P], beta_logit [B, H], a_log [H], dt_bias [P], o_norm [d], recurrent
[B, H, d, d] f32 -> (o [B, P], new conv_state, new recurrent).

Grid (B, H): one warpgroup per (sequence, head). The head's state S [d, d] float32 (64 KB at
d = 128) is the step's dominant traffic, read once and written once: it travels GMEM -> SMEM by
one TMA copy that is issued first, so its latency hides behind the per-channel work done
meanwhile from the small inputs: the short conv + SiLU (ops.conv_taps, the reference's
formula) of the head's q, k and v channels, L2 norms (ops.l2_normalize), the decay
(ops.log_decay: K3's lower-bound gate or Kimi-Linear's softplus form) and beta.
S then sits in registers in the wgmma layout (rows = key channels, 128 f32 per thread), where
the delta rule is a few broadcasts and two column reductions; the read-out goes through the
gated RMSNorm (ops.gated_rms_norm) and S back to GMEM by TMA. The shifted conv window is
written by the same program (its 3 x d channels of every row).

Mosaic GPU lowers only broadcasts it can lay out (no [d] -> [d, 1] expand_dims), so the
delta-rule step is spelled with explicit broadcasts here, operation for operation as in
ops.kda_recurrent_step; validation against that reference is the guard. With d not 64 or 128,
or for non-bf16 activations the reference runs (`unsupported()` says why; logged once).

Roofline: 2 x B x H x d^2 x 4 bytes of state (B = 1, K3: 12.6 MB, ~2.9 us at 4.3 TB/s;
Kimi-Linear-48B, H = 32: 4.2 MB, ~1 us), plus < 3% of small inputs. At B = 1 the grid has 96
(K3) or 32 (Kimi-Linear) programs for 132 SMs, so the step is bounded by one program's TMA-in /
compute / TMA-out latency; the grid fills the SMs from B = 2 (K3) or B = 5 (Kimi-Linear).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import mgpu, registry


WGMMA = plgpu.Layout.WGMMA
ROW, COL = WGMMA.reduce(1), WGMMA.reduce(0)   # a vector along S's rows (key) / columns (value)
f32 = jnp.float32
# float32 rows in 128-byte swizzled tiles: bank-conflict-free loads/stores in the wgmma layout.
STATE_TILING = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def unsupported(conv_state, qkv, f, num_heads: int) -> str | None:
    """Why the kernel does not cover this call (None: it does). Both gate forms are covered."""
    d = f.shape[-1] // num_heads
    if qkv.dtype != jnp.bfloat16 or conv_state.dtype != jnp.bfloat16:
        return f"activations are {qkv.dtype}/{conv_state.dtype}, the kernel takes bfloat16"
    if d % 64 or d > 128:
        return f"head dim {d} (the kernel takes 64 or 128)"
    return None


def _bcast(x, shape, dim: int):
    return jax.lax.broadcast_in_dim(x, shape, (dim,))


def _kernel(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
            *, num_heads: int, lower_bound: float, eps: float):
    b_n, km1, c3 = conv_state.shape
    h_n, d = num_heads, recurrent.shape[-1]
    p = c3 // 3
    ksize = km1 + 1
    bf16 = qkv.dtype

    def body(cs_g, qkv_g, cw_g, f_g, bl_g, gate_g, alog_g, dtb_g, on_g, s_g, o_g, cs_out_g, s_out_g):
        b, h = jax.lax.axis_index("b"), jax.lax.axis_index("h")

        def vec(ref, layout):
            return plgpu.load(ref, layout=layout, optimized=False)

        def scoped(s_smem, o_smem, win_smem, v_smem, bar):
            # The state's read is the step's cost: start it before anything else.
            plgpu.copy_gmem_to_smem(s_g.at[b, h], s_smem, bar)

            def conv(part, layout):
                ch = pl.ds(part * p + h * d, d)
                taps = [vec(cs_g.at[b, j, ch], layout) for j in range(km1)] + [vec(qkv_g.at[b, ch], layout)]
                # The shifted window (rows 1..K-2, then the new input) for the new conv state.
                for j in range(km1):
                    win_smem[part, j] = taps[j + 1].astype(bf16)
                return ops.conv_taps(taps, [vec(cw_g.at[ch, j], layout) for j in range(ksize)])

            q = ops.l2_normalize(conv(0, ROW)) * d ** -0.5
            k = ops.l2_normalize(conv(1, ROW))
            # conv_w's columns are strided, which only the row layout loads: v goes through SMEM
            # to reach the column layout the update needs.
            v_smem[...] = conv(2, ROW)
            heads = pl.ds(h * d, d)
            # ops.kda_decay's formula (either gate form), on this head's vector and scalar.
            g = ops.log_decay(vec(f_g.at[b, heads], ROW).astype(f32) + vec(dtb_g.at[heads], ROW).astype(f32),
                              jnp.exp(alog_g[h].astype(f32)), lower_bound)
            beta = jax.nn.sigmoid(bl_g[b, h].astype(f32))

            plgpu.commit_smem()
            v = plgpu.load(v_smem, layout=COL)
            plgpu.barrier_wait(bar)
            s = plgpu.load(s_smem, layout=WGMMA)                        # [d (key), d (value)] f32
            # ops.kda_recurrent_step: decay, delta-rule rank-1 update, read-out with q.
            s = s * _bcast(jnp.exp(g), s.shape, 0)
            kk = _bcast(k, s.shape, 0)
            pred = jnp.sum(kk * s, axis=0)
            u = beta * (v - pred)
            s = s + kk * _bcast(u, s.shape, 1)
            o = jnp.sum(_bcast(q, s.shape, 0) * s, axis=0)
            s_smem[...] = s
            o_smem[...] = ops.gated_rms_norm(o.astype(bf16), vec(gate_g.at[b, heads], COL),
                                             vec(on_g, COL), eps)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem, s_out_g.at[b, h])
            plgpu.copy_smem_to_gmem(o_smem, o_g.at[b, heads])
            for part in range(3):
                plgpu.copy_smem_to_gmem(win_smem.at[part], cs_out_g.at[b, :, pl.ds(part * p + h * d, d)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((d, d), f32, transforms=STATE_TILING), plgpu.SMEM((d,), bf16),
                      plgpu.SMEM((3, km1, d), bf16), plgpu.SMEM((d,), f32), plgpu.Barrier())

    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((b_n, p), bf16), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                  jax.ShapeDtypeStruct(recurrent.shape, recurrent.dtype)),
        grid=(b_n, h_n), grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=mgpu.interpret_params(),
    )(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent)


def kda_decode(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
               *, num_heads: int, lower_bound: float | None, eps: float):
    """Same contract as k3jax.ops.kda_decode."""
    why = unsupported(conv_state, qkv, f, num_heads)
    if why is not None:
        return registry.fallback("kda_decode", "pallas", why)(
            conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
            num_heads=num_heads, lower_bound=lower_bound, eps=eps)
    return _kernel(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
                   num_heads=num_heads, lower_bound=lower_bound, eps=eps)


registry.register("kda_decode", "pallas", kda_decode)

# ------------------------------------------------------------------ validation / benchmark spec
K3_HEADS, K3_D, K3_CONV = 96, 128, 4
KL_HEADS = 32      # Kimi-Linear-48B: 32 heads of 128, conv 4, no gate lower bound (softplus form)
KL_BATCHES = (1, 8, 32)
BENCH_BATCHES = (1, 8, 32, 128)


def _make(b: int, h: int, d: int, ksize: int = 4, dtype=jnp.bfloat16):
    def make(key):
        ks = jax.random.split(key, 10)
        p = h * d
        nrm = lambda kk, shape, scale=1.0: jax.random.normal(kk, shape, f32) * scale  # noqa: E731
        conv_state = nrm(ks[0], (b, ksize - 1, 3 * p)).astype(dtype)
        qkv = nrm(ks[1], (b, 3 * p)).astype(dtype)
        conv_w = nrm(ks[2], (3 * p, ksize), 0.5)
        f = nrm(ks[3], (b, p)).astype(dtype)
        beta_logit = nrm(ks[4], (b, h)).astype(dtype)
        gate = nrm(ks[5], (b, p)).astype(dtype)
        a_log = nrm(ks[6], (h,), 0.5)
        dt_bias = nrm(ks[7], (p,), 0.5)
        o_norm = 1.0 + nrm(ks[8], (d,), 0.1)
        recurrent = nrm(ks[9], (b, h, d, d), 0.3)
        return conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent
    return make


def _kw(h: int, lower_bound=-5.0, eps=1e-5):
    return (("num_heads", h), ("lower_bound", lower_bound), ("eps", eps))


def cases() -> list[registry.Case]:
    small = [registry.Case(f"b{b}_h{h}_d{d}", _make(b, h, d), _kw(h), batch=b)
             for b, h, d in ((1, 2, 128), (3, 1, 64), (2, 3, 128))]
    # Kimi-Linear's softplus decay form (no lower bound).
    small += [registry.Case(f"softplus_b{b}_h{h}_d{d}", _make(b, h, d), _kw(h, None), batch=b)
              for b, h, d in ((1, 2, 128), (2, 2, 64))]
    # Outside the kernel's coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_f32", _make(1, 2, 64, dtype=f32), _kw(2), batch=1))
    big = frozenset({"k3"})     # real model shapes: GPU validation and benchmarks
    k3 = [registry.Case(f"k3_b{b}", _make(b, K3_HEADS, K3_D, K3_CONV), _kw(K3_HEADS), batch=b, sizes=big)
          for b in BENCH_BATCHES]
    kl = [registry.Case(f"kimi_linear_b{b}", _make(b, KL_HEADS, K3_D, K3_CONV), _kw(KL_HEADS, None), batch=b,
                        sizes=big) for b in KL_BATCHES]
    return small + k3 + kl


def cost(args, kwargs) -> tuple[float, float]:
    """Every input read once and every output written once (the state dominates)."""
    conv_state, qkv, *_ = args
    leaves = jax.tree.leaves(args)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    nbytes += qkv.size // 3 * qkv.dtype.itemsize + conv_state.size * conv_state.dtype.itemsize
    nbytes += args[-1].size * args[-1].dtype.itemsize
    return float(nbytes), 6.0 * args[-1].size


def compare(out, ref, args, kwargs) -> float:
    """Per output, error as a fraction of its allowance, times the bf16 tolerance (so one number
    compares against TOLERANCE['bfloat16']). Allowances: TOLERANCE of the output's dtype for the conv
    window and the state; twice that for o (bf16: two roundings, 2 x 2^-7), because o is rounded to
    bf16 before the gated norm (as fla and transformers do) and again after it, and which way the
    first rounding goes at a near-tie is decided by float32 summation order. Measured on the H200
    (benchmarks/results/kda-reference-diagnosis-gpu-20261130-s4.log): against the same formula run
    on XLA:CPU the kernel's o is exact at batch 1, while XLA:GPU's own run of the reference is
    1.2e-2 off (XLA:GPU drops the intermediate rounding: excess precision) and at batch 128 both
    are 1.07e-2 off."""
    tol = [registry.TOLERANCE[jnp.dtype(r.dtype).name] for r in ref]     # o, conv window, state
    tol[0] *= 2
    return max(registry.relative_max_error(o, r) / t * registry.TOLERANCE["bfloat16"]
               for o, r, t in zip(out, ref, tol, strict=True))


registry.register_spec(registry.OpSpec(
    name="kda_decode", reference=ops.kda_decode, cases=cases, cost=cost, compare=compare,
    tolerance=lambda args, kwargs: registry.TOLERANCE["bfloat16"],
    notes="bf16 activations, head dim 64/128 in the kernel (either gate form); else the reference",
))
