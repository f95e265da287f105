"""Triton launches for an sm_90 target (H100, H200) on a machine without a
GPU: a driver that names that target, with CPU tensors routed to the ops'
Triton launches. Triton then builds (or traces) the kernels as for the GPU;
nothing may launch. tests/test_kernel_build.py builds every kernel under it,
and compile_tests analyse the kernels Inductor traces."""

import contextlib


class _TargetOnlyDriver:
    """What Triton asks of a driver before it builds a kernel."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def sm90_launches():
    """Inside the block Triton's active driver names sm_90 and the ops send
    CPU tensors to their Triton launches; both are restored on exit. Raises
    ImportError or AttributeError where this Triton has no way to name a
    target without a driver."""
    import triton
    from triton.backends.compiler import GPUTarget

    import kda_ops.ops

    driver = triton.runtime.driver
    saved_driver, saved_use_triton = driver._active, kda_ops.ops.use_triton
    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    kda_ops.ops.use_triton = lambda t: True
    try:
        yield
    finally:
        driver._active = saved_driver
        kda_ops.ops.use_triton = saved_use_triton
