"""CuTe DSL kernels compiled ahead of time and linked into JAX as XLA FFI custom calls.

kernel_set (specs, no CuTe import) -> build (compile on a CPU machine, codegen, link one .so)
-> loader (ctypes + jax.ffi registration, checked calls) -> ops (registry impl "cute").
See docs/cute_bridge.md.
"""
