"""One KDA decode step after the projections, as one Mosaic GPU kernel over the recurrent state.

Same contract as k3jax.ops.kda_decode: conv_state [B, K-1, 3P] and qkv = (q, k, v) [B, P] each
(bf16), conv_w = the q, k, v filters [P, K] f32 each (separate operands, read in place: stacking
them cost two XLA concatenations a layer every step before session 32), f, gate [B, P],
beta_logit [B, H], a_log [H], dt_bias [P], o_norm [d], recurrent [B, H, d, d] f32 -> (o [B, P],
new conv_state, new recurrent).

Grid (B, H, splits): `splits` programs (one warpgroup each) per (sequence, head), each owning
d / splits value columns of the head's state S [d, d] float32 (64 KB at d = 128). The delta rule
is independent per value column (rows = key channels): decay scales rows, pred[v] = k . S[:, v],
S[:, v] += k beta (v[v] - pred[v]), o[v] = q . S[:, v]. S is the step's dominant traffic, read
once and written once: each program's [d, d / splits] column slab travels GMEM -> SMEM by one
2-D TMA copy that is issued first, so its latency hides behind the per-channel work done
meanwhile from the small inputs, which every split does whole (cheap next to the slab): the
short conv + SiLU (ops.conv_taps, the reference's formula) of the head's q, k and v channels, L2
norms (ops.l2_normalize), the decay (ops.log_decay: K3's lower-bound gate or Kimi-Linear's
softplus form) and beta (`_head_inputs` = `_head_math` of `_head_loads`, the two pieces the
ablation's prep kernel below shares), one channel a thread (`_dense`) and moved to the row / column
layouts the delta rule broadcasts through SMEM. The slab then sits in registers in the wgmma
layout (128 / splits f32 a thread at d = 128), where the delta rule is a few broadcasts and two
column reductions; o is rounded to bf16 where ops.kda_decode rounds it, and the slab goes back
to GMEM by TMA, in place: the state is a mutable ref the call aliases (a donated decode state is
neither copied nor held twice; before session 6 XLA copied every layer's state after the
kernel). The gated RMSNorm (ops.gated_rms_norm) needs the mean square of the head's whole o:
with one split it runs in the kernel; with more, either the head's splits run as one cluster
(`_gated_norm`: each writes its slice's sum of squares to GMEM, `mgpu.cluster_sync`, each sums
them in split order and norms its own columns) or the kernel writes the rounded o and the same
call runs after it in XLA (`plan_norm` picks: session 35). The shifted conv window (3 x d
channels of every row) is written once: part i (q, k, v) by split i % splits.

Mosaic GPU lowers only broadcasts it can lay out (no [d] -> [d, 1] expand_dims), so the
delta-rule step is spelled with explicit broadcasts here, operation for operation as in
ops.kda_recurrent_step; validation against that reference is the guard. With d not 64 or 128,
or for non-bf16 activations the reference runs (`unsupported()` says why; logged once).

Roofline: 2 x B x H x d^2 x 4 bytes of state (B = 1, K3: 12.6 MB, ~2.9 us at 4.3 TB/s;
Kimi-Linear-48B, H = 32: 4.2 MB, ~1 us), plus < 3% of small inputs. One program is a serial
TMA-in / compute / TMA-out chain, so the step needs several per SM to overlap them. `plan`: 4
splits while the (sequence, head) pairs are fewer than the SMs (K3 b1: 96 pairs), else 2, whose
halved register slab lets more programs stay resident. Splitting repeats the small inputs' work
and reads (L2 hits) and needs the norm's sums across programs. The XLA norm after the kernel
reads B x P bf16 back (< 1% of bytes) but costs two launches: 2.7 of K3 batch 1's 8.7 us on an
H100 (session 34). The cluster norm instead adds ~1.5 us of latency to the end of every program
(the GMEM round trip and the barrier): at batch 1 (one wave) 9.5 against 10.7 us, from batch 8
(several waves) 9-13% slower than the XLA norm (H100, session 35), hence `plan_norm`. 1 split
(the norm in the kernel, no exchange) is slower everywhere measured.

The small inputs, not the slab's TMA, are the per-program cost: computed in the row layout the
delta rule broadcasts (each of a thread's 4 channels in 4 lanes) every load and operation was
issued 4 times, hence `_dense`. `kda_decode(prep=...)` keeps the two-kernel forms of sessions
7-17 for ablations: "kernel" (`_prep_kernel`, one warpgroup per (sequence, head) computing
`_head_loads` + `_head_math` one channel a thread and storing q, k, v, the exponentiated decay,
beta and the window from registers; then 4 splits) and "xla" (ops.kda_step_inputs as XLA ops, 5+
launches; then 2 splits). The conv window is not updated in place (its bytes are the same either
way); the gated norm of either follows `norm` as the fused kernel's does. Measurements of every
form and of what was tried and not kept (grouped prep programs, one launch of four-warpgroup
blocks sharing the prep, 8 splits, streaming programs, a head's splits in one block with the
gated norm inside, the cluster norm's exchange through DSMEM):
docs/pallas.md (`kda_decode`) and BENCHMARKS.md.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax import ops
from pallas_kernels import mgpu, registry


WGMMA = plgpu.Layout.WGMMA
ROW, COL = WGMMA.reduce(1), WGMMA.reduce(0)   # a vector along S's rows (key) / columns (value)
f32 = jnp.float32
SPLITS = (1, 2, 4)      # value-column splits the kernel takes (d / splits >= 16: one 64-byte row)
PREPS = ("fused", "xla", "kernel")      # where the inputs are prepared (`kda_decode`; module doc)
NORMS = ("cluster", "xla")      # where the gated norm runs with splits > 1 (`kda_decode`)
# Splits from one (sequence, head) pair per SM (`plan`), by where the inputs are prepared: 2 in the
# fused kernel (session 18) and after XLA's prep, 4 after the prep kernel (session 16: module doc).
PREPPED_SPLITS = {"fused": 2, "xla": 2, "kernel": 4}


def _state_tiling(cols: int):
    """SMEM transforms of a float32 [d, cols] slab: rows in swizzled tiles of min(128, 4 cols) bytes
    (128 at cols >= 32), so the wgmma-layout loads and stores are bank-conflict-free."""
    row = min(128, 4 * cols)
    return plgpu.TilingTransform((8, row // 4)), plgpu.SwizzleTransform(row)


def plan(batch: int, heads: int, sms: int, prep: str = "fused") -> int:
    """Value-column splits per (sequence, head), as measured best on the H200 (module doc): 4 while
    the (sequence, head) pairs are fewer than the SMs, else PREPPED_SPLITS of where the inputs are
    prepared."""
    return 4 if batch * heads < sms else PREPPED_SPLITS[prep]


def plan_norm(batch: int, heads: int, sms: int) -> str:
    """Where the gated norm runs with splits (one of NORMS), as measured on an H100 (session 35,
    module doc): in the kernel ("cluster") while the (sequence, head) pairs are fewer than the SMs
    (K3 batch 1: 9.5 vs 10.7 us), else after it ("xla": K3 batch 8-128 is 9-13% faster so)."""
    return "cluster" if batch * heads < sms else "xla"


def unsupported(conv_state, qkv, f, num_heads: int) -> str | None:
    """Why the kernel does not cover this call (None: it does). Both gate forms are covered."""
    d = f.shape[-1] // num_heads
    dtypes = [str(x.dtype) for x in (*qkv, conv_state)]
    if any(t != "bfloat16" for t in dtypes):
        return f"activations (q, k, v, conv_state) are {', '.join(dtypes)}; the kernel takes bfloat16"
    if d % 64 or d > 128:
        return f"head dim {d} (the kernel takes 64 or 128)"
    return None


def _bcast(x, shape, dim: int):
    return jax.lax.broadcast_in_dim(x, shape, (dim,))


def _vec(ref, layout):
    """A small vector from GMEM/SMEM in `layout` (ROW, COL or `_dense`)."""
    return plgpu.load(ref, layout=layout, optimized=False)


def _launch(body, out_type, grid: tuple[int, ...], grid_names: tuple[str, ...], *args,
            cluster: tuple[int, ...] = (), cluster_names: tuple[str, ...] = ()):
    """`body` as a Mosaic GPU kernel (one warpgroup per program, Lane semantics) over `grid`
    (clusters of `cluster` programs: grid x cluster programs in all)."""
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=grid_names, cluster=cluster, cluster_names=cluster_names,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=mgpu.interpret_params(),
    )(*args)


def _on_state(body, out_type, grid: tuple[int, int, int], *args, recurrent, cluster: bool):
    """Runs `body` over programs (B, H, splits), axes "b", "h", "s", with `recurrent` [B, H, d, d]
    float32 as its last operand, a mutable ref the call aliases and updates in place (a donated
    decode state is neither copied nor allocated twice) -> (body's outputs, new recurrent).
    `cluster`: a head's splits as one cluster of programs (`_gated_norm`)."""
    state = jax.new_ref(recurrent)
    if cluster:
        out = _launch(body, out_type, grid[:2], ("b", "h"), *args, state, cluster=grid[2:], cluster_names=("s",))
    else:
        out = _launch(body, out_type, grid, ("b", "h", "s"), *args, state)
    return out, jax.freeze(state)


def _dense(d: int):
    """The layout the small inputs are computed in: a head's d channels spread over the warpgroup's
    128 threads, d / 128 each (the row layout holds 4 per thread at d = 128, each in 4 lanes: 4x
    the loads and arithmetic); d < 128 keeps the row layout."""
    return plgpu.Layout.WG_STRIDED((d,), d // 128) if d % 128 == 0 else ROW


def _head_loads(cs_g, qkv_g, cw_g, f_g, bl_g, alog_g, dtb_g, b, h, d: int):
    """Inside a kernel: the loads of ops.kda_step_inputs for sequence b, head h (head dim d) from the
    GMEM refs conv_state, qkv (q, k, v), conv_w (their filters), f, beta_logit, a_log, dt_bias -> a
    pytree for `_head_math`:
    per part (q, k, v channels) the K conv taps (bf16) and conv_w columns (f32), f and dt_bias [d],
    all in `_dense`'s layout; a_log[h], beta_logit[b, h] scalars. Issued apart from the math so
    that a program can start the next head's loads before this head's math (`_prep_kernel`)."""
    km1, c3 = cs_g.shape[1:]
    p = c3 // 3
    layout = _dense(d)

    heads = pl.ds(h * d, d)

    def part(i):
        window = pl.ds(i * p + h * d, d)
        return ([_vec(cs_g.at[b, j, window], layout) for j in range(km1)] + [_vec(qkv_g[i].at[b, heads], layout)],
                [_vec(cw_g[i].at[heads, j], layout) for j in range(km1 + 1)])     # strided columns

    return ([part(i) for i in range(3)], _vec(f_g.at[b, heads], layout), _vec(dtb_g.at[heads], layout),
            alog_g[h], bl_g[b, h])


def _head_math(loaded, *, lower_bound: float | None):
    """Inside a kernel: ops.kda_step_inputs on one head's `_head_loads` -> (q, k, v, decay = exp(g):
    [d] float32 in the loads' layout; beta: a float32 scalar), and the head's shifted conv window:
    per part (q, k, v channels) its K-1 rows (rows 1..K-2 of the old window, then the new input)."""
    parts, f, dt_bias, a_log, beta_logit = loaded
    q, k, beta = ops.kda_qk_beta(ops.conv_taps(*parts[0]), ops.conv_taps(*parts[1]), beta_logit)
    v = ops.conv_taps(*parts[2])
    # ops.kda_decay's formula (either gate form), on this head's vector and scalar.
    g = ops.log_decay(f.astype(f32) + dt_bias.astype(f32), jnp.exp(a_log.astype(f32)), lower_bound)
    window = [taps[1:] for taps, _ in parts]
    return (q, k, v, jnp.exp(g), beta), window


def _head_inputs(cs_g, qkv_g, cw_g, f_g, bl_g, alog_g, dtb_g, win_smem, vec_smem, b, h, cols, *,
                 lower_bound: float | None):
    """`_head_math` of `_head_loads` for sequence b, head h, computed in `_dense`'s layout -> (q, k
    [d] in the row layout, v[cols] in the column layout, decay [d] in the row layout, beta), as the
    delta rule takes them
    (through vec_smem [4, d] float32); the shifted window goes into win_smem [3 (q, k, v channels),
    K-1, d]."""
    d = win_smem.shape[-1]
    loaded = _head_loads(cs_g, qkv_g, cw_g, f_g, bl_g, alog_g, dtb_g, b, h, d)
    (q, k, v, decay, beta), window = _head_math(loaded, lower_bound=lower_bound)
    for i, rows in enumerate(window):
        for j, row in enumerate(rows):
            win_smem[i, j] = row.astype(win_smem.dtype)
    for j, x in enumerate((q, k, decay, v)):
        vec_smem[j] = x
    plgpu.commit_smem()
    q, k, decay = (_vec(vec_smem.at[j], ROW) for j in range(3))
    return q, k, _vec(vec_smem.at[3, cols], COL), decay, beta


def _prep_kernel(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias, *, num_heads: int,
                 lower_bound: float | None, group: int = 1):
    """ops.kda_step_inputs as one kernel over grid (B, H / group): one warpgroup per sequence and
    `group` consecutive heads (1, the fastest measured; more for ablations: module doc), looping
    over them with the next head's loads issued before this head's math -> ((q, k, v,
    decay = exp(g) [B, H, d] float32, beta [B, H] float32), new conv_state [B, K-1, 3P])."""
    b_n, km1, c3 = conv_state.shape
    p = c3 // 3
    h_n, d = num_heads, p // num_heads
    if group < 1 or h_n % group:
        raise ValueError(f"_prep_kernel: group={group} does not divide num_heads={h_n}")

    def kda_step_prep(cs_g, *refs):
        qkv_g, cw_g, (f_g, bl_g, alog_g, dtb_g, q_g, k_g, v_g, dec_g, beta_g, cs_out_g) = refs[:3], refs[3:6], refs[6:]
        b, h0 = jax.lax.axis_index("b"), jax.lax.axis_index("h") * group

        def loads(i):
            return _head_loads(cs_g, qkv_g, cw_g, f_g, bl_g, alog_g, dtb_g, b, h0 + i, d)

        def head(i, loaded):
            # The next head's loads go out before this head's math (the last head's are not used).
            nxt = loads(jnp.minimum(i + 1, group - 1)) if group > 1 else loaded
            inputs, window = _head_math(loaded, lower_bound=lower_bound)
            h = h0 + i
            q, k, v, decay, beta = inputs
            beta_g[b, h] = beta
            for x, out in ((q, q_g), (k, k_g), (v, v_g), (decay, dec_g)):
                out[b, h] = x                   # straight from registers: no SMEM staging
            for part, rows in enumerate(window):
                for j, row in enumerate(rows):
                    cs_out_g[b, j, pl.ds(part * p + h * d, d)] = row
            return nxt

        jax.lax.fori_loop(0, group, head, loads(0))

    vec = jax.ShapeDtypeStruct((b_n, h_n, d), f32)
    *inputs, conv = _launch(
        kda_step_prep, (vec, vec, vec, vec, jax.ShapeDtypeStruct((b_n, h_n), f32),
                        jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        (b_n, h_n // group), ("b", "h"), conv_state, *qkv, *conv_w, f, beta_logit, a_log, dt_bias)
    return tuple(inputs), conv


def _delta_rule(s_smem, q, k, v, decay, beta, dtype):
    """ops.kda_recurrent_step on the [d (key), w (value)] float32 slab in s_smem (updated there and
    committed for TMA): decay, delta-rule rank-1 update, read-out with q -> o [w] in the column
    layout, rounded to `dtype` where ops.kda_decode rounds it.
    q, k, decay: [d] in the row layout; v: [w] in the column layout; beta: a scalar."""
    s = plgpu.load(s_smem, layout=WGMMA)
    s = s * _bcast(decay, s.shape, 0)
    kk = _bcast(k, s.shape, 0)
    pred = jnp.sum(kk * s, axis=0)
    u = beta * (v - pred)
    s = s + kk * _bcast(u, s.shape, 1)
    o = jnp.sum(_bcast(q, s.shape, 0) * s, axis=0).astype(dtype)
    s_smem[...] = s
    plgpu.commit_smem()
    return o


def _gated_norm(o, gate_g, on_g, eps: float, b, h, c, exchange):
    """Inside a kernel: ops.gated_rms_norm of program (b, h, c)'s o [w] (column layout), value
    columns c*w .. (c+1)*w of head h; gate_g [B, P], on_g [d] (the norm weight) in GMEM.
    exchange None: o is the whole head (w = d). Else (sums_g [B, H, splits] float32 in GMEM, a
    `mgpu.cluster_barrier`), the head's splits forming one cluster: each program writes its
    `ops.sum_squares` to sums_g[b, h, c], the cluster syncs (mgpu.cluster_sync), and each adds
    the head's splits up in split order (the same sum in every split: deterministic)."""
    w = o.shape[0]
    mean_sq = None
    if exchange is not None:
        sums_g, sync = exchange
        sums_g[b, h, c] = ops.sum_squares(o)
        mgpu.cluster_sync(sync)
        total = sums_g[b, h, 0]
        for j in range(1, sums_g.shape[-1]):
            total = total + sums_g[b, h, j]
        mean_sq = total / (w * sums_g.shape[-1])
    d = on_g.shape[0]
    return ops.gated_rms_norm(o, _vec(gate_g.at[b, pl.ds(h * d + c * w, w)], COL), _vec(on_g.at[pl.ds(c * w, w)], COL),
                              eps, mean_sq=mean_sq)


def _norms_in_kernel(splits: int, cluster: bool) -> bool:
    """Whether the delta-rule kernel applies the gated norm itself: one split holds the whole head;
    a cluster of splits exchanges their sums of squares (`_gated_norm`). Else XLA norms after it."""
    return splits == 1 or cluster


def _exchange_refs(b_n: int, h_n: int, splits: int, cluster: bool):
    """What a head's cluster exchanges its sums of squares through (`_gated_norm`): (extra kernel
    outputs: sums [B, H, splits] float32; scoped scratch: the cluster barrier), () without one."""
    if not cluster:
        return (), ()
    return (jax.ShapeDtypeStruct((b_n, h_n, splits), f32),), (mgpu.cluster_barrier("s"),)


def _finish(o, s_smem, o_smem, s_out, o_out, norm_args):
    """Inside a delta-rule kernel after `_delta_rule`: the slab back to `s_out` (in place, TMA),
    then o [w], gated-normed by `_gated_norm(o, *norm_args)` unless norm_args is None, to o_out."""
    plgpu.copy_smem_to_gmem(s_smem, s_out)          # first: the norm's exchange overlaps it
    if norm_args is not None:
        o = _gated_norm(o, *norm_args)
    o_smem[...] = o
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_out)


def _kernel(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
            *, num_heads: int, lower_bound: float | None, eps: float, splits: int, cluster: bool):
    """-> (o [B, P] bf16, new conv_state, new recurrent); o gated-normed with one split or with
    `cluster` (a head's splits exchange their sums of squares), else rounded before the norm."""
    b_n, km1, c3 = conv_state.shape
    h_n, d = num_heads, recurrent.shape[-1]
    p = c3 // 3
    w = d // splits         # value columns per program
    bf16 = qkv[0].dtype
    sums_type, sync_type = _exchange_refs(b_n, h_n, splits, cluster)
    norm_here = _norms_in_kernel(splits, cluster)

    def kda_decode_step(cs_g, *refs):
        qkv_g, cw_g = refs[:3], refs[3:6]
        f_g, bl_g, gate_g, alog_g, dtb_g, on_g, s_g, o_g, cs_out_g, *sums_g = refs[6:]
        b, h, c = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("s")
        cols = pl.ds(c * w, w)

        def scoped(s_smem, o_smem, win_smem, vec_smem, bar, *sync):
            # The state's read is the step's cost: start it before anything else.
            plgpu.copy_gmem_to_smem(s_g.at[b, h, :, cols], s_smem, bar)

            # q, k, the decay and beta are per key channel (rows): every split computes them whole.
            q, k, v, decay, beta = _head_inputs(cs_g, qkv_g, cw_g, f_g, bl_g, alog_g, dtb_g, win_smem, vec_smem,
                                                b, h, cols, lower_bound=lower_bound)
            plgpu.barrier_wait(bar)
            o = _delta_rule(s_smem, q, k, v, decay, beta, bf16)
            norm_args = (gate_g, on_g, eps, b, h, c, (*sums_g, *sync) or None) if norm_here else None
            _finish(o, s_smem, o_smem, s_g.at[b, h, :, cols], o_g.at[b, pl.ds(h * d + c * w, w)], norm_args)
            # The window's three parts (q, k, v channels) go out once, spread over the splits.
            for part in range(3):
                @pl.when(c == part % splits)
                def _(part=part):
                    plgpu.copy_smem_to_gmem(win_smem.at[part], cs_out_g.at[b, :, pl.ds(part * p + h * d, d)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((d, w), f32, transforms=_state_tiling(w)), plgpu.SMEM((w,), bf16),
                      plgpu.SMEM((3, km1, d), bf16), plgpu.SMEM((4, d), f32), plgpu.Barrier(), *sync_type)

    # The conv window is not updated in place: the splits of a head all read its taps while each
    # writes a part of the new window.
    (o, conv, *_), s = _on_state(
        kda_decode_step,
        (jax.ShapeDtypeStruct((b_n, p), bf16), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype), *sums_type),
        (b_n, h_n, splits), conv_state, *qkv, *conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm,
        recurrent=recurrent, cluster=cluster)
    return o, conv, s


def _state_kernel(q, k, v, decay, beta, gate, o_norm, recurrent, *, eps: float, splits: int, cluster: bool):
    """The delta rule alone, on prepared inputs (ops.kda_step_inputs): q, k, v, decay [B, H, d]
    float32, beta [B, H] float32, gate [B, P] -> (o [B, P] bf16, gated-normed as `_kernel`'s,
    new recurrent, in place)."""
    b_n, h_n, d = q.shape
    w = d // splits
    bf16 = gate.dtype
    sums_type, sync_type = _exchange_refs(b_n, h_n, splits, cluster)
    norm_here = _norms_in_kernel(splits, cluster)

    def kda_state_step(q_g, k_g, v_g, dec_g, beta_g, gate_g, on_g, s_g, o_g, *sums_g):
        b, h, c = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("s")
        cols = pl.ds(c * w, w)

        def scoped(s_smem, o_smem, bar, *sync):
            plgpu.copy_gmem_to_smem(s_g.at[b, h, :, cols], s_smem, bar)
            qv, kv, dv = (_vec(x.at[b, h], ROW) for x in (q_g, k_g, dec_g))
            vv = _vec(v_g.at[b, h, cols], COL)
            plgpu.barrier_wait(bar)
            o = _delta_rule(s_smem, qv, kv, vv, dv, beta_g[b, h], bf16)
            norm_args = (gate_g, on_g, eps, b, h, c, (*sums_g, *sync) or None) if norm_here else None
            _finish(o, s_smem, o_smem, s_g.at[b, h, :, cols], o_g.at[b, pl.ds(h * d + c * w, w)],
                    norm_args)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped, plgpu.SMEM((d, w), f32, transforms=_state_tiling(w)), plgpu.SMEM((w,), bf16),
                      plgpu.Barrier(), *sync_type)

    (o, *_), s = _on_state(kda_state_step, (jax.ShapeDtypeStruct((b_n, h_n * d), bf16), *sums_type),
                           (b_n, h_n, splits), q, k, v, decay, beta, gate, o_norm, recurrent=recurrent, cluster=cluster)
    return o, s


def kda_decode(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
               *, num_heads: int, lower_bound: float | None, eps: float, splits: int | None = None,
               prep: str = "fused", prep_group: int = 1, norm: str | None = None):
    """Same contract as k3jax.ops.kda_decode. splits (one of SPLITS; default `plan`) overrides the
    value-column split; prep (one of PREPS) where the conv, norms, decay and
    beta (ops.kda_step_inputs) are computed: "fused" inside the one kernel, "kernel" by
    `_prep_kernel` (prep_group heads per program) and "xla" by XLA ops, both before a kernel
    that does only the delta rule; norm (one of NORMS; default `plan_norm`) where the gated RMSNorm
    runs with more than one split: "cluster" in the kernel (a head's splits one cluster, exchanging
    their sums of squares), "xla" after it (one split always norms in the kernel). The overrides
    are for ablations and benchmarks."""
    if splits is not None and splits not in SPLITS:
        raise ValueError(f"kda_decode: splits={splits!r}; the kernel takes one of {SPLITS}")
    if prep not in PREPS:
        raise ValueError(f"kda_decode: prep={prep!r}; choose one of {PREPS}")
    if norm is not None and norm not in NORMS:
        raise ValueError(f"kda_decode: norm={norm!r}; choose one of {NORMS}")
    why = unsupported(conv_state, qkv, f, num_heads)
    if why is not None:
        return registry.fallback("kda_decode", "pallas", why)(
            conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
            num_heads=num_heads, lower_bound=lower_bound, eps=eps)
    sms = mgpu.num_sms()
    if prep_group != 1 and prep != "kernel":
        raise ValueError(f"kda_decode: prep_group={prep_group} groups the prep kernel's heads, but prep is {prep!r}")
    splits = splits or plan(f.shape[0], num_heads, sms, prep)
    cluster = splits > 1 and (norm or plan_norm(f.shape[0], num_heads, sms)) == "cluster"
    if prep == "fused":
        o, conv, s = _kernel(conv_state, qkv, conv_w, f, beta_logit, gate, a_log, dt_bias, o_norm, recurrent,
                             num_heads=num_heads, lower_bound=lower_bound, eps=eps, splits=splits, cluster=cluster)
    else:
        if prep == "kernel":
            (q, k, v, decay, beta), conv = _prep_kernel(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias,
                                                        num_heads=num_heads, lower_bound=lower_bound,
                                                        group=prep_group)
        else:
            (q, k, v, g, beta), conv = ops.kda_step_inputs(conv_state, qkv, conv_w, f, beta_logit, a_log, dt_bias,
                                                           num_heads, lower_bound)
            decay = jnp.exp(g)
        o, s = _state_kernel(q, k, v, decay, beta, gate, o_norm, recurrent, eps=eps, splits=splits, cluster=cluster)
    if not _norms_in_kernel(splits, cluster):      # the norm needs the whole head's o, spread over `splits` programs
        b, p = o.shape
        o = ops.gated_rms_norm(o.reshape(b, num_heads, -1), gate.reshape(b, num_heads, -1), o_norm,
                               eps).reshape(b, p)
    return o, conv, s


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
        qkv = tuple(nrm(kk, (b, p)).astype(dtype) for kk in jax.random.split(ks[1], 3))
        conv_w = tuple(nrm(kk, (p, ksize), 0.5) for kk in jax.random.split(ks[2], 3))
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
    # The delta-rule-only kernel after the prep kernel (which the size rule picks only from two
    # pairs per SM) and after XLA's prep (ablation).
    small += [registry.Case(f"{prep}_prep_{name}", _make(b, h, d), kw, batch=b, kernel_kwargs=(("prep", prep),))
              for prep in ("kernel", "xla")
              for name, (b, h, d), kw in (("b2_h3_d128", (2, 3, 128), _kw(3)), ("softplus_b2_h2_d64", (2, 2, 64), _kw(2, None)))]
    # Outside the kernel's coverage: must still match (the reference runs).
    small.append(registry.Case("fallback_f32", _make(1, 2, 64, dtype=f32), _kw(2), batch=1))
    big = frozenset({"k3"})     # real model shapes: GPU validation and benchmarks
    k3 = [registry.Case(f"k3_b{b}", _make(b, K3_HEADS, K3_D, K3_CONV), _kw(K3_HEADS), batch=b, sizes=big)
          for b in BENCH_BATCHES]
    kl = [registry.Case(f"kimi_linear_b{b}", _make(b, KL_HEADS, K3_D, K3_CONV), _kw(KL_HEADS, None), batch=b,
                        sizes=big) for b in KL_BATCHES]
    # The two-kernel ablations at K3 batch 8 (docs/pallas.md): after the prep kernel (one head a
    # program, and two: prep_group) and after XLA's prep.
    ablations = [registry.Case(f"{name}_k3_b8", _make(8, K3_HEADS, K3_D, K3_CONV), _kw(K3_HEADS), batch=8, sizes=big,
                               kernel_kwargs=kernel_kw)
                 for name, kernel_kw in (("kernel_prep", (("prep", "kernel"),)), ("xla_prep", (("prep", "xla"),)),
                                         ("kernel_prep_g2", (("prep", "kernel"), ("prep_group", 2))))]
    # The gated norm where `plan_norm` does not put it: by XLA at batch 1, in the kernel at batch 8.
    ablations += [registry.Case(f"{norm}_norm_k3_b{b}", _make(b, K3_HEADS, K3_D, K3_CONV), _kw(K3_HEADS), batch=b,
                                sizes=big, kernel_kwargs=(("norm", norm),)) for norm, b in (("xla", 1), ("cluster", 8))]
    return small + k3 + kl + ablations


def cost(args, kwargs) -> tuple[float, float]:
    """Every input read once and every output written once (the state dominates)."""
    conv_state, qkv, *_ = args
    leaves = jax.tree.leaves(args)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    nbytes += qkv[0].size * qkv[0].dtype.itemsize + conv_state.size * conv_state.dtype.itemsize
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
    # np.max, not max(): a NaN (an unwritten or non-finite output) must win, not be skipped.
    return float(np.max([registry.relative_max_error(o, r) / t * registry.TOLERANCE["bfloat16"]
                         for o, r, t in zip(out, ref, tol, strict=True)]))


registry.register_spec(registry.OpSpec(
    name="kda_decode", reference=ops.kda_decode, cases=cases, cost=cost, compare=compare,
    tolerance=lambda args, kwargs: registry.TOLERANCE["bfloat16"], donate=(9,),     # the recurrent state
    notes="bf16 activations, head dim 64/128 in the kernel (either gate form); else the reference",
))
