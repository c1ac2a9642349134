"""The cached kernel launch (`msa/kernels/launch.py`).

The key is checked against Triton's own specialisation (`native_specialize_impl`, the function
its binder calls): two arguments with one key must specialise alike. On a GPU, a kernel launched
through the cache's hit path must compute what torch does for every specialisation it meets,
eagerly and replayed in a CUDA graph, and launch hooks must still see every launch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from m3_eagle_plugin.msa.kernels import launch as launch_mod  # noqa: E402
from m3_eagle_plugin.msa.kernels.launch import arg_key, launch  # noqa: E402

GPU = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.uint8]
EDGES = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31), -(2**31) - 16, -16,
         -1, 2**63 - 16, 2**63, 2**64 - 16]


def _triton(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


ints = st.one_of(st.sampled_from(EDGES), st.integers(-(2**40), 2**40), st.integers(0, 2**64 - 1),
                 st.integers(-64, 64).map(lambda k: 16 * k))


@settings(max_examples=300, deadline=None)
@given(a=ints, b=ints)
def test_int_key_is_never_coarser_than_triton(a, b):
    if arg_key(a) == arg_key(b):
        assert _triton(a) == _triton(b), (a, b)


def test_int_key_is_never_coarser_than_triton_at_the_class_edges():
    """Every pair of edge values, not a random sample: a key one off at a class boundary (2**63,
    -2**31) merges two of Triton's classes for that one value."""
    for a in EDGES:
        for b in EDGES:
            if arg_key(a) == arg_key(b):
                assert _triton(a) == _triton(b), (a, b)


@settings(max_examples=200, deadline=None)
@given(dtype_a=st.sampled_from(DTYPES), dtype_b=st.sampled_from(DTYPES), off_a=st.integers(0, 40),
       off_b=st.integers(0, 40))
def test_tensor_key_is_never_coarser_than_triton(dtype_a, dtype_b, off_a, off_b):
    a = torch.empty(64, dtype=dtype_a)[off_a:]  # CPU tensors: the key reads only data_ptr and dtype
    b = torch.empty(64, dtype=dtype_b)[off_b:]
    if arg_key(a) == arg_key(b):
        assert _triton(a) == _triton(b)


@settings(max_examples=100, deadline=None)
@given(dtype_a=st.sampled_from(DTYPES[:3]), dtype_b=st.sampled_from(DTYPES[:3]),
       block_a=st.sampled_from([[1, 16, 32], [1, 32, 32], [2, 16, 32]]),
       block_b=st.sampled_from([[1, 16, 32], [1, 32, 32], [2, 16, 32]]), wide=st.booleans())
def test_descriptor_key_is_never_coarser_than_triton(dtype_a, dtype_b, block_a, block_b, wide):
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(dtype, block, cols):
        base = torch.empty(4, 32, cols, dtype=dtype)[:, :, :32]
        return TensorDescriptor(base, list(base.shape), list(base.stride()), block)

    a, b = desc(dtype_a, block_a, 32), desc(dtype_b, block_b, 64 if wide else 32)
    if arg_key(a) == arg_key(b):
        assert _triton(a) == _triton(b)


def test_other_arguments():
    assert arg_key(0.5) == arg_key(3.0) and _triton(0.5) == _triton(3.0)
    assert arg_key(True) != arg_key(False) and arg_key(True) != arg_key(1)
    assert arg_key(None) is None
    with pytest.raises(launch_mod._Unkeyed):
        arg_key("text")


def test_a_launch_hook_on_either_side_turns_the_direct_launch_off(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(launch_mod, "_runtime", lambda: (lambda: 0, lambda device: 0, knobs.runtime))
    assert launch_mod.direct_launch_possible()
    for chain in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        hook = lambda metadata: None  # noqa: E731
        chain.add(hook)
        try:
            assert not launch_mod.direct_launch_possible()
        finally:
            chain.remove(hook)


def test_run_compiled_pads_the_grid_to_three_dimensions():
    seen = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *launch_args):
            seen.append(launch_args[:4])

    for grid in ((4,), (4, 5), (4, 5, 6)):
        launch_mod.run_compiled(Compiled(), grid, 9, (), ())
    assert seen == [(4, 1, 1, 9), (4, 5, 1, 9), (4, 5, 6, 9)]


def test_non_jit_kernels_take_their_own_launch():
    calls = []

    class Interpreted:  # what `triton.jit` returns under TRITON_INTERPRET=1
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs)) or "ran"

    assert launch(Interpreted(), (3,), 1, 2, K=4) == "ran"
    assert calls == [((3,), (1, 2), {"K": 4})]


@triton.jit
def _axpy_kernel(x_ptr, s_x, y_ptr, n, alpha, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i * s_x, mask=i < n, other=0.0)
    tl.store(y_ptr + i, x * alpha + OFFSET, mask=i < n)


def _axpy(x, stride, n, alpha, offset, out_offset=0):
    y = torch.full((n + out_offset,), -7.0, device=x.device, dtype=x.dtype)[out_offset:]
    launch(_axpy_kernel, (triton.cdiv(n, 64),), x, stride, y, n, alpha, OFFSET=offset, BLOCK=64)
    return y


def _want(x, stride, n, alpha, offset):
    return (x[: n * stride: stride].float() * alpha + offset).to(x.dtype)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_every_specialisation_matches_torch_on_the_hit_path():
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096, device="cuda", generator=g)
    # alpha a power of two: x * alpha is exact, so a contracted multiply-add rounds as torch does
    cases = [(0, 1, 100, 2.0, 0), (0, 16, 64, 2.0, 0), (0, 3, 100, -1.0, 1), (1, 1, 100, 0.5, 0),
             (5, 16, 33, 4.0, 2), (0, 1, 1, 0.25, 0), (3, 1, 16, 1.0, 1)]
    for x_off, stride, n, alpha, offset in cases:
        x = base[x_off:]
        for out_off in (0, 1):
            first = _axpy(x, stride, n, alpha, offset, out_off)
            size = len(launch_mod._COMPILED)
            again = _axpy(x, stride, n, 2 * alpha, offset, out_off)  # a hit: same key, new values
            assert len(launch_mod._COMPILED) == size
            torch.testing.assert_close(first, _want(x, stride, n, alpha, offset), rtol=0, atol=0)
            torch.testing.assert_close(again, _want(x, stride, n, 2 * alpha, offset), rtol=0, atol=0)
            assert not again.isnan().any()


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_hit_path_replays_in_a_cuda_graph():
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    alpha = 2.0  # a power of two: exact whether or not the multiply-add is contracted
    run = lambda: launch(_axpy_kernel, (16,), x, 1, y, 1000, alpha, OFFSET=3, BLOCK=64)  # noqa: E731
    run(), run()  # compile, then a hit
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    x.copy_(torch.randn(1000, device="cuda"))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * alpha + 3, rtol=0, atol=0)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_launch_hooks_see_every_launch():
    from triton import knobs

    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    x = torch.randn(64, device="cuda")
    _axpy(x, 1, 64, 1.0, 0)  # cached before the hook exists
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        y = _axpy(x, 1, 64, 2.0, 0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1
    torch.testing.assert_close(y, x * 2, rtol=0, atol=0)


class _SharedMemoryBound:
    """A stand-in kernel whose tiles fit the device's shared memory from `fits` stages down."""

    def __init__(self, fits):
        self.fits, self.tried = fits, []
        self.fn = _SharedMemoryBound  # where Triton's JITFunction keeps the kernel's function (its name)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.errors import OutOfResources

            stages = kwargs.get("num_stages", launch_mod.DEFAULT_NUM_STAGES)
            self.tried.append(stages)
            if stages > self.fits:
                raise OutOfResources(1000 * stages, 1000 * self.fits, "shared memory")
            return ("ran", args, kwargs)
        return run


@pytest.mark.parametrize("fits", [3, 2, 1])
def test_a_kernel_too_large_for_its_stages_runs_at_the_deepest_that_fits(fits):
    kernel = _SharedMemoryBound(fits)
    assert launch(kernel, (1,), 7, K=4) == ("ran", (7,), {"K": 4} if fits == 3 else {"K": 4, "num_stages": fits})
    assert kernel.tried == list(range(3, fits - 1, -1))


def test_a_kernel_too_large_at_one_stage_is_refused_naming_it_and_its_bytes():
    kernel = _SharedMemoryBound(0)
    with pytest.raises(launch_mod.KernelTooLargeError,
                       match=r"_SharedMemoryBound: .*more shared memory than the device has at 4 to 1 stages "
                             r"\(1000 > 0 at the last\)"):
        launch(kernel, (1,), num_stages=4)
    assert kernel.tried == [4, 3, 2, 1]


def test_first_launch_hands_back_the_depth_it_ran_at_and_tuners_can_turn_the_retry_off(monkeypatch):
    """A recording replays `kernel[grid]` with the keywords it was given: they must be the ones that fit."""
    result, ran_with = launch_mod._first_launch(_SharedMemoryBound(2), (1,), (), {"num_stages": 3, "K": 1})
    assert ran_with == {"num_stages": 2, "K": 1} and result[2] == ran_with
    monkeypatch.setattr(launch_mod, "RETRY_FEWER_STAGES", False)
    kernel = _SharedMemoryBound(2)
    with pytest.raises(launch_mod.KernelTooLargeError, match="at 3 stage"):
        launch(kernel, (1,), num_stages=3)
    assert kernel.tried == [3]


def test_a_recorded_launch_through_triton_keeps_the_depth_that_ran(monkeypatch):
    """A replay through `kernel[grid]` uses the recorded keywords: those of the depth that fit."""
    from m3_eagle_plugin.msa.kernels import replay

    recorded = []
    monkeypatch.setattr(replay, "recording", lambda: True)
    monkeypatch.setattr(replay, "record_launch", lambda *launched: recorded.append(launched))
    kernel = _SharedMemoryBound(2)
    launch(kernel, (1,), 7, num_stages=3, K=1)
    assert [(k, compiled, kwargs) for k, compiled, _, _, kwargs, _ in recorded] == [
        (kernel, None, {"num_stages": 2, "K": 1})]


@triton.jit
def _wide_tiles_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    rm, rk, rn = tl.arange(0, BM), tl.arange(0, BK), tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_a_real_kernel_over_shared_memory_at_three_stages_runs_at_fewer():
    from triton.runtime.errors import OutOfResources

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(128, 1024, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(1024, 128, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.full((128, 128), float("nan"), device="cuda")
    tiles = dict(BM=128, BK=256, BN=128)  # 128 KB of bf16 operands a stage
    with pytest.raises(OutOfResources):  # what Triton alone does with these tiles at 3 stages
        _wide_tiles_kernel[(1,)](a, b, c, 1024, **tiles, num_stages=3)
    launch(_wide_tiles_kernel, (1,), a, b, c, 1024, **tiles, num_stages=3)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=2e-2, atol=2e-1)
    c.fill_(float("nan"))
    launch(_wide_tiles_kernel, (1,), a, b, c, 1024, **tiles, num_stages=3)  # the hit path keeps the depth
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=2e-2, atol=2e-1)


def test_a_kernel_refused_for_its_key_is_refused_again_without_compiling(monkeypatch):
    """Each retry costs up to three compiles; a shape that fits at no depth pays them once."""
    calls = []

    def refuse(kernel, grid, args, kwargs):
        calls.append(kwargs)
        raise launch_mod.KernelTooLargeError("_axpy_kernel: its tiles need more shared memory than the device has")

    monkeypatch.setattr(launch_mod, "_first_launch", refuse)
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)  # the cached path, without a GPU
    monkeypatch.setattr(launch_mod, "_runtime", lambda: (lambda: 0, lambda device: 0, None))
    monkeypatch.setattr(launch_mod, "_TOO_LARGE", {})
    monkeypatch.setattr(launch_mod, "_COMPILED", {})  # on a GPU an earlier test compiled this key for real
    x = torch.zeros(64)
    for _ in range(3):
        with pytest.raises(launch_mod.KernelTooLargeError, match="_axpy_kernel: its tiles need more"):
            launch(_axpy_kernel, (1,), x, 1, x, 64, 1.0, OFFSET=0, BLOCK=64)
    assert len(calls) == 1
    with pytest.raises(launch_mod.KernelTooLargeError):  # another key (BLOCK) is tried afresh
        launch(_axpy_kernel, (1,), x, 1, x, 64, 1.0, OFFSET=0, BLOCK=32)
    assert len(calls) == 2


def test_the_cached_path_keeps_what_the_first_launch_compiled(monkeypatch):
    """Later calls of a key launch the kernel the first one got (at whatever depth fit) directly."""
    ran = []

    class Compiled:
        function = packed_metadata = None

        def run(self, *launch_args):
            ran.append(launch_args[3:4] + launch_args[9:])

    compiled = Compiled()
    monkeypatch.setattr(launch_mod, "_first_launch", lambda kernel, grid, args, kwargs: (compiled, {**kwargs}))
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)
    monkeypatch.setattr(launch_mod, "_runtime", lambda: (lambda: 0, lambda device: 7, None))
    monkeypatch.setattr(launch_mod, "_COMPILED", {})
    x = torch.zeros(64)
    assert launch(_axpy_kernel, (1,), x, 1, x, 64, 1.0, OFFSET=3, BLOCK=64) is compiled and ran == []
    assert launch(_axpy_kernel, (1,), x, 1, x, 64, 2.0, OFFSET=3, BLOCK=64) is compiled
    assert ran == [(7, x, 1, x, 64, 2.0, 3, 64)]  # stream, the call's arguments, then the constexpr tail


@triton.jit
def _defaults_kernel(x_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False, SCALE: tl.constexpr = 2):
    pass


def test_tail_is_every_parameter_after_the_positional_ones_in_signature_order():
    """The compiled launcher takes every parameter: those given as keywords, else their defaults."""
    tail = launch_mod._tail
    assert tail(_defaults_kernel, 2, {"BLOCK": 64}) == (64, False, 2)
    assert tail(_defaults_kernel, 2, {"SCALE": 5, "BLOCK": 16, "PDL": True}) == (16, True, 5)
    assert tail(_defaults_kernel, 3, {}) == (False, 2)
    with pytest.raises(TypeError, match="_defaults_kernel: no value for parameter 'BLOCK'"):
        tail(_defaults_kernel, 2, {"PDL": True})
