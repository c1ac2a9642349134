"""Replayed eager calls (`msa/kernels/replay.py`).

On CPU, stand-in kernels (objects Triton's launch path treats like the interpreter's) check the
mechanism against the ordinary call: inputs and fresh outputs substituted, the wrapper's Python
not run again, and every unsafe pattern refused (the call then runs as usual). On a GPU, the
sparse verify step and the dense attention, replayed for several "layers" of one metadata
object, must match the torch reference and the plain launches every time, eagerly and inside a
CUDA graph."""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from m3_eagle_plugin.msa.kernels import launch as launch_mod, replay  # noqa: E402
from m3_eagle_plugin.msa.kernels.launch import launch  # noqa: E402
from m3_eagle_plugin.msa.kernels.replay import Replayer, call_signature  # noqa: E402


@dataclass(eq=False)
class Meta:
    kv_lens: torch.Tensor
    max_qo_len: int = 1


class Doubler:
    """A stand-in kernel: `out = 2 * x + sum(kv_lens)`, its work invisible to the recorder as a
    GPU kernel's is."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        def run(x, kv_lens, out, *, SHIFT):
            self.launches += 1
            with torch.utils._python_dispatch._disable_current_modes():
                out.copy_((2 * x + kv_lens.sum() + SHIFT)[: len(out)])
        return run


@pytest.fixture
def cpu_replay(monkeypatch):
    monkeypatch.setattr(replay, "_recording_allowed", lambda meta: True)
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)
    monkeypatch.delenv("M3_EAGLE_REPLAY", raising=False)


def _wrapper(kernel, replayer, body_runs, extra=None):
    def call(x, meta, shift=1):
        def run():
            body_runs.append(1)
            out = torch.empty_like(x)
            arg = x if extra is None else extra(x, out)
            launch(kernel, (1,), arg, meta.kv_lens, out, SHIFT=shift)
            return out
        return replayer.call(call_signature((x,), meta, (shift,)), (x,), meta, run)
    return call


def _quarters(*shape, generator=None):
    """Random multiples of 1/4 in [-16, 16): the fakes' arithmetic on them is exact in any order, so
    outputs compare with zero tolerance."""
    return torch.randint(-64, 64, shape, generator=generator).float() / 4


def test_replay_substitutes_inputs_and_fresh_outputs(cpu_replay):
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta = Meta(torch.tensor([3, 4]))
    outs = []
    for seed in range(4):
        x = _quarters(5, 3, generator=torch.Generator().manual_seed(seed))
        out = call(x, meta)
        torch.testing.assert_close(out, 2 * x + 7 + 1, rtol=0, atol=0)
        outs.append(out)
    assert len(body) == 1 and kernel.launches == 4  # the wrapper ran once; the kernel every call
    assert len({o.data_ptr() for o in outs}) == 4  # every call got its own output
    meta.kv_lens.fill_(10)  # device values change between steps: the kept metadata tensor is read again
    x = _quarters(5, 3)
    torch.testing.assert_close(call(x, meta), 2 * x + 20 + 1, rtol=0, atol=0)


def test_signature_changes_record_again(cpu_replay):
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta = Meta(torch.tensor([1]))
    call(_quarters(5, 3), meta)
    call(_quarters(6, 3), meta)  # a new shape
    x = _quarters(5, 3)
    torch.testing.assert_close(call(x, meta, shift=5), 2 * x + 1 + 5, rtol=0, atol=0)  # a new scalar
    assert len(body) == 3
    other = Meta(torch.tensor([1]))  # a new metadata object never replays another's recording
    call(_quarters(5, 3), other)
    assert len(body) == 4


def test_scalars_equal_in_value_but_not_in_type_record_apart(cpu_replay):
    """`False == 0 == 0.0` and `True == 1` hash alike, but the ordinary path may tell them apart
    (`sparse_verify_step` reads `early is not False`; an int argument given as a float raises)."""
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta = Meta(torch.tensor([1]))
    x = _quarters(5, 3)
    for shift in (False, False, 0, 0.0, True, 1):
        torch.testing.assert_close(call(x, meta, shift=shift), 2 * x + 1 + shift, rtol=0, atol=0)
    assert len(body) == 5  # False recorded, then replayed; 0, 0.0, True and 1 each recorded
    sig = lambda *scalars: call_signature((x,), meta, scalars)  # noqa: E731
    assert sig(4, 0.5, None) == sig(4, 0.5, None) and sig(4) != sig(4.0)


def test_a_dead_metadata_object_is_never_matched(cpu_replay):
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta = Meta(torch.tensor([1]))
    call(_quarters(5, 3), meta)
    (recording,) = replayer.recordings.values()
    recording.meta = weakref.ref(Meta(torch.tensor([0])))  # what a dead or reused id looks like
    call(_quarters(5, 3), meta)
    assert len(body) == 2


def _view_of_input(kernel, x, out, meta):
    launch(kernel, (1,), x[1:], meta.kv_lens, out[1:], SHIFT=0)


def _in_place_op(kernel, x, out, meta):
    x.add_(0)
    launch(kernel, (1,), x, meta.kv_lens, out, SHIFT=0)


def _view_of_fresh(kernel, x, out, meta):
    launch(kernel, (1,), x, meta.kv_lens, out[:2], SHIFT=0)


@pytest.mark.parametrize("body,reason", [(_view_of_input, "a view into an input"), (_in_place_op, "add_"),
                                         (_view_of_fresh, "a view into a fresh tensor")])
def test_unsafe_calls_are_never_replayed(cpu_replay, body, reason):
    kernel, replayer, runs = Doubler(), Replayer(), []

    def call(x, meta):
        def run():
            runs.append(1)
            out = torch.empty_like(x)
            body(kernel, x, out, meta)
            return out
        return replayer.call(call_signature((x,), meta, ()), (x,), meta, run)

    meta = Meta(torch.tensor([0]))
    for _ in range(replay.MAX_REFUSALS + 2):
        call(_quarters(4, 3), meta)
    assert len(runs) == replay.MAX_REFUSALS + 2
    assert replayer.recordings and not any(isinstance(r, replay._Recording) for r in replayer.recordings.values())
    assert reason in replayer.last_refusal


def test_one_tensor_as_two_inputs_is_never_recorded(cpu_replay):
    replayer, body = Replayer(), []
    meta = Meta(torch.tensor([0]))

    def call(a, b):
        return replayer.call(call_signature((a, b), meta, ()), (a, b), meta,
                             lambda: body.append(1) or torch.empty_like(a))

    x = _quarters(3)
    call(x, x)
    call(x, _quarters(3))  # same signature (shapes, alignment): must not reuse the aliased recording
    assert len(body) == 2 and "same tensor" in replayer.last_refusal


def test_other_threads_launches_are_not_recorded(cpu_replay):
    import threading

    mine, theirs, replayer, body = Doubler(), Doubler(), Replayer(), []
    call = _wrapper(mine, replayer, body)
    meta = Meta(torch.tensor([1]))
    other = threading.Thread(target=lambda: launch(theirs, (1,), torch.ones(2), meta.kv_lens, torch.empty(2),
                                                   SHIFT=0))
    original = replay._Recorder.record_launch

    def record_while_another_thread_launches(self, *args):
        if not other.is_alive() and theirs.launches == 0:
            other.start()
            other.join()
        original(self, *args)

    replay._Recorder.record_launch = record_while_another_thread_launches
    try:
        call(_quarters(3), meta)
    finally:
        replay._Recorder.record_launch = original
    (recording,) = replayer.recordings.values()
    assert [launched[0] for launched in recording.launches] == [mine] and theirs.launches == 1
    x = _quarters(3)
    torch.testing.assert_close(call(x, meta), 2 * x + 2, rtol=0, atol=0)
    assert len(body) == 1 and theirs.launches == 1


def test_results_must_be_fresh(cpu_replay):
    replayer, body = Replayer(), []
    meta = Meta(torch.tensor([0]))
    for _ in range(3):
        x = _quarters(3)
        assert replayer.call(call_signature((x,), meta, ()), (x,), meta, lambda: body.append(1) or x) is x
    assert len(body) == 3 and "not a fresh tensor" in replayer.last_refusal


def test_empty_results_are_two_tensors_every_time(cpu_replay):
    """Zero-element tensors share one address (0): two such outputs must not come back as one tensor."""
    replayer, body = Replayer(), []
    meta = Meta(torch.tensor([0]))
    for _ in range(3):
        x = _quarters(2, 3)
        out = replayer.call(call_signature((x,), meta, ()), (x,), meta,
                            lambda: body.append(1) or (torch.empty(0, 4), torch.empty(0, 4)))
        assert out[0] is not out[1] and out[0].shape == out[1].shape == (0, 4)


def test_a_descriptor_over_a_fresh_tensor_is_never_replayed(cpu_replay):
    """A recorded descriptor is rebuilt over this call's input; one over a fresh output cannot be."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    class DescDoubler:
        def __getitem__(self, grid):
            def run(x, desc):
                with torch.utils._python_dispatch._disable_current_modes():
                    desc.base.copy_(2 * x)
            return run

    kernel, replayer, body = DescDoubler(), Replayer(), []
    meta = Meta(torch.tensor([0]))

    def call(x):
        def run():
            body.append(1)
            out = torch.empty_like(x)
            launch(kernel, (1,), x, TensorDescriptor(out, list(out.shape), list(out.stride()), [4, 8]))
            return out
        return replayer.call(call_signature((x,), meta, ()), (x,), meta, run)

    for _ in range(3):
        x = _quarters(4, 8)
        torch.testing.assert_close(call(x), 2 * x, rtol=0, atol=0)
    assert len(body) == 3 and "tensor descriptor over something other than an input" in replayer.last_refusal


def test_a_call_made_while_recording_is_recorded_with_the_outer_call(cpu_replay):
    """A wrapper that calls another (the step calling its attention) is one recording: the inner
    call neither records on its own nor takes the outer call's later launches out of its recording."""
    inner_kernel, outer_kernel, inner, outer, body = Doubler(), Doubler(), Replayer(), Replayer(), []
    inner_call = _wrapper(inner_kernel, inner, [])
    meta = Meta(torch.tensor([1]))

    def call(x):
        def run():
            body.append(1)
            y = inner_call(x, meta)  # 2x + 1 + 1
            out = torch.empty_like(x)
            launch(outer_kernel, (1,), y, meta.kv_lens, out, SHIFT=0)  # 2y + 1
            return out
        return outer.call(call_signature((x,), meta, ()), (x,), meta, run)

    for _ in range(3):
        x = _quarters(4, 3)
        torch.testing.assert_close(call(x), 2 * (2 * x + 2) + 1, rtol=0, atol=0)
    assert len(body) == 1 and not inner.recordings and outer_kernel.launches == 3


def test_an_inner_call_with_its_own_recording_runs_inside_the_outer_recording(cpu_replay):
    """An inner entry point recorded on its own first does not replay while an outer call records:
    its replay launches past `launch`, and the outer recording (replayed later) would leave the inner
    output unwritten."""
    inner_kernel, outer_kernel, inner, outer = Doubler(), Doubler(), Replayer(), Replayer()
    inner_call = _wrapper(inner_kernel, inner, [])
    meta = Meta(torch.tensor([1]))

    def call(x):
        def run():
            y = inner_call(x, meta)  # 2x + 1 + 1
            out = torch.empty_like(x)
            launch(outer_kernel, (1,), y, meta.kv_lens, out, SHIFT=0)  # 2y + 1
            return out
        return outer.call(call_signature((x,), meta, ()), (x,), meta, run)

    inner_call(_quarters(4, 3), meta)  # recorded on its own
    for seed in range(3):
        x = _quarters(4, 3, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(call(x), 2 * (2 * x + 2) + 1, rtol=0, atol=0)
    assert inner_kernel.launches == 4  # the inner kernel ran in every outer call


def test_a_metadata_object_without_weak_references_is_never_recorded(monkeypatch):
    """A recording holds its metadata weakly (`_recording_allowed`): a SimpleNamespace, which takes
    no weak reference, runs the ordinary path every time."""
    import types

    monkeypatch.setattr(replay, "cuda_present", lambda: True)  # a GPU process, not capturing, no launch hook
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch_mod, "direct_launch_possible", lambda: True)
    monkeypatch.delenv("M3_EAGLE_REPLAY", raising=False)
    replayer, body = Replayer(), []
    run = lambda: body.append(1) or torch.empty(3)  # noqa: E731
    meta = types.SimpleNamespace()
    for _ in range(2):
        replayer.call(("sig",), (_quarters(3),), meta, run)
    assert len(body) == 2 and not replayer.recordings
    meta = Meta(torch.tensor([0]))  # weakly referable: recorded, then replayed
    for _ in range(2):
        replayer.call(("sig",), (_quarters(3),), meta, run)
    assert len(body) == 3


def test_recording_keeps_no_input_alive(cpu_replay):
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta = Meta(torch.tensor([1]))
    x = _quarters(5, 3)
    out = call(x, meta)
    refs = weakref.ref(x), weakref.ref(out)
    del x, out
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


def test_a_dead_metadata_objects_recordings_let_go_of_its_tensors(cpu_replay):
    """A recording's launches hold the metadata's tensors (they are its recorded arguments); once the
    metadata object dies no call can match the recording, so it must not keep them (an engine's block
    tables outlived it, up to MAX_RECORDINGS of them). Another metadata's recording stays and replays."""
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    meta, kept = Meta(torch.tensor([1])), Meta(torch.tensor([2]))
    call(_quarters(5, 3), meta)
    call(_quarters(5, 3), kept)
    kv_lens = weakref.ref(meta.kv_lens)
    del meta
    gc.collect()
    assert kv_lens() is None and len(replayer.recordings) == 1
    x = _quarters(5, 3)
    torch.testing.assert_close(call(x, kept), 2 * x + 2 + 1, rtol=0, atol=0)
    assert len(body) == 2  # replayed


def test_turned_off_by_the_environment(cpu_replay, monkeypatch):
    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    monkeypatch.setenv("M3_EAGLE_REPLAY", "0")
    meta = Meta(torch.tensor([1]))
    for _ in range(3):
        call(torch.randn(2), meta)
    assert len(body) == 3


@pytest.mark.parametrize("value", ["off", "false", "2"])
def test_an_unknown_switch_value_is_refused(cpu_replay, monkeypatch, value):
    from m3_eagle_plugin.msa.kernels._common import KernelInputError

    kernel, replayer, body = Doubler(), Replayer(), []
    call = _wrapper(kernel, replayer, body)
    monkeypatch.setenv("M3_EAGLE_REPLAY", value)
    with pytest.raises(KernelInputError, match=f"M3_EAGLE_REPLAY='{value}'"):
        call(torch.randn(2), Meta(torch.tensor([1])))
    assert body == []


def test_bad_inputs_get_the_ordinary_paths_error(cpu_replay, monkeypatch):
    from m3_eagle_plugin.msa.kernels._common import KernelInputError
    from m3_eagle_plugin.msa.kernels.verify_step import sparse_verify_step

    meta = Meta(torch.tensor([1]))
    q = torch.randn(2, 4, 16)
    call = lambda: sparse_verify_step(torch.randn(2, 1, 16), None, q, q, q, meta, topk=2, scale=1.0)  # noqa: E731
    with pytest.raises(KernelInputError) as replayed:
        call()
    monkeypatch.setenv("M3_EAGLE_REPLAY", "0")
    with pytest.raises(KernelInputError) as ordinary:
        call()
    assert str(replayed.value) == str(ordinary.value)
    assert call_signature((q, None), meta, ()) is None


def test_env_keys_cover_the_kernels_switches():
    from m3_eagle_plugin.msa.kernels import handoff, pdl

    assert {pdl.ENV_VAR, handoff.ENV_VAR, "TRITON_INTERPRET"} <= set(replay.ENV_KEYS)


# ----- GPU: the real entry points, replayed across layers --------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layers(kv_dtype, n=3):
    from m3_eagle_plugin.bench.inputs import Geometry, make_cache

    from .kernel_case_helpers import random_step

    geo = Geometry(q_heads=16, kv_heads=2, head_dim=32, index_heads=2, index_dim=32, block=16, topk=4)
    meta, cache, q, index_q = random_step(geo, [4, 1, 3, 4], [150, 16, 97, 300], kv_dtype=kv_dtype,
                                          index_dtype=torch.bfloat16, q_dtype=torch.bfloat16, pad_tokens=2)
    layers = [(cache, q, index_q)]
    for i in range(1, n):
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        layers.append((make_cache(cache.k.shape[0], geo, kv_dtype=kv_dtype, index_dtype=torch.bfloat16,
                                  device=torch.device("cuda"), generator=g),
                       torch.randn(q.shape, device="cuda", generator=g).to(q.dtype),
                       torch.randn(index_q.shape, device="cuda", generator=g).to(index_q.dtype)))
    return geo, meta, layers


@needs_cuda
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_step_replayed_across_layers_matches_the_reference(kv_dtype):
    from m3_eagle_plugin.bench import torch_reference as ref
    from m3_eagle_plugin.msa.kernels import verify_step

    from .kernel_case_helpers import assert_close_rel

    geo, meta, layers = _layers(kv_dtype)
    verify_step._REPLAYER.clear()
    scale = geo.head_dim ** -0.5
    for _ in range(3):
        for cache, q, index_q in layers:
            sel, out = verify_step.sparse_verify_step(index_q, cache.index_k, q, cache.k, cache.v, meta, topk=geo.topk,
                                                      scale=scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                                      max_qo_len=4)
            want = ref.select_blocks(index_q, cache.index_k, meta, topk=geo.topk)
            assert torch.equal(sel.cpu(), want.cpu())
            expect = ref.sparse_attention(q, cache.k, cache.v, meta, want, scale=scale, k_scale=cache.k_scale,
                                          v_scale=cache.v_scale)
            live = int(meta.cu_qo_lens[-1])
            assert_close_rel(out[:live].float(), expect[:live].float(), 3e-3 if kv_dtype == torch.bfloat16 else 2e-2)
            assert (out[live:] == 0).all()
    (recording,) = [r for r in verify_step._REPLAYER.recordings.values() if isinstance(r, replay._Recording)]
    through_triton = [kernel for kernel, compiled, *_ in recording.launches if compiled is None]
    assert not through_triton, "these launches replay through Triton's binding"


@needs_cuda
def test_dense_replayed_across_layers_and_in_a_graph():
    from m3_eagle_plugin.bench import torch_reference as ref
    from m3_eagle_plugin.msa.kernels import dense_verify

    from .kernel_case_helpers import assert_close_rel, capture_after_warmup

    geo, meta, layers = _layers(torch.bfloat16)
    dense_verify._REPLAYER.clear()
    scale = geo.head_dim ** -0.5
    run = lambda cache, q: dense_verify.dense_verify_attention(q, cache.k, cache.v, meta, scale=scale)  # noqa: E731
    live = int(meta.cu_qo_lens[-1])
    for _ in range(2):
        for cache, q, _ in layers:
            expect = ref.dense_attention(q, cache.k, cache.v, meta, scale=scale)
            assert_close_rel(run(cache, q)[:live].float(), expect[:live].float(), 3e-3)
    assert any(isinstance(r, replay._Recording) for r in dense_verify._REPLAYER.recordings.values())
    cache, q, _ = layers[0]
    graph, out = capture_after_warmup(lambda: run(cache, q))  # the capture replays the recording
    q.copy_(torch.randn_like(q))
    graph.replay()
    expect = ref.dense_attention(q, cache.k, cache.v, meta, scale=scale)
    assert_close_rel(out[:live].float(), expect[:live].float(), 3e-3)
