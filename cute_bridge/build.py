"""Build the CuTe kernel library: `python -m cute_bridge.build [--force] [--out DIR]`.

Runs on a machine without a GPU. For every KernelSpec: compile the @cute.jit entry for sm_90a
against fake tensors, `export_to_c` a header + object; generate the XLA FFI glue from the headers;
link everything with CuTe's 51 KB CUDA-dialect shim and the static CUDA runtime into one shared
library. Outputs go to cute_bridge/_build/<kernel-set hash>/ and the library is copied to
cute_bridge/_build/libk3cute.so (what the loader picks up). A build whose hash exists is reused.
Needs: nvidia-cutlass-dsl[cu13]==4.8.1 (the `cute` extra), g++, CUDA 13 headers and
libcudart_static.a (CUDA_HOME, /usr/local/cuda*, or the nvidia-cuda-runtime wheel).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from cute_bridge import codegen
from cute_bridge.kernel_set import (ARCH, CUTLASS_DSL_VERSION, HOST_TARGET, KERNELS, KernelSpec,
                                    kernel_set_hash)

BUILD_ROOT = pathlib.Path(__file__).parent / "_build"
LIBRARY = "libk3cute.so"


def _cuda_dirs() -> tuple[pathlib.Path, pathlib.Path]:
    """(include dir with cuda_runtime.h, lib dir with libcudart_static.a)."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
             *sorted(glob.glob("/usr/local/cuda-13*"), reverse=True)]
    import site
    for sp in site.getsitepackages():
        roots += glob.glob(os.path.join(sp, "nvidia", "cu13")) + glob.glob(os.path.join(sp, "nvidia", "cuda_runtime"))
    for r in filter(None, roots):
        inc, libs = pathlib.Path(r) / "include", [pathlib.Path(r) / d for d in ("lib64", "lib", "lib/x64")]
        lib = next((d for d in libs if (d / "libcudart_static.a").exists()), None)
        if (inc / "cuda_runtime.h").exists() and lib is not None:
            return inc, lib
    raise RuntimeError("no CUDA 13 toolkit found (need include/cuda_runtime.h and libcudart_static.a); "
                       "set CUDA_HOME")


def _fake(arg, symbols: dict):
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor
    dtype = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "int32": cutlass.Int32,
             "uint8": cutlass.Uint8, "float16": cutlass.Float16}[arg.dtype]
    shape = tuple(symbols[d] if isinstance(d, str) else d for d in arg.shape)
    # XLA buffers are at least 16-byte aligned; telling CuTe lets it emit 16-byte vector accesses.
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=16)


def compile_kernel(spec: KernelSpec, obj_dir: pathlib.Path) -> None:
    """CuTe-compiles `spec` for ARCH and writes obj_dir/<name>.h and .o."""
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream
    module, fn = spec.entry.split(":")
    entry = getattr(importlib.import_module(module), fn)
    symbols = {s: cute.sym_int32(divisibility=d) for s, d in spec.symbols.items()}
    fakes = [_fake(a, symbols) for a in spec.args]
    # The arch as a compile option: CUTE_DSL_ARCH is read once, when cutlass is first imported, so
    # a process that imported it earlier (the test suite) would otherwise compile for its default.
    compiled = cute.compile(entry, *fakes, make_fake_stream(), options=f"--gpu-arch {ARCH} --host-target '{HOST_TARGET}'")
    compiled.export_to_c(str(obj_dir), spec.name, function_prefix=spec.name)


# .nv.info attributes of an sm_90a cubin (format 4: a u32 function index, then a u32 value).
EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x11, 0x2F


def kernel_resources(obj: pathlib.Path) -> dict[str, int]:
    """{"registers": per thread, "frame_bytes": local memory per thread (spills and stack arrays;
    0: none)} of the kernel in an object `export_to_c` wrote, read from the cubin it embeds (no
    GPU tools needed: what `ptxas -v` reports)."""
    blob = obj.read_bytes()
    start = blob.find(b"\x7fELF\x02\x01\x01")
    while start >= 0 and struct.unpack_from("<H", blob, start + 18)[0] != 190:     # EM_CUDA
        start = blob.find(b"\x7fELF\x02\x01\x01", start + 1)
    if start < 0:
        raise RuntimeError(f"{obj}: no CUDA cubin inside")
    elf = blob[start:]
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
    strtab = sections[names][4]
    out = {}
    for name_off, _, _, _, off, size, *_ in sections:
        if elf[strtab + name_off: elf.index(b"\0", strtab + name_off)] != b".nv.info":
            continue
        i = off
        while i + 4 <= off + size:
            fmt, attr, length = elf[i], elf[i + 1], struct.unpack_from("<H", elf, i + 2)[0]
            if fmt == 4:
                value = struct.unpack_from("<I", elf, i + 8)[0]
                if attr == EIATTR_REGCOUNT:
                    out["registers"] = value
                elif attr == EIATTR_FRAME_SIZE:
                    out["frame_bytes"] = value
                i += 4 + length
            else:
                i += 4
    if "registers" not in out:
        raise RuntimeError(f"{obj}: the cubin states no register count")
    return {"frame_bytes": 0, **out}


def link(obj_dir: pathlib.Path, source: pathlib.Path, out: pathlib.Path) -> None:
    import jax.ffi
    import nvidia_cutlass_dsl
    inc, cudalib = _cuda_dirs()
    shim = pathlib.Path(list(nvidia_cutlass_dsl.__path__)[0]) / "cu13" / "lib" / "libcuda_dialect_runtime_static.a"
    objs = sorted(str(p) for p in obj_dir.glob("*.o"))
    cmd = ["g++", "-O2", "-std=c++17", "-Wno-return-type", "-fPIC", "-shared", "-o", str(out), str(source),
           f"-I{obj_dir}", f"-I{jax.ffi.include_dir()}", f"-I{inc}", *objs, str(shim),
           str(cudalib / "libcudart_static.a"), "-lpthread", "-ldl", "-lrt", "-Wl,--no-undefined",
           "-Wl,--exclude-libs,ALL"]  # the static CUDA runtime stays private to this library
    subprocess.run(cmd, check=True)


def build(force: bool = False, root: pathlib.Path = BUILD_ROOT, verbose: bool = True) -> pathlib.Path:
    """Builds (or reuses) the library for the current kernel set; returns root/libk3cute.so."""
    digest = kernel_set_hash()
    out_dir = root / digest
    lib = out_dir / LIBRARY
    t0 = time.perf_counter()
    if force or not lib.exists():
        try:
            import nvidia_cutlass_dsl  # noqa: F401
        except ImportError:
            raise RuntimeError("the CuTe DSL is not installed: `bash scripts/setup.sh cute` installs it "
                               f"(nvidia-cutlass-dsl=={CUTLASS_DSL_VERSION}; no GPU needed)") from None
        from importlib.metadata import version
        if version("nvidia-cutlass-dsl") != CUTLASS_DSL_VERSION:
            raise RuntimeError(f"need nvidia-cutlass-dsl=={CUTLASS_DSL_VERSION}, have {version('nvidia-cutlass-dsl')}")
        root.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{digest}-"))
        try:
            headers, resources = {}, {}
            for spec in KERNELS:
                t = time.perf_counter()
                compile_kernel(spec, tmp)
                headers[spec.name] = codegen.parse_header((tmp / f"{spec.name}.h").read_text(), spec.name)
                codegen.check_matches(spec, headers[spec.name])
                resources[spec.name] = res = kernel_resources(tmp / f"{spec.name}.o")
                if verbose:
                    spills = f"{res['frame_bytes']} B of local memory" if res["frame_bytes"] else "no spills"
                    print(f"cute_bridge.build: compiled {spec.name} ({time.perf_counter() - t:.1f} s, "
                          f"{res['registers']} registers, {spills})")
            source = tmp / "k3cute_ffi.cc"
            source.write_text(codegen.ffi_source(list(KERNELS), headers, digest))
            link(tmp, source, tmp / LIBRARY)
            (tmp / "manifest.json").write_text(json.dumps(
                {"kernel_set": digest, "arch": ARCH, "cutlass_dsl": CUTLASS_DSL_VERSION,
                 "kernels": [s.name for s in KERNELS], "resources": resources}, indent=1))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)                       # atomic: a build dir is complete or absent
    staged = root / f".{LIBRARY}.tmp"
    shutil.copyfile(lib, staged)
    os.replace(staged, root / LIBRARY)
    if verbose:
        print(f"cute_bridge.build: {root / LIBRARY} (kernel set {digest}, {lib.stat().st_size / 1e6:.2f} MB, "
              f"{time.perf_counter() - t0:.1f} s)")
    return root / LIBRARY


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="rebuild even if this kernel set was built")
    p.add_argument("--out", type=pathlib.Path, default=BUILD_ROOT, help="build root (default %(default)s)")
    args = p.parse_args(argv)
    try:
        build(args.force, args.out)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        print(f"cute_bridge.build: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
