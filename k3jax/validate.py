"""Run every registered kernel against its reference over its shape sweep; write a report.

    python -m k3jax.validate [--backend pallas] [--op NAME ...] [--sizes small,k3] [--out PREFIX]
    python -m k3jax.validate --model [--preset k3-h200] [--backends pallas,cute] [--steps 64] [--per-op]

On a GPU the kernels compile and the sweep defaults to small + real K3 shapes; elsewhere they
run in Mosaic GPU interpret mode (NaN-initialised memory, race detector on) over the small
shapes. Per op and case the report gives: shapes, max error vs tolerance (as a fraction of the
output scale), determinism over repeated runs (bitwise), races found, and PASS / FAIL, or REF
where the kernel does not cover the case and its reference ran (said why). It is
written as PREFIX.json and PREFIX.md. Exit status 1 if anything failed.

`--model`: whole-model parity of backends. The XLA backend decodes `--steps` greedy tokens
after a random prompt; every other backend then decodes the same token sequence (teacher
forcing), so its logits are compared step by step on identical inputs: max |logit difference|
relative to the largest reference logit and whether its greedy token equals XLA's at every step.
If it does at every step, that backend's free-running greedy decode reproduces XLA's tokens
exactly. Control rows set the tolerances: XLA with its router weights nudged by one float32 ulp
(the max step: what an expert-selection flip costs) and XLA in float32 where its float32 copy fits
the device, or as `--float32-floor` / `--no-float32-floor` say (the median step: the bf16
reference's own distance from exact arithmetic, which every op's rounding moves). Each is max(2^-7,
2 x the controls'); without the float32 control there is no median gate. On a random-weight model
one expert-selection flip moves the max (and the same code's max moves between processes), a
systematic kernel error moves the median; a failing row says which (`parity_failure`). `--per-op`
runs each kernel alone on top of XLA instead, which attributes a whole-backend difference to an op.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import atomic
from k3jax.cli import Parser, at_least, check_preset, check_writable, known, run_cli
from k3jax.config import EXPERT_CHOICES, expert_changes
from k3jax.backend import BACKENDS, REFERENCES


@dataclasses.dataclass
class CaseResult:
    op: str
    impl: str
    case: str
    shapes: str
    error: float
    tolerance: float
    deterministic: bool
    races: bool | None          # None: not checked (compiled on a GPU)
    seconds: float
    note: str = ""
    # Per output leaf: max |out - ref| / max |ref| (before any per-output allowance), so a
    # multi-output op's report says which output is off.
    output_errors: tuple[float, ...] = ()
    # "op/impl: why" of every call that ran its reference instead of a kernel (registry.fallback).
    fallbacks: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.error) and self.error <= self.tolerance
                    and self.deterministic and not self.races and not self.note)

    @property
    def kernel_ran(self) -> bool:
        """False when the op's kernel did not take the case and its reference ran instead (the
        comparison then says nothing about the kernel)."""
        return not any(f.startswith(f"{self.op}/{self.impl}:") for f in self.fallbacks)

    @property
    def status(self) -> str:
        """PASS, FAIL, or REF: within tolerance because the reference ran (the kernel does not cover it)."""
        return "FAIL" if not self.passed else "PASS" if self.kernel_ran else "REF"


def _shapes(args) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in jax.tree.leaves(args) if hasattr(a, "shape"))


def _bitwise_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def check_case(spec, impl: str, fn, case, *, seed: int = 0, repeats: int = 2) -> CaseResult:
    """One kernel on one case: error vs reference, bitwise determinism over `repeats` reruns,
    races (interpret mode), and the calls that ran the reference instead (`fallbacks`). Kernels are traced fresh (a new lambda) so interpret/compile and
    race-detection settings apply."""
    from pallas_kernels import mgpu, registry

    args = case.make(jax.random.key(seed))
    kw = case.kw
    t0 = time.perf_counter()
    ref = jax.jit(lambda *a: spec.reference(*a, **kw))(*args)
    interpreted = mgpu.interpret_params() is not None
    note = ""
    races = None
    registry.clear_fallbacks()
    try:
        with mgpu.race_detection():
            run = jax.jit(lambda *a: fn(*a, **case.kernel_kw))
            out = jax.block_until_ready(run(*args))
            races = mgpu.races_found() if interpreted else None
            again = [jax.block_until_ready(run(*args)) for _ in range(repeats)]
        deterministic = all(_bitwise_equal(out, o) for o in again)
        error = spec.error(out, ref, args, kw)
        output_errors = tuple(registry.relative_max_error(o, r)
                              for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))
    except Exception as e:  # noqa: BLE001 - a kernel that fails to build/run is a failed case
        if interpreted:
            mgpu.reset_interpreter()
        note = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        deterministic, error, output_errors = False, float("nan"), ()
    fell_back = tuple(f"{op_impl}: {why}" for op_impl, whys in registry.fallbacks().items() for why in whys)
    return CaseResult(spec.name, impl, case.name, _shapes(args), float(error),
                      float(spec.allowed(ref, args, kw)), deterministic, races,
                      time.perf_counter() - t0, note, output_errors, fell_back)


def _ran_reference(r: CaseResult) -> str:
    """' (reference ran: linear/cute: rows 32 > 8)' when any call of the case fell back, else ''."""
    return f" (reference ran: {'; '.join(r.fallbacks)})" if r.fallbacks else ""


def _per_output(r: CaseResult) -> str:
    """' (outputs 7.3e-03, 0.0e+00, 1.6e-07)' for a multi-output op, else ''."""
    return f" (outputs {', '.join(f'{e:.1e}' for e in r.output_errors)})" if len(r.output_errors) > 1 else ""


def run(backend: str = "pallas", ops: list[str] | None = None, sizes: set[str] | None = None,
        repeats: int = 2, log=print, deadline: float | None = None) -> tuple[list[CaseResult], list[str]]:
    """Every case of `ops` (default all) in `sizes` -> (results, "op/case" of the cases not started
    because time.time() passed `deadline`)."""
    from pallas_kernels import registry

    on_gpu = jax.default_backend() == "gpu"
    sizes = sizes or ({"small", "k3"} if on_gpu else {"small"})
    specs = registry.specs()
    results, not_run = [], []
    ops = known(ops, REFERENCES, "op(s)") if ops else list(REFERENCES)      # all named before any runs
    width = max((len(c.name) for op in ops if op in specs for c in specs[op].sweep(*sizes)), default=0)
    for op in ops:
        fn = registry.implementation(op, backend)
        if fn is None or op not in specs:
            log(f"{op:14s} no {backend} kernel (falls back to XLA)")
            continue
        spec = specs[op]
        for case in spec.sweep(*sizes):
            if deadline is not None and time.time() > deadline:
                not_run.append(f"{op}/{case.name}")
                continue
            r = check_case(spec, backend, fn, case, repeats=repeats)
            results.append(r)
            log(f"{op:14s} {case.name:{width}s} err {r.error:.2e} / tol {r.tolerance:.1e}  "
                f"det {'yes' if r.deterministic else 'NO '}  races {r.races}  "
                f"{r.status} {r.note}{_per_output(r)}{_ran_reference(r)}")
    if not_run:
        log(f"time budget reached: {len(not_run)} cases not run")
    return results, not_run


def write_report(results: list[CaseResult], prefix: str, backend: str, not_run: list[str] = ()) -> None:
    from pallas_kernels import registry
    dev = jax.devices()[0]
    meta = {"backend": backend, "device": dev.device_kind, "platform": dev.platform,
            "mode": "compiled" if dev.platform == "gpu" else "Mosaic GPU interpret mode (race detection on)",
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows = [dict(dataclasses.asdict(r), passed=r.passed, status=r.status) for r in results]
    atomic.write_json(prefix + ".json", {"meta": meta, "results": rows, "not_run": list(not_run)})
    lines = [f"# Kernel validation: backend {backend}", "",
             " | ".join(f"{k}: {v}" for k, v in meta.items()), "",
             "| op | case | shapes | max err (rel) | tol | deterministic | races | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r.op} | {r.case} | {r.shapes} | {r.error:.2e}{_per_output(r)} | {r.tolerance:.1e} | "
                     f"{r.deterministic} | {r.races} | {r.status} {r.note}{_ran_reference(r)} |")
    n_fail = sum(not r.passed for r in results)
    n_ref = sum(r.status == "REF" for r in results)
    lines += ["", f"{len(results) - n_fail}/{len(results)} cases passed"
              + (f" ({n_ref} of them ran the reference: REF, not covered by the kernel)." if n_ref else ".")]
    if not_run:
        lines += ["", f"Not run (time budget): {', '.join(not_run)}."]
    ops = dict.fromkeys(r.op for r in results)
    lines += ["", "What each op's kernel covers (the registry's notes):", ""]
    lines += [f"- {op}: {registry.spec(op).notes}" for op in ops if registry.spec(op).notes]
    atomic.write_text(prefix + ".md", "\n".join(lines) + "\n")


def decode_logits(model, prompt: jax.Array, steps: int, forced: jax.Array | None = None):
    """Prefill `prompt` [B, T], then `steps` decode steps with the model's plan.

    Each step feeds the previous token: the greedy choice when `forced` is None, else
    forced[:, i]. Returns (tokens [B, steps + 1] int32: the prefill's greedy token then each
    step's, logits float32 [steps, B, V] of the decode steps). Runs as k3jax.generation does: one
    jitted prefill, then one jitted step per token over the donated state.
    """
    from flax import nnx

    from k3jax.cache import init_state
    graphdef, params = nnx.split(model)

    @jax.jit
    def prefill(params, prompt):
        m = nnx.merge(graphdef, params)
        b, t = prompt.shape
        state = init_state(m.cfg, b, t + steps + 1, m.dtype)
        logits, state = m.forward(prompt, state, last_only=True)
        return jnp.argmax(logits, -1).astype(jnp.int32), state

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, state, token):
        logits, state = nnx.merge(graphdef, params).forward(token[:, None], state)
        return logits[:, 0].astype(jnp.float32), jnp.argmax(logits[:, 0], -1).astype(jnp.int32), state

    token, state = prefill(params, prompt)
    tokens, logits = [token], []
    for i in range(steps):
        step_logits, token, state = step(params, state, token if forced is None else forced[:, i])
        tokens.append(token)
        logits.append(step_logits)
    return jnp.stack(tokens, axis=1), jnp.stack(logits)


def parity_plans(backends: list[str], per_op: bool) -> list[tuple[str, object]]:
    """(label, KernelPlan) per compared configuration: each whole backend, or with `per_op` each
    op that has a kernel in it alone on top of XLA (label "backend:op"), to find which op
    a whole-backend difference comes from."""
    from k3jax.backend import KernelPlan
    plans = []
    for backend in backends:
        full = KernelPlan.for_backend(backend)
        if not per_op:
            plans.append((backend, full))
            continue
        plans += [(f"{backend}:{op}", KernelPlan.for_backend("xla", **{op: impl}))
                  for op, impl in full.describe().items() if impl != "xla"]
    return plans


def _upcast(model):
    """The same model with every bfloat16 parameter (exactly) in float32 and float32 activations."""
    from flax import nnx
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, params)
    wide = nnx.merge(graphdef, params)
    wide.dtype = jnp.float32
    return wide


def router_nudged_plan(direction: float):
    """XLA with every router weight moved by one float32 ulp towards `direction` (+inf or -inf).

    A control, not a backend: two correct float32 routers differ by about this much (summation
    order), so the logit difference it causes is the smallest any re-implementation can be
    judged against. Random-weight models amplify it through expert-selection near-ties.
    """
    from k3jax.backend import XLA

    def route(x, weight, bias, **kw):
        w = weight.astype(jnp.float32)
        return REFERENCES["route"](x, jnp.nextafter(w, jnp.full_like(w, direction)), bias, **kw)

    @dataclasses.dataclass(frozen=True)
    class RouterNudged(type(XLA)):
        def __call__(self, op: str):
            return route if op == "route" else super().__call__(op)

    return RouterNudged(XLA.choices)


def parity_failure(row: dict, tol: float, median_tol: float | None = None) -> str | None:
    """Why a whole-model parity row (`model_parity`) failed, in words; None if it passed. A flip
    that XLA's own top-1/top-2 margin does not explain, or a median step over `median_tol` (set by
    the float32 control; None: no median gate), point at a kernel; a max alone over `tol` is one
    expert-selection flip on a random-weight model (k3-small: docs/pallas.md, Known issues) unless
    its median is over the bf16 tolerance too."""
    from pallas_kernels.registry import TOLERANCE
    if row["unexplained_flips"]:
        return f"greedy flips XLA's margin does not explain at steps {row['unexplained_flips'][:5]}"
    if median_tol is not None and row["median_rel_err"] > median_tol:
        return (f"the median step ({row['median_rel_err']:.1e}) is over the median tolerance "
                f"({median_tol:.1e}): systematic")
    if row["logit_rel_err"] <= tol:
        return None
    if row["median_rel_err"] > TOLERANCE["bfloat16"]:
        return f"the median step ({row['median_rel_err']:.1e}) is over the bf16 tolerance too: systematic"
    worst = int(np.argmax(row["per_step_rel_err"]))
    return (f"the max alone (step {worst}); the median step is at bf16 level: an expert-selection flip, "
            "worth a second run or another seed before reading it as a kernel error")


def float32_copy_fits(model, free: int | None = None) -> tuple[bool, int, int]:
    """(fits, bytes needed, bytes free): whether XLA's float32 control (`_upcast`) fits the device
    next to `model`. It needs a float32 copy of every bfloat16 parameter (4 bytes an element; the
    bfloat16 originals stay for the other rows; float32 activations are small at decode) within
    half of the free memory (`free`, default k3jax.weights.device_memory_bytes: GPU allocator
    limit minus in use, else the host's available memory)."""
    from flax import nnx

    from k3jax.weights import device_memory_bytes
    need = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(model)) if x.dtype == jnp.bfloat16)
    if free is None:
        free = device_memory_bytes() or 0
    return need <= free // 2, need, free


def model_parity(preset: str, backends: list[str], steps: int = 64, batch: int = 1, prompt_len: int = 16,
                 seed: int = 0, per_op: bool = False, float32_floor: bool | None = None, noise_floor: bool = True,
                 experts: str | None = None, log=print) -> dict:
    """XLA greedy decode vs each backend teacher-forced on XLA's tokens (see the module doc).

    Per step: the largest |logit difference| relative to the largest XLA logit, and XLA's own
    top-1 minus top-2 logit margin (same scale): a greedy token can only change where that margin
    is below twice the difference. Control rows set the tolerances: `noise_floor` runs XLA with its
    router weights nudged by one float32 ulp up / down (router_nudged_plan); `float32_floor` runs
    XLA in float32 (the same weights, upcast exactly): the bfloat16 reference's own distance from
    float32 arithmetic (None: where its float32 copy fits, float32_copy_fits). A row passes with no
    unexplained flip, its max within max(2^-7, 2 x the controls' largest max) and, where the float32
    control ran, its median within max(2^-7, 2 x that control's median): the router controls move
    only routing, so their medians are no scale for a kernel's rounding everywhere (on k3-h200 the
    kernel backends' medians run 1.5-2.3x theirs). Control rows are reported, not judged. experts:
    one of k3jax.config.EXPERT_CHOICES (None: the preset's).
    """
    import k3jax
    from k3jax.backend import KernelPlan
    from pallas_kernels.registry import TOLERANCE, clear_fallbacks, fallbacks
    model = k3jax.from_pretrained(preset, seed=seed, **expert_changes(experts))
    prompt = jax.random.randint(jax.random.key(seed + 1), (batch, prompt_len), 0, model.cfg.vocab_size, jnp.int32)
    model.plan = KernelPlan.for_backend("xla")
    t0 = time.perf_counter()
    tokens, ref = decode_logits(model, prompt, steps)
    jax.block_until_ready(ref)
    scale = float(jnp.max(jnp.abs(ref)))
    top2 = jax.lax.top_k(ref, 2)[0]
    margin = np.asarray(jnp.min(top2[..., 0] - top2[..., 1], axis=1)) / scale          # [steps]
    rows = [{"backend": "xla", "seconds": time.perf_counter() - t0,
             "top2_margin": [float(m) for m in margin]}]
    log(f"xla     greedy decode of {steps} steps: {rows[0]['seconds']:.0f} s (compile included); "
        f"smallest top-1/top-2 margin {margin.min():.1e} of the largest logit")

    def compare(label: str, plan, wide: bool = False) -> dict:
        """One teacher-forced run against XLA's logits, as a report row."""
        model_run = _upcast(model) if wide else model
        model_run.plan = plan
        clear_fallbacks()
        t0 = time.perf_counter()
        try:
            forced_tokens, logits = decode_logits(model_run, prompt, steps, forced=tokens[:, :-1])
        except Exception as e:  # noqa: BLE001 - a configuration that fails to build/run is a row
            note = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"{label:7s} FAILED to run: {note}")
            return {"backend": label, "error": note, "passed": False, "seconds": time.perf_counter() - t0}
        per_step = np.asarray(jnp.max(jnp.abs(logits - ref), axis=(1, 2))) / scale     # [steps]
        del logits
        differ = [int(i) for i in np.nonzero(~np.asarray(forced_tokens[:, 1:] == tokens[:, 1:]).all(0))[0]]
        kernels = {op: i for op, i in plan.describe().items() if i != "xla"}
        return {"backend": label, "kernels": kernels,
                # why a kernel ran its reference instead, for some call of this configuration
                "fallbacks": {k: v for k, v in fallbacks().items()
                              if kernels.get(k.split("/")[0]) == k.split("/")[1]},
                "logit_rel_err": float(per_step.max()), "per_step_rel_err": [float(e) for e in per_step],
                # the typical step: a kernel's systematic error moves it, a single flip moves only the max
                "median_rel_err": float(np.median(per_step)),
                "greedy_identical": not differ, "different_steps": differ,
                "first_different_step": differ[0] if differ else None,
                # a flip is explained by the logit difference when XLA's own margin is below twice it
                "unexplained_flips": [i for i in differ if margin[i] > 2 * per_step[i]],
                "prefill_token_same": bool(jnp.all(forced_tokens[:, 0] == tokens[:, 0])),
                "seconds": time.perf_counter() - t0}

    def describe(row: dict) -> str:
        differ, per_step = row["different_steps"], row["per_step_rel_err"]
        flips = "; ".join(f"step {i}: margin {margin[i]:.1e}, diff {per_step[i]:.1e}" for i in differ[:3])
        return (f"{row['backend']:7s} logits rel err {row['logit_rel_err']:.2e} (median step {row['median_rel_err']:.1e}, "
                f"step 0: {per_step[0]:.1e}); "
                f"greedy tokens {'identical' if not differ else f'differ at {len(differ)} step(s) ({flips})'} "
                f"over {steps} steps x {batch} sequences")

    controls = []
    if noise_floor:
        controls += [("xla:router+ulp", router_nudged_plan(jnp.inf), False),
                     ("xla:router-ulp", router_nudged_plan(-jnp.inf), False)]
    if float32_floor is None:
        fits, need, free = float32_copy_fits(model)
        float32_mode = f"auto: {'on' if fits else 'off'}"
        log(f"float32 control: {'on' if fits else 'skipped'} (auto: its float32 copy needs {need / 1e9:.3g} GB, "
            f"{'within' if fits else 'over'} half of the {free / 1e9:.3g} GB free)")
        float32_floor = fits
    else:
        float32_mode = "on" if float32_floor else "off"
        log(f"float32 control: {float32_mode} (as asked)")
    if float32_floor:
        controls.append(("xla:float32", KernelPlan.for_backend("xla"), True))
    floors, float32_median = [], None
    for label, plan, wide in controls:
        row = {**compare(label, plan, wide), "control": True}
        row.pop("passed", None)
        rows.append(row)
        if "error" not in row:
            floors.append(row["logit_rel_err"])
            if wide:
                float32_median = row["median_rel_err"]
            log(describe(row) + "  (control)")
    tol = max([TOLERANCE["bfloat16"]] + [2 * f for f in floors])
    median_tol = None if float32_median is None else max(TOLERANCE["bfloat16"], 2 * float32_median)
    rows[0]["tolerance"], rows[0]["median_tolerance"] = tol, median_tol
    if floors:
        log(f"noise floor {max(floors):.2e} of the largest logit -> tolerance {tol:.2e}"
            + ("" if median_tol is None else
               f"; float32 median step {float32_median:.2e} -> median tolerance {median_tol:.2e}"))
    for label, plan in parity_plans(backends, per_op):
        row = compare(label, plan)
        rows.append(row)
        if "error" in row:
            continue
        row["tolerance"], row["median_tolerance"] = tol, median_tol
        row["failure"] = parity_failure(row, tol, median_tol)
        row["passed"] = row["failure"] is None
        gates = f"tol {tol:.1e}" + ("" if median_tol is None else f", median {median_tol:.1e}")
        log(f"{describe(row)}  ({gates})  "
            f"{'PASS' if row['passed'] else 'FAIL: ' + row['failure']}")
        for op_impl, whys in row["fallbacks"].items():
            log(f"        {op_impl} fell back to XLA for: {'; '.join(whys)}")
    dev = jax.devices()[0]
    return {"meta": {"kind": "model-parity", "preset": preset, "device": dev.device_kind, "steps": steps,
                     "batch": batch, "prompt_len": prompt_len, "seed": seed, "float32_floor": float32_mode,
                     "jax": jax.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "tokens": np.asarray(tokens).tolist(), "rows": rows}


def main(argv=None) -> int:
    p = Parser(prog="python -m k3jax.validate", description=__doc__.splitlines()[0])
    p.add_argument("--model", action="store_true", help="whole-model backend parity instead of per-op kernels")
    p.add_argument("--preset", default="k3-tiny", help="--model: preset name or checkpoint directory")
    p.add_argument("--backends", default="pallas,cute", help="--model: backends compared with xla")
    p.add_argument("--steps", type=int, default=64, help="--model: greedy decode steps (default 64)")
    p.add_argument("--batch", type=int, default=1, help="--model: sequences (default 1)")
    p.add_argument("--experts", choices=EXPERT_CHOICES, help="--model: routed-expert storage (default: the preset's)")
    f32 = p.add_mutually_exclusive_group()
    f32.add_argument("--float32-floor", dest="float32_floor", action="store_const", const=True, default=None,
                     help="--model: run XLA in float32 as a control (a float32 copy of the bf16 weights); "
                          "default: where that copy fits in half the free memory")
    f32.add_argument("--no-float32-floor", dest="float32_floor", action="store_const", const=False,
                     help="--model: skip the float32 control")
    p.add_argument("--no-noise-floor", action="store_true",
                   help="--model: skip the router-ulp control rows (the default noise floor)")
    p.add_argument("--per-op", action="store_true",
                   help="--model: compare each op's kernel alone (on top of XLA) instead of whole backends")
    p.add_argument("--backend", default="pallas", choices=[b for b in BACKENDS if b != "xla"],
                   help="per-op mode: the kernels to check against their references (default pallas)")
    p.add_argument("--op", action="append", help="op name (repeatable); default: every op")
    p.add_argument("--sizes", default=None, help="comma list of small,k3 (default: small on CPU, both on GPU)")
    p.add_argument("--repeats", type=int, default=2, help="reruns for the determinism check (default 2)")
    p.add_argument("--out", default="validate_report", help="report path prefix (.json and .md; --model: .json only; default validate_report)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="per-op mode: start no case after this many seconds (the rest are listed as not run)")
    a = p.parse_args(argv)
    return run_cli("k3jax.validate", lambda: _main(a))


def _main(a: argparse.Namespace) -> int:
    check_writable(a.out + ".json", "--out")
    if a.budget_s is not None:
        at_least("--budget-s", a.budget_s, 0)      # 0: list every case as not run
    if a.model:
        backends = known(a.backends.split(","), BACKENDS, "backend(s)")
        check_preset(a.preset)
        if a.steps < 1 or a.batch < 1:
            raise ValueError(f"--steps and --batch must be >= 1, got {a.steps} and {a.batch}")
        result = model_parity(a.preset, backends, a.steps, a.batch, per_op=a.per_op,
                              float32_floor=a.float32_floor, noise_floor=not a.no_noise_floor, experts=a.experts)
        atomic.write_json(a.out + ".json", result)
        failed = [r["backend"] for r in result["rows"][1:] if not r.get("control") and not r["passed"]]
        print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all backends match xla'}; report: {a.out}.json")
        return 1 if failed else 0
    sizes = set(a.sizes.split(",")) if a.sizes else None
    if sizes and sizes - {"small", "k3"}:
        raise ValueError(f"--sizes takes small and/or k3, got {a.sizes!r}")
    at_least("--repeats", a.repeats, 1)         # the determinism check needs a rerun
    deadline = None if a.budget_s is None else time.time() + a.budget_s
    results, not_run = run(a.backend, a.op, sizes, a.repeats, deadline=deadline)
    if not results and not not_run:
        raise ValueError(f"no case to run for --backend {a.backend} --op {a.op} --sizes {a.sizes}")
    write_report(results, a.out, a.backend, not_run)
    n_fail = sum(not r.passed for r in results)
    n_ref = sum(r.status == "REF" for r in results)
    print(f"{len(results) - n_fail}/{len(results)} passed" + (f" ({n_ref} by the reference: REF)" if n_ref else "")
          + (f", {len(not_run)} not run (time budget)" if not_run else "") + f"; report: {a.out}.md")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
