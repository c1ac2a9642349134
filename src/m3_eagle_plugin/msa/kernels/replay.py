"""Eager kernel calls replayed from a recording of their launches: the per-layer host cost.

Why: an eager sparse verify step spent 260-600 us of host time a layer on the H200 (B1/8K to
B64/32K), against 8-160 us of GPU time: Python deciding splits, tiles and paths, checking inputs,
reading the environment, and Triton binding 24-44 arguments per launch. Every sparse layer of a
step asks the same questions with the same shapes and gets the same answers. CUDA graphs skip all
of it; batches run eagerly (past the captured sizes) pay it 57 times a step. Replayed, the same
calls took 71-145 us (dense: 106 -> 44 us; docs/performance-log.md, "Fifteenth session").

How: `Replayer.call(signature, inputs, meta, run)`. The first call of a signature runs `run()`
(the ordinary path) while recording: `launch.launch` reports every launch (the compiled kernel,
grid, arguments), and a dispatch mode sees every tensor operation. Later calls of the signature
allocate the same fresh tensors and launch the same compiled kernels with this call's `inputs` and
fresh tensors put where the recorded ones were; every other argument (the metadata's tensors, the
hand-off buffers) is the recorded object itself.

A recording is refused, and the call simply runs, whenever replaying it could differ from running
it: an operation other than an allocation or a view (a fill, a copy, a host read of a device
value), a launch argument that is a view into an input or a fresh tensor rather than the tensor
itself, or a result that is not a fresh tensor. The signature must hold everything else the
ordinary path decides on: the callers put in every input's shape, strides, dtype, device and
16-byte alignment, the metadata object (held weakly: a new object never matches an old
recording, and one that dies takes its recordings along) and its fields' shapes and addresses,
every scalar argument (and its type), and the environment variables the kernels read (`ENV_KEYS`).
`M3_EAGLE_REPLAY=0` turns replay off.

Contract for the kernel wrappers: a buffer kept across calls (`_common.step_buffer`) is made by a
fill (`torch.full`), which refuses that call's recording; an empty allocation (`torch.empty`) is
taken for a fresh output, allocated anew at every replay. A recording sees only its own thread's
launches; like the hand-off buffers, replays assume one thread launching on a device at a time.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._common import cuda_present, env_switch, env_value

#: Environment variables the kernel paths read; a change makes a new signature.
ENV_KEYS = ("M3_EAGLE_HANDOFF", "M3_EAGLE_PDL", "TRITON_INTERPRET")

#: Signatures whose recording was refused this many times run the ordinary path without trying again.
MAX_REFUSALS = 3

_ALLOCATIONS = {"empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
                "new_empty_strided.default"}

class _Active(threading.local):
    recorder: "_Recorder | None" = None  # the call this thread is recording, if any


_ACTIVE = _Active()


class _Refused(Exception):
    """The call cannot be replayed from a recording (the reason is the message)."""


def env_state() -> tuple:
    return tuple(map(env_value, ENV_KEYS))


def tensor_signature(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


#: The metadata fields the kernels read (tensors: their address and layout go in the signature).
META_FIELDS = ("block_tables", "kv_lens", "cu_qo_lens", "positions", "valid_blocks", "max_qo_len", "block_size")


def call_signature(inputs: tuple[torch.Tensor, ...], meta: Any, scalars: tuple) -> tuple | None:
    """The signature of a call: its inputs, its metadata object and fields, its scalar arguments,
    the environment (`ENV_KEYS`); None when an input is not a tensor (the ordinary path then
    says what is wrong)."""
    if not all(type(t) is torch.Tensor for t in inputs):
        return None
    fields = []
    for name in META_FIELDS:
        value = getattr(meta, name, None)
        fields.append(_layout(value) if isinstance(value, torch.Tensor) else value)
    device = torch.cuda.current_device() if cuda_present() else None  # the launches' device and stream
    # The scalars' types too: equal values of other types (False == 0 == 0.0, True == 1) hash alike, and the
    # ordinary path may tell them apart (`early is not False`; a float where an int is due raises there).
    return (tuple(map(tensor_signature, inputs)), id(meta), tuple(fields), scalars, tuple(map(type, scalars)),
            env_state(), device)


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


class _Recorder(TorchDispatchMode):
    """Watches one ordinary call: its allocations, its other tensor operations, its launches."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]):
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr(): [] for t in inputs}
        for i, t in enumerate(inputs):
            self.inputs[t.untyped_storage().data_ptr()].append((i, _layout(t)))
        self.fresh: dict[int, tuple[int, tuple]] = {}  # storage address -> (slot, layout)
        self.allocs: list[tuple] = []
        self.launches: list[tuple] = []
        self.refused: str | None = None
        if len({_layout(t) for t in inputs}) < len(inputs):  # one tensor as two inputs: a later call may differ
            self.refused = "two inputs are the same tensor"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = f"{func._opname}.{func._overloadname}"
        if name in _ALLOCATIONS and isinstance(out, torch.Tensor) and out.numel() > 0:
            self.fresh[out.untyped_storage().data_ptr()] = (len(self.allocs), _layout(out))
            self.allocs.append((tuple(out.shape), out.stride(), out.dtype, out.device))
        elif not func.is_view and self.refused is None:
            self.refused = f"{name} is neither an allocation nor a view"
        return out

    def slot(self, arg: Any) -> tuple | None:
        """Where a launch argument or a result comes from: ("in", i), ("new", j), or None (kept as is)."""
        if not isinstance(arg, torch.Tensor):
            return None
        storage = arg.untyped_storage().data_ptr()
        for i, layout in self.inputs.get(storage, ()):
            if _layout(arg) == layout:
                return ("in", i)
        if storage in self.inputs:
            raise _Refused("a launch takes a view into an input")
        if storage in self.fresh:
            j, layout = self.fresh[storage]
            if _layout(arg) != layout:
                raise _Refused("a launch takes a view into a fresh tensor")
            return ("new", j)
        return None

    def record_launch(self, kernel: Any, compiled: Any, grid: tuple, args: tuple, kwargs: dict, tail: tuple) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        subs = []
        for pos, arg in enumerate(args):
            if isinstance(arg, TensorDescriptor):
                where = self.slot(arg.base)
                if where is None or where[0] != "in":
                    raise _Refused("a tensor descriptor over something other than an input")
                subs.append((pos, ("desc", where[1], arg.shape, arg.strides, arg.block_shape)))
                continue
            where = self.slot(arg)
            if where is not None:
                subs.append((pos, where))
        template = list(args)
        for pos, _ in subs:
            template[pos] = None  # this call's inputs and outputs are not kept alive by the recording
        self.launches.append((kernel, compiled, tuple(grid), tuple(template), kwargs, tail, tuple(subs)))


def recording() -> bool:
    return _ACTIVE.recorder is not None


def record_launch(kernel: Any, compiled: Any, grid: tuple, args: tuple, kwargs: dict, tail: tuple) -> None:
    """Called by `launch.launch` for every launch while a call is being recorded (`compiled` None:
    replay it through `kernel[grid]`)."""
    try:
        _ACTIVE.recorder.record_launch(kernel, compiled, grid, args, kwargs, tail)
    except _Refused as refused:
        _ACTIVE.recorder.refused = _ACTIVE.recorder.refused or str(refused)


class _Recording:
    """One signature's allocations, launches and result structure."""

    def __init__(self, rec: _Recorder, result: Any, meta: Any, on_meta_death: Callable | None = None):
        self.allocs = rec.allocs
        self.launches = rec.launches
        self.meta = weakref.ref(meta, on_meta_death)
        self.result = self._shape(rec, result)

    @staticmethod
    def _shape(rec: _Recorder, result: Any) -> Any:
        if isinstance(result, tuple):
            return tuple(_Recording._shape(rec, r) for r in result)
        if result is None:
            return None
        where = rec.slot(result)
        if where is None or where[0] != "new":
            raise _Refused("a result that is not a fresh tensor")
        return where

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> Any:
        from triton.tools.tensor_descriptor import TensorDescriptor

        from .launch import current_stream, run_compiled

        fresh = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                 for shape, stride, dtype, device in self.allocs]
        stream = None
        for kernel, compiled, grid, args, kwargs, tail, subs in self.launches:
            if subs:
                args = list(args)
                for pos, (kind, i, *desc) in subs:
                    if kind == "in":
                        args[pos] = inputs[i]
                    elif kind == "new":
                        args[pos] = fresh[i]
                    else:
                        args[pos] = TensorDescriptor(inputs[i], *desc)
            if compiled is None:
                kernel[grid](*args, **kwargs)
                continue
            if stream is None:
                stream = current_stream()
            run_compiled(compiled, grid, stream, args, tail)
        return self._build(self.result, fresh)

    def _build(self, shape: Any, fresh: list) -> Any:
        if isinstance(shape, tuple) and shape and isinstance(shape[0], str):
            return fresh[shape[1]]
        if shape is None:
            return None
        return tuple(self._build(s, fresh) for s in shape)


#: Recordings kept per entry point at most (a new metadata object or shape makes a new one).
MAX_RECORDINGS = 256


ENV_VAR = "M3_EAGLE_REPLAY"


def replay_enabled() -> bool:
    """Replay is on unless `M3_EAGLE_REPLAY=0`; any value but 0 or 1 is refused (a typo such as
    `off` must not silently leave it on)."""
    return env_switch(ENV_VAR) == "1"


class Replayer:
    """The recordings of one kernel entry point, by signature."""

    def __init__(self) -> None:
        self.recordings: dict[tuple, _Recording | int] = {}  # a recording, or how often it was refused
        self.last_refusal: str | None = None
        _REPLAYERS.add(self)

    def call(self, signature: tuple | None, inputs: tuple[torch.Tensor, ...], meta: Any, run: Callable[[], Any]) -> Any:
        """`run()`, or its recording replayed with `inputs` when `signature` was recorded before."""
        from .launch import direct_launch_possible

        # A call inside another's recording runs its ordinary path even where it has a recording of
        # its own: a replay launches past `launch.launch`, so the outer recording would miss those launches.
        if signature is None or not replay_enabled() or recording():
            return run()
        try:
            seen = self.recordings.get(signature)
        except TypeError:  # an unhashable scalar argument
            return run()
        if isinstance(seen, _Recording):
            if seen.meta() is meta and direct_launch_possible():
                return seen.replay(inputs)
            seen = None
        if (isinstance(seen, int) and seen >= MAX_REFUSALS) or not _recording_allowed(meta):
            return run()
        rec = _Recorder(inputs)
        _ACTIVE.recorder = rec
        try:
            with rec:
                result = run()
        finally:
            _ACTIVE.recorder = None
        if len(self.recordings) >= MAX_RECORDINGS:
            self.recordings.clear()
        try:
            if rec.refused:
                raise _Refused(rec.refused)
            forget = functools.partial(_forget, weakref.ref(self), signature)
            self.recordings[signature] = _Recording(rec, result, meta, forget)
        except _Refused as refused:
            self.recordings[signature] = (seen or 0) + 1
            self.last_refusal = str(refused)
        return result

    def clear(self) -> None:
        self.recordings.clear()


_REPLAYERS: "weakref.WeakSet[Replayer]" = weakref.WeakSet()


def _forget(replayer_ref: "weakref.ref[Replayer]", signature: tuple, meta_ref: weakref.ref) -> None:
    """A recording's metadata object died: no call can match the recording again, so drop it (its
    launches hold the metadata's tensors, which would otherwise outlive it)."""
    replayer = replayer_ref()
    if replayer is not None and getattr(replayer.recordings.get(signature), "meta", None) is meta_ref:
        replayer.recordings.pop(signature, None)


def clear_all() -> None:
    """Forget every recording (tests that patch the kernels' helpers start from the ordinary path)."""
    for replayer in list(_REPLAYERS):
        replayer.clear()


def _recording_allowed(meta: Any) -> bool:
    """No graph being captured (its allocations would be the graph's), a GPU launcher in use, and
    a metadata object whose identity can be checked later (a weak reference; a `SimpleNamespace`
    has none)."""
    from .launch import direct_launch_possible

    if not cuda_present() or torch.cuda.is_current_stream_capturing() or not direct_launch_possible():
        return False
    try:
        weakref.ref(meta)
    except TypeError:
        return False
    return True
