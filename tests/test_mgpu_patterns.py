"""The Mosaic GPU register/SMEM patterns the MLA attention's heads_n schedule relies on, one small
kernel each, against numpy: run in interpret mode on CPU and compiled on a GPU (marked `gpu`).

heads_n passed in interpret mode but not compiled (session 33, H100): the interpreter models
neither swizzled SMEM, register layouts nor Mosaic's cross-warp reduction scratch, so each
pattern is isolated here. The culprit was the scratch: two warpgroups reducing down M at once
race on it unless each has its own (`mgpu.own_reduction_scratch`; session 34 reproduced the race
on an H100 without it and saw the fixed kernels right). Shapes are K3's: a 64-token tile scored
against 24 of a 48-head group's q rows (N = 24), p of [64 heads, 64 tokens] bf16 in
128-byte-swizzled SMEM.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu, registry
from pallas_kernels.mla_decode import _tf

TOKENS, K, GROUP, SCORED, ROWS = 64, 64, 48, 24, 64
WG = plgpu.Layout.WGMMA
f32 = jnp.float32


def _inputs(seed: int):
    ka, kq = jax.random.split(jax.random.key(seed))
    tile = jax.random.normal(ka, (TOKENS, K), f32).astype(jnp.bfloat16)
    q = jax.random.normal(kq, (GROUP, K), f32).astype(jnp.bfloat16)
    return tile, q


def _want_scores(tile, q):
    """The reference of `_scores`: tile @ q.T [64 tokens, 48 heads] float32."""
    return np.asarray(tile, np.float32) @ np.asarray(q, np.float32).T


def _scores(t_smem, q_smem, first):
    """Inside a kernel: s [64, 24] f32 = tile @ q[first:first+24].T by wgmma with q^T as the B
    operand, and s.max(0), exp2(s - max).sum(0) [24] f32 (reductions down the M, token, axis)."""
    def qk(s_ref):
        plgpu.wgmma(s_ref, t_smem, q_smem.at[pl.ds(first, SCORED)].transpose((1, 0)))
        return s_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((TOKENS, SCORED), f32))
    mx = s.max(axis=0)
    return s, mx, jnp.exp2(s - jax.lax.broadcast_in_dim(mx, s.shape, [1])).sum(axis=0)


def _scores_kernel(tile, q, first: int):
    """One warpgroup: `_scores` of q rows first.. -> (s [64, 24], max [24], exp2-sum [24]) f32."""
    def body(t_gmem, q_gmem, s_gmem, mx_gmem, sm_gmem, t_smem, q_smem, s_smem, v_smem, bar):
        plgpu.copy_gmem_to_smem(t_gmem, t_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(q_gmem, q_smem, bar.at[1])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
        s, mx, sm = _scores(t_smem, q_smem, first)
        s_smem[...] = s
        v_smem.at[0][...] = mx
        v_smem.at[1][...] = sm
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_smem, s_gmem)
        plgpu.copy_smem_to_gmem(v_smem.at[0], mx_gmem)
        plgpu.copy_smem_to_gmem(v_smem.at[1], sm_gmem)
        plgpu.wait_smem_to_gmem(0)

    tf = _tf(K)
    return plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((TOKENS, SCORED), f32), jax.ShapeDtypeStruct((SCORED,), f32),
                  jax.ShapeDtypeStruct((SCORED,), f32)),
        scratch_types=[plgpu.SMEM((TOKENS, K), tile.dtype, transforms=tf),
                       plgpu.SMEM((GROUP, K), q.dtype, transforms=tf),
                       plgpu.SMEM((TOKENS, SCORED), f32), plgpu.SMEM((2, SCORED), f32),
                       plgpu.Barrier(num_barriers=2)],
        interpret=mgpu.interpret_params(),
    )(tile, q)


def _transposed_store_kernel(x, first: int):
    """x [64 tokens, 24] bf16 (WGMMA layout in registers) stored transposed into rows first.. of
    a zeroed, swizzled [64, 64] SMEM tile, read back into registers in the WGMMA layout
    (`plgpu.load`) and written out -> [64, 64] bf16."""
    def body(x_gmem, o_gmem, x_smem, p_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar)
        plgpu.barrier_wait(bar)
        xv = plgpu.load(x_smem, layout=WG, optimized=False)
        p_smem[...] = plgpu.layout_cast(jnp.zeros((ROWS, TOKENS), x.dtype), WG)
        p_smem.at[pl.ds(first, SCORED)].transpose((1, 0))[...] = xv
        plgpu.commit_smem()
        o_smem[...] = plgpu.load(p_smem, layout=WG)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ROWS, TOKENS), x.dtype),
        scratch_types=[plgpu.SMEM((TOKENS, SCORED), x.dtype), plgpu.SMEM((ROWS, TOKENS), x.dtype, transforms=_tf(64)),
                       plgpu.SMEM((ROWS, TOKENS), x.dtype), plgpu.Barrier()],
        interpret=mgpu.interpret_params(),
    )(x)


def _row_vector_kernel(v, first: int):
    """v [64] f32; entries first..first+24 read as a vector along the N axis of a WGMMA array
    (`WGMMA.reduce(0)`), doubled and stored back over the others set to 1.0, then the whole
    read along the M axis (`WGMMA.reduce(1)`) and broadcast over a [64, 64] array's columns
    -> [64, 64] f32."""
    def body(v_gmem, o_gmem, a_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(v_gmem, a_smem, bar)
        plgpu.barrier_wait(bar)
        col = plgpu.load(a_smem.at[pl.ds(first, SCORED)], layout=WG.reduce(0), optimized=False)
        a_smem[...] = plgpu.layout_cast(jnp.ones((ROWS,), f32), WG.reduce(1))
        a_smem.at[pl.ds(first, SCORED)][...] = col * 2.0
        plgpu.commit_smem()
        row = plgpu.load(a_smem, layout=WG.reduce(1), optimized=False)
        o_smem[...] = jax.lax.broadcast_in_dim(row, (ROWS, TOKENS), [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ROWS, TOKENS), f32),
        scratch_types=[plgpu.SMEM((ROWS,), f32), plgpu.SMEM((ROWS, TOKENS), f32), plgpu.Barrier()],
        interpret=mgpu.interpret_params(),
    )(v)


def _two_warpgroups_reduce_kernel(tile, q):
    """Both warpgroups at once: warpgroup w takes `_scores` of q rows 24w.., reducing down the
    token (M) axis across its warps, each with its own reduction scratch
    (`mgpu.own_reduction_scratch`) -> max and exp2-sum [2, 24] f32."""
    def body(t_gmem, q_gmem, mx_gmem, sm_gmem, t_smem, q_smem, v_smem, bar, done):
        wg = jax.lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(t_gmem, t_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(q_gmem, q_smem, bar.at[1])

        def reduce():
            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_wait(bar.at[1])
            _, mx, sm = _scores(t_smem, q_smem, wg * SCORED)
            v_smem.at[0, wg][...] = mx
            v_smem.at[1, wg][...] = sm
        mgpu.own_reduction_scratch("wg", 2, reduce)
        plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)

        @pl.when(wg == 0)
        def _():
            plgpu.copy_smem_to_gmem(v_smem.at[0], mx_gmem)
            plgpu.copy_smem_to_gmem(v_smem.at[1], sm_gmem)
            plgpu.wait_smem_to_gmem(0)

    tf = _tf(K)
    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((2, SCORED), f32), jax.ShapeDtypeStruct((2, SCORED), f32)),
        scratch_types=[plgpu.SMEM((TOKENS, K), tile.dtype, transforms=tf), plgpu.SMEM((GROUP, K), q.dtype, transforms=tf),
                       plgpu.SMEM((2, 2, SCORED), f32), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=2)],
        num_threads=2, thread_name="wg", interpret=mgpu.interpret_params(),
    )(tile, q)


def _close(got, want, rtol):
    err = registry.relative_max_error(got, want)       # NaN (unwritten, wrong shape) fails
    assert err <= rtol, f"max error {err:.3e} of the output scale (allowed {rtol:.1e})"


def _check_scores(first):
    tile, q = _inputs(first)
    s, mx, sm = jax.jit(_scores_kernel, static_argnums=2)(tile, q, first)
    want = _want_scores(tile, q)[:, first:first + SCORED]
    _close(s, want, 1e-5)          # bf16 products, float32 sums of 64 terms
    _close(mx, want.max(0), 1e-5)
    _close(sm, np.exp2(want - want.max(0)).sum(0), 1e-5)


def _check_transposed_store(first):
    x = jax.random.normal(jax.random.key(first), (TOKENS, SCORED), f32).astype(jnp.bfloat16)
    got = jax.jit(_transposed_store_kernel, static_argnums=1)(x, first)
    want = np.zeros((ROWS, TOKENS), np.float32)
    want[first:first + SCORED] = np.asarray(x, np.float32).T
    _close(got, want, 0.0)         # a move: exact


def _check_row_vector(first):
    v = jax.random.normal(jax.random.key(first), (ROWS,), f32)
    got = jax.jit(_row_vector_kernel, static_argnums=1)(v, first)
    want = np.ones((ROWS,), np.float32)
    want[first:first + SCORED] = 2.0 * np.asarray(v)[first:first + SCORED]
    _close(got, np.broadcast_to(want[:, None], (ROWS, TOKENS)), 0.0)


def _check_two_warpgroups_reduce(first):
    tile, q = _inputs(first)
    want = _want_scores(tile, q).reshape(TOKENS, 2, SCORED)
    for _ in range(3):              # the race this guards against varies from run to run
        mx, sm = jax.jit(_two_warpgroups_reduce_kernel)(tile, q)
        _close(mx, want.max(0), 1e-5)
        _close(sm, np.exp2(want - want.max(0)).sum(0), 1e-5)


CHECKS = {"scores_n24": _check_scores, "transposed_store": _check_transposed_store, "row_vector": _check_row_vector,
          "two_warpgroups_reduce": _check_two_warpgroups_reduce}


@pytest.mark.parametrize("first", [0, SCORED])
@pytest.mark.parametrize("pattern", list(CHECKS))
def test_pattern_interpret(pattern, first):
    CHECKS[pattern](first)


@pytest.mark.gpu
@pytest.mark.parametrize("first", [0, SCORED])
@pytest.mark.parametrize("pattern", list(CHECKS))
def test_pattern_gpu(pattern, first):
    CHECKS[pattern](first)


@pytest.mark.parametrize("pattern", list(CHECKS))
def test_pattern_exports_for_cuda(pattern):
    tile, q = _inputs(0)
    run, args = {"scores_n24": (lambda: _scores_kernel(tile, q, SCORED), ()),
                 "transposed_store": (lambda x: _transposed_store_kernel(x, SCORED), (tile[:, :SCORED],)),
                 "row_vector": (lambda v: _row_vector_kernel(v, SCORED), (tile[0].astype(f32),)),
                 "two_warpgroups_reduce": (lambda: _two_warpgroups_reduce_kernel(tile, q), ())}[pattern]
    with mgpu.compile_for_gpu():
        jax.export.export(jax.jit(run), platforms=["cuda"])(*args)


@pytest.fixture
def reduction_scratch_offsets(monkeypatch):
    """offsets(fn, *args) -> the SMEM byte offset of the scratch each cross-warp reduction in the
    Mosaic GPU kernels of jax.jit(fn)(*args) uses, in lowering order (CUDA export on CPU): what
    shows whether warpgroups reducing at once share scratch (`mgpu.own_reduction_scratch`), which
    the interpreter cannot."""
    import jax.experimental.mosaic.gpu.fragmented_array as fa

    offsets = []
    reduce = fa.FragmentedArray.reduce

    def recording_reduce(self, op, axis, scratch=None):
        if scratch is not None:         # a memref.view of dynamic SMEM at a constant byte offset
            offsets.append(scratch.owner.opview.byte_shift.owner.opview.value.value)
        return reduce(self, op, axis, scratch)
    monkeypatch.setattr(fa.FragmentedArray, "reduce", recording_reduce)

    def lowered(fn, *args):
        offsets.clear()
        with mgpu.compile_for_gpu():
            jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
        return list(offsets)
    return lowered


def test_heads_n_consumers_reduce_in_distinct_scratch(reduction_scratch_offsets):
    """The fix itself, checked in the lowering (what the interpreter cannot show): in the K3
    heads_n attention, each consumer's cross-warp reductions (max and sum, down the token axis)
    use SMEM scratch at an address of its own; heads_m makes no cross-warp reduction."""
    from pallas_kernels import mla_decode as mla

    def lowered_offsets(case_name):
        case = next(c for c in mla.cases() if c.name == case_name)
        args = jax.eval_shape(case.make, jax.random.key(0))
        kwargs = {**dict(case.kwargs), **dict(case.kernel_kwargs)}
        return reduction_scratch_offsets(lambda *a: mla.mla_decode(*a, **kwargs), *args)
    heads_n = lowered_offsets("ctx1024_b1_heads_n")
    assert len(heads_n) == 4 and len(set(heads_n)) == 2, heads_n
    assert sorted(heads_n)[::2] == [min(heads_n), max(heads_n)]     # two reductions at each address
    assert lowered_offsets("ctx1024_b1") == []
