"""XLA FFI glue generated from CuTe DSL's exported C headers (no hand-written code per kernel).

`export_to_c` writes, per kernel, a header with `<name>_Tensor_<arg>_t` structs (a data pointer,
plus `dynamic_shapes` / `dynamic_strides` arrays for symbolic dimensions) and a wrapper
`cute_dsl_<name>_wrapper(module, tensors..., cudaStream_t)`. `parse_header` reads those back and
`ffi_source` emits one C++ file with, per kernel, an XLA FFI handler (instantiate: load the
cubin once, outside any CUDA graph capture, and set the spec's shared-memory carveout; execute:
fill the structs from XLA's buffers and launch on XLA's stream) and a `k3cute_kernel_set()`
symbol naming the kernel-set hash.
"""

from __future__ import annotations

import dataclasses
import re

from cute_bridge.kernel_set import KernelSpec

_DTYPES = {"float32": "F32", "bfloat16": "BF16", "int32": "S32", "uint8": "U8", "float16": "F16"}


@dataclasses.dataclass(frozen=True)
class TensorStruct:
    n_shapes: int
    shape_type: str
    n_strides: int
    stride_type: str


@dataclasses.dataclass(frozen=True)
class Header:
    name: str
    params: tuple[str, ...]          # wrapper parameter names after `module`, before `stream`
    structs: dict[str, TensorStruct]


def parse_header(text: str, name: str) -> Header:
    """The wrapper signature and tensor structs of kernel `name`'s exported header."""
    m = re.search(rf"int32_t cute_dsl_{name}_wrapper\(\s*{name}_Kernel_Module_t \*module,(.*?)\)\s*{{", text, re.S)
    if m is None:
        raise ValueError(f"{name}: no cute_dsl_{name}_wrapper in the exported header")
    params = [p.strip() for p in m.group(1).split(",")]
    if not params or params[-1] != "cudaStream_t stream":
        raise ValueError(f"{name}: the wrapper's last parameter must be the stream, got {params[-1:]}")
    names, structs = [], {}
    for p in params[:-1]:
        pm = re.fullmatch(rf"{name}_Tensor_(\w+)_t \*(\w+)", p)
        if pm is None:
            raise ValueError(f"{name}: unsupported wrapper parameter {p!r} (only tensors; pass scalars "
                             "that change per call as device tensors)")
        names.append(pm.group(2))
        sm = re.search(rf"typedef struct {{([^{{}}]*)}} {name}_Tensor_{pm.group(1)}_t;", text)
        body = sm.group(1) if sm else ""
        shp = re.search(r"(int\d+_t) dynamic_shapes\[(\d+)\];", body)
        strd = re.search(r"(int\d+_t) dynamic_strides\[(\d+)\];", body)
        structs[pm.group(2)] = TensorStruct(
            int(shp.group(2)) if shp else 0, shp.group(1) if shp else "",
            int(strd.group(2)) if strd else 0, strd.group(1) if strd else "")
    return Header(name, tuple(names), structs)


def _dynamic_strides(shape) -> list[int]:
    """Row-major modes whose stride is symbolic: those with a symbolic dimension after them."""
    return [i for i in range(len(shape)) if any(isinstance(d, str) for d in shape[i + 1:])]


def check_matches(spec: KernelSpec, header: Header) -> None:
    """The header must describe exactly the spec's arguments (names, order, dynamic fields)."""
    want = tuple(a.name for a in spec.args)
    if header.params != want:
        raise ValueError(f"{spec.name}: header arguments {header.params} != spec {want}")
    for a in spec.args:
        st = header.structs[a.name]
        n_dyn = sum(isinstance(d, str) for d in a.shape)
        if (st.n_shapes, st.n_strides) != (n_dyn, len(_dynamic_strides(a.shape))):
            raise ValueError(f"{spec.name}.{a.name}: header has {st.n_shapes} dynamic shapes / {st.n_strides} "
                             f"strides, spec {a.shape} implies {n_dyn} / {len(_dynamic_strides(a.shape))}")


def _fill(spec_name: str, a, st: TensorStruct, buf: str) -> list[str]:
    lines = [f"  {spec_name}_Tensor_{a.name}_t t_{a.name};",
             f"  t_{a.name}.data = {buf}.untyped_data();"]
    if st.n_shapes or st.n_strides:
        lines.append(f"  auto d_{a.name} = {buf}.dimensions();")
    dyn = [i for i, d in enumerate(a.shape) if isinstance(d, str)]
    for j, i in enumerate(dyn):
        lines.append(f"  t_{a.name}.dynamic_shapes[{j}] = ({st.shape_type})d_{a.name}[{i}];")
    for j, i in enumerate(_dynamic_strides(a.shape)):
        prod = " * ".join(f"(int64_t)d_{a.name}[{k}]" for k in range(i + 1, len(a.shape)))
        lines.append(f"  t_{a.name}.dynamic_strides[{j}] = ({st.stride_type})({prod});")
    return lines


def _check(a, buf: str, kernel: str) -> list[str]:
    """Rank and dtype guard in the handler (the Python loader checks sizes with clear messages)."""
    return [f"  if ({buf}.element_type() != ffi::DataType::{_DTYPES[a.dtype]} || {buf}.dimensions().size() != {len(a.shape)})",
            f"    return ffi::Error(ffi::ErrorCode::kInvalidArgument, \"{kernel}: argument '{a.name}' must be "
            f"{a.dtype} of rank {len(a.shape)}\");"]


def ffi_source(specs: list[KernelSpec], headers: dict[str, Header], kernel_set_hash: str) -> str:
    """One C++ translation unit with the FFI handlers of every kernel."""
    out = ["// Generated by cute_bridge.codegen; do not edit.",
           "#include <mutex>",
           "#include <vector>",
           "#include <cuda_runtime.h>",
           "static thread_local cudaError_t k3cute_load_error = cudaSuccess;",
           "#define CUTE_DSL_CUDA_ERROR_CHECK(err) { cudaError_t e_ = (err); "
           "if (e_ != cudaSuccess && k3cute_load_error == cudaSuccess) k3cute_load_error = e_; }"]
    out += [f'#include "{s.name}.h"' for s in specs]
    out += ["// The preferred shared-memory carveout (percent) of every kernel of a loaded library, on",
            "// every device: the driver's default may leave less shared memory than the resident blocks need.",
            "static cudaError_t k3cute_carveout(cudaLibrary_t lib, int percent) {",
            "  unsigned int count = 0;",
            "  cudaError_t err = cudaLibraryGetKernelCount(&count, lib);",
            "  if (err != cudaSuccess || count == 0) return err;",
            "  std::vector<cudaKernel_t> kernels(count);",
            "  if ((err = cudaLibraryEnumerateKernels(kernels.data(), count, lib)) != cudaSuccess) return err;",
            "  int devices = 0;",
            "  if ((err = cudaGetDeviceCount(&devices)) != cudaSuccess) return err;",
            "  for (unsigned int k = 0; k < count; ++k)",
            "    for (int d = 0; d < devices; ++d)",
            "      if ((err = cudaKernelSetAttributeForDevice(kernels[k], cudaFuncAttributePreferredSharedMemoryCarveout, "
            "percent, d)) != cudaSuccess) return err;",
            "  return cudaSuccess;",
            "}"]
    out += ['#include "xla/ffi/api/ffi.h"', "namespace ffi = xla::ffi;",
            f'extern "C" __attribute__((visibility("default"))) const char* k3cute_kernel_set() {{ return "{kernel_set_hash}"; }}']
    for s in specs:
        h = headers[s.name]
        n = s.name
        out += [
            f"static {n}_Kernel_Module_t {n}_module;",
            f"static std::once_flag {n}_once;",
            f"static cudaError_t {n}_status = cudaSuccess;",
            f"static ffi::Error {n}_load() {{",
            f"  std::call_once({n}_once, [] {{ k3cute_load_error = cudaSuccess; {n}_Kernel_Module_Load(&{n}_module); "
            + (f"if (k3cute_load_error == cudaSuccess) k3cute_load_error = k3cute_carveout({n}_module.module, "
               f"{s.smem_carveout}); " if s.smem_carveout is not None else "")
            + f"{n}_status = k3cute_load_error; }});",
            f"  if ({n}_status != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, "
            f"std::string(\"{n}: loading the kernel module failed: \") + cudaGetErrorString({n}_status));",
            "  return ffi::Error::Success();",
            "}",
            f"static ffi::Error {n}_instantiate() {{ return {n}_load(); }}",
        ]
        params = ["cudaStream_t stream"] + [f"ffi::AnyBuffer {a.name}" for a in s.inputs] + \
                 [f"ffi::Result<ffi::AnyBuffer> {a.name}" for a in s.outputs]
        body = [f"  if (auto err = {n}_load(); err.failure()) return err;"]
        for a in s.inputs:
            body += _check(a, a.name, n) + _fill(n, a, h.structs[a.name], a.name)
        for a in s.outputs:
            body += _check(a, f"(*{a.name})", n) + _fill(n, a, h.structs[a.name], f"(*{a.name})")
        call_args = ", ".join([f"&{n}_module"] + [f"&t_{a.name}" for a in s.args] + ["stream"])
        body += [f"  int32_t rc = cute_dsl_{n}_wrapper({call_args});",
                 "  cudaError_t launch = cudaGetLastError();",
                 f"  if (rc != 0 || launch != cudaSuccess) return ffi::Error(ffi::ErrorCode::kInternal, "
                 f"std::string(\"{n}: launch failed: \") + cudaGetErrorString(launch != cudaSuccess ? launch : (cudaError_t)rc));",
                 "  return ffi::Error::Success();"]
        out += [f"static ffi::Error {n}_execute({', '.join(params)}) {{", *body, "}"]
        binding = "ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()" + \
                  "".join(".Arg<ffi::AnyBuffer>()" for _ in s.inputs) + \
                  "".join(".Ret<ffi::AnyBuffer>()" for _ in s.outputs)
        out += [f"XLA_FFI_DEFINE_HANDLER_SYMBOL({s.target}_instantiate, {n}_instantiate, ffi::Ffi::BindInstantiate());",
                f"XLA_FFI_DEFINE_HANDLER_SYMBOL({s.target}_execute, {n}_execute, {binding}, "
                "{ffi::Traits::kCmdBufferCompatible});"]
    return "\n".join(out) + "\n"
