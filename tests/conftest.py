"""Test setup, before jax is imported anywhere: CPU with 8 fake devices.

Set K3JAX_GPU_TESTS=1 to run on the real accelerator instead; tests marked `gpu` run only then
(and only when a GPU is present), and are skipped otherwise.
"""

import os

GPU_RUN = os.environ.get("K3JAX_GPU_TESTS") == "1"
if not GPU_RUN:
    os.environ["JAX_PLATFORMS"] = "cpu"
    # No LLVM optimisation of the CPU code: the suite compiles hundreds of tiny programs and runs
    # each a few times, so compile time dominates (test_layers + test_generate: 434 -> 317 s).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                               " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    has_gpu = GPU_RUN and any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with K3JAX_GPU_TESTS=1 on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)
    # The `slow` tests (minutes each on 2 cores) first: on two xdist workers a long test collected
    # last would run alone at the end while the other worker idles.
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture
def child_xla_flags():
    """XLA_FLAGS for a child process that sets up its own CPU devices (notebook kernels, multi-process
    launches): this session's flags without the 8 fake devices, so it compiles unoptimised too."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


@pytest.fixture
def counting_plan():
    """plan -> (the same KernelPlan, recording the op name of every implementation it hands out,
    and that list of names)."""
    from k3jax.backend import KernelPlan

    calls: list[str] = []

    class CountingPlan(KernelPlan):
        def __call__(self, op):
            calls.append(op)
            return super().__call__(op)
    return lambda plan: (CountingPlan(plan.choices), calls)


@pytest.fixture(scope="session")
def tiny_model():
    """Float32 tiny models with random weights, built once per session: tiny_model(preset).
    Shared between tests: never mutate the returned model (e.g. its plan); build your own instead."""
    import k3jax

    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = k3jax.from_pretrained(name, dtype="float32", seed=0)
        return cache[name]
    return get
