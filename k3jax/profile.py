"""Where a decode step's time goes, kernel by kernel, and which op each kernel is.

    python -m k3jax.profile --preset k3-h200 --backend pallas --granularity per-op --batch 1
                            --context 1024 [--steps 8] [--warmup 3] [--expert-format mxfp4]
                            [--mesh ep=2 --ep-variant auto] [--out results/profile.json]

Builds the model as `k3jax.bench --model` does for one (backend, granularity) point and compiles
the same step (`k3jax.bench.compile_decode_step`: `generation._decode_step`, state at `lengths =
context` with random contents). It times `--steps` steps issued back to back (bench's step_s), then
on a GPU records every kernel launch of another `--steps` steps with CUPTI and reports per kernel
name: launches per step, time per step and per launch, share of the step; with the step's kernel
sum, gap (wall - kernel sum: launch and host overhead) and launches per step. Each kernel name is
matched to the instruction(s) of the compiled HLO that launch it, whose metadata says which op it
is: op_name (JAX's name stack), source frames (file:line function, innermost first), fusion kind,
root opcode and the heavy ops inside, operand and result shapes (they usually identify the
weight). Without CUPTI (CPU) it reports the step's HLO inventory (fusions and custom calls) and
the wall time only.

Matching a CUPTI kernel name to HLO (`match` field):
  "exact"   an instruction of that name (XLA names kernels after their fusion; '.' and '-' read as '_');
  "prefix"  no exact match; the longest instruction name that, followed by '_', starts the kernel name
            (a fusion that launches several kernels, e.g. gemm_fusion_dot_40_0). A guess: XLA also
            numbers names this way, so check the shapes;
  "mosaic"  `<name>_mosaic_gpu...`: every mosaic_gpu custom call whose kernel module is named so, or
            else whose op_name has the scope `<name>` (one kernel name serves every call site of a
            Pallas kernel; the sites' shapes and source frames tell them apart);
  "library" a library kernel (cuBLAS nvjet/xmma/gemv, cutlass, cuDNN...) and no other match: `hlo`
            lists the step's library custom calls it may come from;
  "unmatched" nothing found.

JSON (written atomically; `--out`, default benchmarks/results/profile-<preset>-<backend>-b<B>-c<C>-<date>.json, without a GPU under benchmarks/results/cpu/):
  meta: kind "profile", preset, config, device, platform, jax, date, command, backend, granularity,
        batch, context, steps, warmup, dtype, expert_format, mesh, ep_variant, devices (the mesh's,
        else 1), kernels (op -> implementation the plan asked for), fallbacks ("op/impl" -> why the
        reference ran instead), timer ("cupti" or "wall")
  step: compile_s, step_s (wall per step, back to back), kernel_s, gap_s, launches (per step, and
        per device under a mesh: CUPTI sees all devices, so kernel numbers are averaged over them),
        kernel_names (distinct) -- the last four None without CUPTI
  kernels: [{name, launches_per_step, us_per_step, us_per_launch, share (of step_s), match,
             hlo: [instruction, ...]}, ...] sorted by us_per_step; [] without CUPTI
  sequence: [[name, us], ...] the first step's launches in CUPTI record order ([] without CUPTI)
  hlo: [instruction, ...] the step's fusions and custom calls, in schedule order
  instruction: {name, computation, opcode, kind, target (custom_call_target), root, contains,
                shape, operands (shapes), op_name, frames ["path:line function", ...]}
A Markdown table (time by op, then kernels by time; on CPU the HLO inventory) is written beside the JSON
(.md) and printed; with CUPTI numbers, a bar chart of the step's time by op and the gap (.png).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

import jax

from k3jax import atomic, bench
from k3jax.backend import BACKENDS
from k3jax.cli import Parser, at_least, check_ep_variant, check_preset, check_writable, known, run_cli
from k3jax.config import EXPERT_CHOICES, expert_changes, expert_label
from k3jax.moe_parallel import VARIANTS
from k3jax.weights import parse_dtype

# ------------------------------------------------------------------ HLO text -> instruction records
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*\[[\d,]*\])")
_ATTR_COMP = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|"
                        r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_MOSAIC_NAME = re.compile(r"(?<![A-Za-z])([A-Za-z_]\w*?_mosaic_gpu)")
_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Ops worth naming when they sit inside a fusion (the rest are elementwise glue).
HEAVY = ("dot", "convolution", "reduce", "reduce-window", "scatter", "gather", "sort", "dynamic-slice",
         "dynamic-update-slice", "custom-call", "all-reduce", "all-gather", "all-to-all", "reduce-scatter",
         "ragged-all-to-all", "cumsum", "rng", "while")
# Library kernels CUPTI names by the library, not by the HLO instruction that calls them.
LIBRARY_KERNELS = ("nvjet", "sm90_xmma", "sm80_xmma", "xmma", "cutlass", "gemv", "gemm", "cudnn", "cublas")
# Opcodes whose called computations run as kernels of their own (the rest are fusion bodies, reducers).
_CALLERS = ("while", "conditional", "call", "async-start", "async-update", "async-done")


def kernel_key(name: str) -> str:
    """A name as CUPTI spells XLA kernels: '.' and '-' become '_'."""
    return name.replace(".", "_").replace("-", "_")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start] == '('."""
    depth = 0
    for j in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j + 1
    return len(text)


def _split_operands(args: str) -> list[str]:
    """'bf16[2,3]{1,0} %a, %b' -> ['bf16[2,3]{1,0} %a', '%b']: commas inside brackets, braces or
    parentheses (shapes, layouts, tuple shapes) do not split."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(args):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(args[start:j])
            start = j + 1
    parts.append(args[start:])
    return [p.strip() for p in parts if p.strip()]


def _shapes(text: str) -> list[str]:
    """'(bf16[1,64]{1,0}, f32[]) ' -> ['bf16[1,64]', 'f32[]'] (layouts dropped)."""
    return _SHAPE.findall(text)


def _source_tables(lines: list[str]) -> dict[str, dict[int, str]]:
    """The FileNames / FunctionNames / FileLocations / StackFrames sections: {section: {id: text}}."""
    tables: dict[str, dict[int, str]] = {s: {} for s in _SECTIONS}
    current = None
    for line in lines:
        head = line.strip()
        if head in _SECTIONS:
            current = tables[head]
        elif current is not None and (m := re.match(r"^(\d+)\s+(.*)$", head)):
            current[int(m.group(1))] = m.group(2)
        elif head:
            current = None
    return tables


def _parent_offset(stack: dict[int, str]) -> int:
    """What XLA adds to a parent frame id when it prints one. jaxlib 0.11 prints id + 1 (1 = no
    parent), so some frame names itself as parent; a printer without the offset never does."""
    return int(any(f"parent_frame_id={i}}}" in text for i, text in stack.items()))


def _frames(tables: dict[str, dict[int, str]], frame_id: int, offset: int, limit: int = 12) -> list[str]:
    """'path:line function' of a stack frame and its callers, innermost first (parent ids printed
    `offset` too high). The walk stops at a cycle, a missing id or `limit` frames."""
    files, funcs, locs, stack = (tables[s] for s in _SECTIONS)
    out, seen = [], set()
    while frame_id in stack and frame_id not in seen and len(out) < limit:
        seen.add(frame_id)
        fields = dict(re.findall(r"(\w+)=(\d+)", stack[frame_id]))
        loc = dict(re.findall(r"(\w+)=(\d+)", locs.get(int(fields.get("file_location_id", 0)), "")))
        path = files.get(int(loc.get("file_name_id", 0)), '"?"').strip('"')
        func = funcs.get(int(loc.get("function_name_id", 0)), '"?"').strip('"')
        out.append(f"{path}:{loc.get('line', '?')} {func}")
        frame_id = int(fields.get("parent_frame_id", 0)) - offset
    return out


def _unquote(s: str) -> str:
    return s[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape") if s.startswith('"') else s


def parse_hlo(text: str) -> dict:
    """Reads compiled HLO text (`compiled.as_text()`) into
    {"instructions": {computation: [record, ...]}, "kernel_level": [records of the instructions that
    launch kernels, in schedule order], "custom_inner": [the custom calls and sorts inside kCustom
    fusions, which launch as those fusions' kernels], "mosaic": {instruction name: [kernel module names]}}.

    A record: name, computation, opcode, kind, target, calls (computations), root (this
    instruction is its computation's ROOT), shape, operands, op_name, frames. Quoted strings
    (metadata, backend configs, Mosaic kernel modules) are set aside before the line is split, so
    braces or commas inside them do not confuse the parse."""
    lines = text.splitlines()
    tables = _source_tables(lines)
    offset = _parent_offset(tables["StackFrames"])
    comps: dict[str, list[dict]] = {}
    mosaic: dict[str, list[str]] = {}
    entry, comp, shapes = None, None, {}
    for raw in lines:
        strings: list[str] = []
        line = _COMMENT.sub("", _STRING.sub(lambda m: strings.append(m.group(0)) or f'"{len(strings) - 1}"', raw))
        if comp is None:
            if " = " not in line and (m := _COMP.match(line)):
                comp, shapes = m.group(2), {}
                comps[comp] = []
                entry = comp if m.group(1) else entry
            continue
        if line.strip() == "}":
            comp = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3).strip()
        end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
        shape, rest = rest[:end], rest[end:].strip()
        op = re.match(r"([a-z][\w\-]*)\(", rest)
        if not op:
            continue
        args_end = _balanced(rest, op.end() - 1)
        args, attrs = rest[op.end():args_end - 1], rest[args_end:]
        restore = lambda i: _unquote(strings[int(i)])  # noqa: E731
        meta = re.search(r"metadata=\{([^}]*)\}", attrs)
        fields = dict(re.findall(r'(\w+)=("\d+"|[^\s,}]+)', meta.group(1))) if meta else {}
        frames = []
        if "stack_frame_id" in fields:
            frames = _frames(tables, int(fields["stack_frame_id"]), offset)
        elif "source_file" in fields:
            path = restore(fields["source_file"].strip('"'))
            frames = [f"{path}:{fields.get('source_line', '?')}"]
        operands = _split_operands(args)
        names = [x.split()[-1].lstrip("%") for x in operands]
        operand_shapes = [s for x, n in zip(operands, names) for s in (_shapes(x) or [shapes.get(n, "?")])]
        kind = re.search(r"\bkind=(\w+)", attrs)
        target = re.search(r'custom_call_target="(\d+)"', attrs)
        calls = [c.lstrip("%") for key, val in _ATTR_COMP.findall(attrs)
                 if key != "to_apply" or op.group(1) == "call"
                 for c in re.findall(r"%?([\w.\-]+)", val)]
        rec = {"name": name, "computation": comp, "opcode": op.group(1), "kind": kind.group(1) if kind else None,
               "target": restore(target.group(1)) if target else None, "calls": calls, "args": names, "root": is_root,
               "shape": ", ".join(_shapes(shape)), "operands": operand_shapes,
               "op_name": restore(fields["op_name"].strip('"')) if "op_name" in fields else None,
               "frames": frames}
        shapes[name] = rec["shape"]
        comps[comp].append(rec)
        if rec["target"] and rec["target"].startswith("mosaic_gpu"):
            mosaic[name] = sorted(set(_MOSAIC_NAME.findall(raw)))
    # Kernel-level instructions, in schedule order: ENTRY's, with those of the computations a while /
    # conditional / call runs in place of the caller. Fusion bodies and reducers are not kernel
    # level: their instructions run inside the caller's kernel.
    order, seen = [], set()

    def walk(c: str) -> None:
        if c in seen or c not in comps:
            return
        seen.add(c)
        for r in comps[c]:
            order.append(r)
            if r["opcode"] in _CALLERS:
                for callee in r["calls"]:
                    walk(callee)
    walk(entry)
    # A kCustom fusion runs its body's custom call or sort as its kernel (XLA wraps a Mosaic call
    # with sliced operands, and sorts, this way); CUPTI names those after the inner instruction.
    inner = [r for f in order if f["opcode"] == "fusion" and f["kind"] == "kCustom"
             for c in f["calls"] for r in comps.get(c, []) if r["opcode"] in ("custom-call", "sort")]
    return {"instructions": comps, "kernel_level": order, "custom_inner": inner, "mosaic": mosaic}


def describe(parsed: dict, rec: dict) -> dict:
    """The JSON record of an instruction: its fields plus, for a fusion, the root opcode of the fused
    computation ('tuple(a, b)' for several outputs) and the heavy ops it contains."""
    out = {k: rec[k] for k in ("name", "computation", "opcode", "kind", "target", "shape", "operands",
                               "op_name", "frames")}
    out["root"] = out["contains"] = None
    body = parsed["instructions"].get(rec["calls"][0]) if rec["opcode"] == "fusion" and rec["calls"] else None
    if body:
        by_name = {r["name"]: r for r in body}
        root = next((r for r in body if r["root"]), body[-1])
        out["root"] = root["opcode"]
        if root["opcode"] == "tuple":
            parts = [by_name[n]["opcode"] for n in root["args"] if n in by_name]
            out["root"] = f"tuple({', '.join(parts)})" if parts else "tuple"
        out["contains"] = sorted({r["opcode"] for r in body if r["opcode"] in HEAVY})
    return out


def inventory(parsed: dict) -> list[dict]:
    """The kernel-level fusions and custom calls, in schedule order."""
    return [describe(parsed, r) for r in parsed["kernel_level"] if r["opcode"] in ("fusion", "custom-call")]


def match_kernel(parsed: dict, kernel: str) -> tuple[str, list[dict]]:
    """(match kind, instruction records) for a CUPTI kernel name; see the module doc."""
    level = parsed["kernel_level"] + parsed["custom_inner"]
    key = kernel_key(kernel)
    exact = [r for r in level if kernel_key(r["name"]) == key]
    if exact:
        return "exact", [describe(parsed, r) for r in exact]
    if "_mosaic_gpu" in kernel:
        stem = kernel[:kernel.index("_mosaic_gpu") + len("_mosaic_gpu")]
        sites = [r for r in level if any(n == stem for n in parsed["mosaic"].get(r["name"], ()))]
        # An escape byte before the name in the module text may glue onto it (e.g. 'n' of '\n').
        sites = sites or [r for r in level if any(n.endswith(stem) for n in parsed["mosaic"].get(r["name"], ()))]
        # No module text: pallas_call(name=...) puts the name in the call's op_name scope.
        sites = sites or [r for r in level if r["name"] in parsed["mosaic"]
                          and stem[:-len("_mosaic_gpu")] in (r["op_name"] or "").split("/")]
        if sites:
            return "mosaic", [describe(parsed, r) for r in sites]
    prefixes = [r for r in level if key.startswith(kernel_key(r["name"]) + "_")]
    if prefixes:
        best = max(len(r["name"]) for r in prefixes)
        return "prefix", [describe(parsed, r) for r in prefixes if len(r["name"]) == best]
    if any(lib in kernel.lower() for lib in LIBRARY_KERNELS):
        calls = [r for r in level if r["opcode"] == "custom-call" and not (r["target"] or "").startswith("mosaic_gpu")
                 and any(lib in (r["target"] or "").lower() for lib in ("cublas", "gemm", "matmul", "cudnn"))]
        if calls:
            return "library", [describe(parsed, r) for r in calls]
    return "unmatched", []


# ------------------------------------------------------------------ the profile
def kernel_rows(records: list[tuple[str, float]], steps: int, step_s: float, parsed: dict) -> list[dict]:
    """Per kernel name over `steps` steps of CUPTI `records` [(name, seconds)]: launches and time per
    step, time per launch, share of the step, and its HLO match; most time first."""
    agg: dict[str, list] = {}
    for name, s in records:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += s
    rows = []
    for name, (count, total) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        how, hlo = match_kernel(parsed, name)
        rows.append({"name": name, "launches_per_step": count / steps, "us_per_step": total / steps * 1e6,
                     "us_per_launch": total / count * 1e6, "share": total / steps / step_s, "match": how,
                     "hlo": hlo})
    return rows


def profile_step(preset: str, backend: str, granularity: str, batch: int, context: int, *, steps: int = 8,
                 warmup: int = 3, dtype: str = "bfloat16", expert_format: str | None = None,
                 mesh: str | None = None, ep_variant: str = "auto", seed: int = 0, command: str = "") -> dict:
    """The profile of one decode step (schema: module doc). Raises ValueError for a point that
    cannot run (no such granularity for the backend, a context too long, a state that does not fit).
    Under a mesh CUPTI sees every device's kernels: the per-step numbers are averaged per device."""
    import k3jax
    from k3jax import sharding
    from pallas_kernels import registry
    plan = bench.granularity_plan(backend, granularity)
    if isinstance(plan, str):
        raise ValueError(f"{backend} / {granularity}: {plan}")
    model = k3jax.from_pretrained(preset, dtype=dtype, seed=seed, mesh=mesh, **expert_changes(expert_format))
    model.plan = plan
    model_mesh = sharding.model_mesh(model)
    if model_mesh is not None:
        sharding.set_ep_variant(model, ep_variant)      # refuses a variant that cannot run here
    # Warm-up, the wall-clock steps and the CUPTI steps (None without CUPTI) advance one preallocated state.
    total = bench.steps_needed(warmup, steps, 2)
    why = bench.point_unfit(model, batch, context, total)
    if why:
        raise ValueError(why)
    dev = jax.devices()[0]
    registry.clear_fallbacks()
    with jax.set_mesh(model_mesh) if model_mesh is not None else contextlib.nullcontext():
        compiled, advance, compile_s = bench.compile_decode_step(model, batch, context, total, seed)
        for _ in range(warmup):
            jax.block_until_ready(advance())
        step_s = bench.step_time(advance, steps)
        records = bench.kernel_records(advance, steps)
    parsed = parse_hlo(compiled.as_text())
    step = {"compile_s": compile_s, "step_s": step_s, "kernel_s": None, "gap_s": None, "launches": None,
            "kernel_names": None}
    kernels, sequence = [], []
    devices = model_mesh.size if model_mesh is not None else 1
    if records:
        per = steps * devices       # records of every device: averaged per device and step
        kernel_s = sum(s for _, s in records) / per
        kernels = kernel_rows(records, per, step_s, parsed)
        step.update(kernel_s=kernel_s, gap_s=step_s - kernel_s, launches=len(records) / per,
                    kernel_names=len(kernels))
        sequence = [[name, s * 1e6] for name, s in records[:len(records) // per]]
    cfg = model.cfg
    meta = {"kind": "profile", "preset": os.path.basename(preset.rstrip("/")), "config": cfg.name,
            "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command, "backend": backend,
            "granularity": granularity, "batch": batch, "context": context, "steps": steps, "warmup": warmup,
            "dtype": dtype, "expert_format": expert_label(cfg), "mesh": mesh,
            "ep_variant": ep_variant if model_mesh is not None else None, "devices": devices,
            "kernels": {op: impl for op, impl in plan.describe().items() if impl != "xla"},
            "fallbacks": registry.fallbacks(), "timer": "cupti" if records else "wall"}
    return {"meta": meta, "step": step, "kernels": kernels, "sequence": sequence, "hlo": inventory(parsed)}


# ------------------------------------------------------------------ Markdown
_ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_ROWS = 200
# The table's source column: the innermost frame, then the first frames in these files (the model's
# own code, which says what sub-layer and weight the op belongs to).
CALLER_FILES = ("k3jax/layers.py", "k3jax/model.py")


def _short_frame(frame: str) -> str:
    """'/repo/k3jax/ops.py:123 linear' -> 'k3jax/ops.py:123 linear' (paths outside the repo: last two parts)."""
    path, _, rest = frame.partition(":")
    if path.startswith(_ROOT_DIR + os.sep):
        path = os.path.relpath(path, _ROOT_DIR)
    elif os.sep in path:
        path = os.path.join(*path.split(os.sep)[-2:])
    return f"{path}:{rest}"


def _cell(text) -> str:
    return "-" if text in (None, "", []) else str(text).replace("|", "\\|").replace("\n", " ")


def _site(rec: dict) -> list[str]:
    """Markdown cells of an instruction: HLO op, source, what it is, shapes."""
    op_name = rec["op_name"] or ""
    op_name = op_name.split("/", 1)[1] if op_name.startswith("jit(") and "/" in op_name else op_name
    what = rec["target"] if rec["opcode"] == "custom-call" else " ".join(
        x for x in (rec["kind"], rec["root"], f"[{', '.join(rec['contains'])}]" if rec["contains"] else "") if x)
    shapes = f"{', '.join(rec['operands'])} -> {rec['shape']}".strip()
    frames = [_short_frame(f) for f in rec["frames"]]
    callers = [f for f in frames[1:] if f.startswith(CALLER_FILES)][:2]    # which sub-layer / weight
    return [_cell(op_name[-70:]), _cell(" < ".join(frames[:1] + callers)), _cell(what),
            _cell(shapes[:160])]


def op_label(kernel: dict) -> str:
    """The op a kernel row belongs to: a Pallas kernel's own name, else '<file> <function>' of the
    innermost project frame of its HLO sites (e.g. 'ops.py linear'), else the kernel name."""
    name = kernel["name"]
    if "_mosaic_gpu" in name:
        return name[:name.index("_mosaic_gpu")]
    for site in kernel["hlo"]:
        for frame in site["frames"]:
            path, _, rest = _short_frame(frame).partition(":")
            if path.startswith(("k3jax", "pallas_kernels", "cute_bridge")):
                return f"{os.path.basename(path)} {rest.partition(' ')[2]}".strip()
    return name[:48]


def by_op(result: dict) -> list[dict]:
    """Kernel time per op (`op_label`), most first: [{op, us_per_step, launches_per_step, kernels}]."""
    ops: dict[str, dict] = {}
    for k in result["kernels"]:
        label = op_label(k)
        o = ops.setdefault(label, {"op": label, "us_per_step": 0.0, "launches_per_step": 0.0, "kernels": 0})
        o["us_per_step"] += k["us_per_step"]
        o["launches_per_step"] += k["launches_per_step"]
        o["kernels"] += 1
    return sorted(ops.values(), key=lambda o: -o["us_per_step"])


PLOT_OPS = 14     # bars in the plot; the rest are summed as "other"


def write_plot(result: dict, path: str, log=print) -> str | None:
    """A bar chart of the step's time by op (`by_op`) plus the gap, as PNG at `path` (atomically);
    None without CUPTI numbers or without matplotlib."""
    st = result["step"]
    if st["kernel_s"] is None:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot skipped: matplotlib is not installed (pip install -e .[notebooks])")
        return None
    ops = by_op(result)
    bars = [(o["op"], o["us_per_step"], o["launches_per_step"]) for o in ops[:PLOT_OPS]]
    if len(ops) > PLOT_OPS:
        rest = ops[PLOT_OPS:]
        bars.append((f"other ({len(rest)} ops)", sum(o["us_per_step"] for o in rest),
                     sum(o["launches_per_step"] for o in rest)))
    bars.append(("gap (between kernels)", max(st["gap_s"], 0.0) * 1e6, 0))
    m = result["meta"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(bars) + 1.4))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=["tab:blue"] * (len(bars) - 1) + ["tab:gray"])
    ax.set_yticks(range(len(bars)), [f"{b[0]} ({b[2]:g} launches)" if b[2] else b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us per step")
    ax.set_title(f"{m['preset']}, {m['backend']} / {m['granularity']}, batch {m['batch']}, context {m['context']}: "
                 f"{st['step_s'] * 1e3:.2f} ms/step ({m['device']})", fontsize=9)
    fig.tight_layout()
    with atomic.atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def markdown(result: dict) -> str:
    """The kernels by time (GPU) or the HLO inventory (no CUPTI), under a header line of step totals."""
    m, st = result["meta"], result["step"]
    lines = [f"## Decode step profile: {m['preset']}, {m['backend']} / {m['granularity']}, batch {m['batch']}, "
             f"context {m['context']} ({m['device']}, {m['expert_format']} experts)", ""]
    if st["kernel_s"] is not None:
        lines.append(f"step {st['step_s'] * 1e3:.3f} ms (back to back, {m['steps']} steps); kernels "
                     f"{st['kernel_s'] * 1e3:.3f} ms ({st['kernel_s'] / st['step_s']:.0%}); gap "
                     f"{st['gap_s'] * 1e3:.3f} ms ({st['gap_s'] / st['step_s']:.0%}, "
                     f"{st['gap_s'] / st['launches'] * 1e6:.2f} us per launch); {st['launches']:.0f} launches/step "
                     f"of {st['kernel_names']} kernels")
        lines += ["", "| op | us/step | % step | launches/step | kernels |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {_cell(o['op'])} | {o['us_per_step']:.1f} | {o['us_per_step'] * 1e-6 / st['step_s']:.1%} | "
                  f"{o['launches_per_step']:g} | {o['kernels']} |" for o in by_op(result)[:PLOT_OPS]]
        lines += ["", "| kernel | launches/step | us/step | us/launch | % step | match | HLO op | source "
                      "| what | shapes |", "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- |"]
        for k in result["kernels"][:MAX_ROWS]:
            site = _site(k["hlo"][0]) if k["hlo"] else ["-"] * 4
            if len(k["hlo"]) > 1:
                site[0] += f" (+{len(k['hlo']) - 1} sites)"
            lines.append(f"| {_cell(k['name'][:80])} | {k['launches_per_step']:g} | {k['us_per_step']:.1f} | "
                         f"{k['us_per_launch']:.2f} | {k['share']:.1%} | {k['match']} | {' | '.join(site)} |")
        rows = len(result["kernels"])
    else:
        lines.append(f"step {st['step_s'] * 1e3:.3f} ms wall (back to back, {m['steps']} steps); no CUPTI on "
                     f"{m['platform']}: the compiled step's fusions and custom calls, in schedule order")
        lines += ["", "| instruction | opcode | HLO op | source | what | shapes |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in result["hlo"][:MAX_ROWS]:
            lines.append(f"| {_cell(r['name'])} | {r['opcode']} | {' | '.join(_site(r))} |")
        rows = len(result["hlo"])
    if rows > MAX_ROWS:
        lines.append(f"\n({rows - MAX_ROWS} more rows in the JSON)")
    if m["fallbacks"]:
        lines += ["", "Fell back to the XLA reference:"] + [f"- {k}: {'; '.join(v)}" for k, v in m["fallbacks"].items()]
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI
def main(argv=None) -> int:
    p = Parser(prog="python -m k3jax.profile", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-tiny", help="preset name or checkpoint directory")
    p.add_argument("--backend", default="xla", help=f"one of {', '.join(BACKENDS)}")
    p.add_argument("--granularity", default=None, help="default: xla-ops for xla, per-op for the others")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    p.add_argument("--steps", type=int, default=8, help="steps timed (and, on a GPU, profiled)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--expert-format", default=None, choices=EXPERT_CHOICES,
                   help="mxfp4, bf16, mxfp4-rows or mxfp4-tiles (MXFP4 in row / kernel tile order; default: the preset's)")
    p.add_argument("--mesh", default=None, help="device mesh, e.g. ep=2 (k3jax.sharding)")
    p.add_argument("--ep-variant", default="auto", help="with --mesh: expert dispatch variant")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/profile-...json; without a GPU benchmarks/results/cpu/...)")
    a = p.parse_args(argv)
    command = "python -m k3jax.profile " + " ".join(sys.argv[1:] if argv is None else argv)
    return run_cli("k3jax.profile", lambda: _main(a, command))


def _main(a: argparse.Namespace, command: str) -> int:
    known([a.backend], BACKENDS, "backend")
    gran = a.granularity or ("xla-ops" if a.backend == "xla" else "per-op")
    known([gran], bench.GRANULARITIES, "granularity")
    known([a.ep_variant], ("auto", *VARIANTS), "--ep-variant")
    for flag, value, low in (("--batch", a.batch, 1), ("--context", a.context, 1), ("--steps", a.steps, 1),
                             ("--warmup", a.warmup, 0)):
        at_least(flag, value, low)
    check_ep_variant(a.ep_variant, a.mesh)
    if a.out:
        check_writable(a.out, "--out")
    check_preset(a.preset)
    parse_dtype(a.dtype)
    if jax.default_backend() != "gpu":
        print("warning: no GPU; no kernel times (CUPTI), only the HLO inventory and wall time", file=sys.stderr)
    result = profile_step(a.preset, a.backend, gran, a.batch, a.context, steps=a.steps, warmup=a.warmup,
                          dtype=a.dtype, expert_format=a.expert_format, mesh=a.mesh, ep_variant=a.ep_variant,
                          command=command)
    out = a.out or bench.default_out(f"profile-{result['meta']['preset']}-{a.backend}-b{a.batch}-c{a.context}-"
                                     f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    atomic.write_json(out, result)
    table = markdown(result)
    stem = out[:-5] if out.endswith(".json") else out
    atomic.write_text(stem + ".md", table + "\n")
    print(table)
    plot = write_plot(result, stem + ".png")
    print(f"results: {out}" + (f", {plot}" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
