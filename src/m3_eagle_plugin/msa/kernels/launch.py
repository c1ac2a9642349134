"""Kernel launches that skip Triton's per-call binding once a specialisation has been launched.

Why: an eager sparse verify step spent 145 of its 373 us of host time (H200, B1/8K q4) in
`JITFunction.run` for its four kernels (16-43 us a launch): binding 24-44 arguments, specialising
each, building the cache key, checking globals, building launch metadata. The compiled kernel's
own launcher took 5-14 us of that per kernel. CUDA graphs pay none of this; eager steps
(TensorRT-LLM runs batches past its captured sizes eagerly) pay it on every layer. Replayed calls
(`replay`) launch the compiled kernels this module keeps.

How: `launch(kernel, grid, *args, **kwargs)` is `kernel[grid](*args, **kwargs)`. It keys the call
on the kernel, the device, the keyword arguments (constexprs and launch options, by value) and,
per positional argument, what Triton specialises on (`arg_key`: a tensor's dtype and 16-byte
alignment; an int's 1 / multiple-of-16 / 32-bit classes; a float's type; a tensor descriptor's
element type, block shape and padding). The first call of a key goes through `kernel[grid]`,
which compiles (or finds) the kernel and returns it; later calls hand the arguments straight to
that compiled kernel's launcher. The key is never coarser than
Triton's specialisation, so a hit always runs the kernel Triton would have picked (at the depth
that fit, below).

Falls back to `kernel[grid]` under the interpreter, with launch hooks installed (profilers), or for
an argument type it does not key. Assumes Triton's global knobs (debug, instrumentation) do not
change after the first launch of a key.

Shared memory: the tiles are tuned for M3 (head dim 128, 16-bit or fp8 K/V). Larger rows (head dim
256, fp32 queries or caches) can ask more shared memory than the device has; Triton says so when
the compiled kernel is first loaded, before anything runs. Such a first launch is retried with
fewer pipeline stages (the shape then runs at the depth that fits; `RETRY_FEWER_STAGES = False`
turns that off for tuners that label runs by depth); where even one stage does not fit,
`KernelTooLargeError` names the kernel and the bytes, is kept for the key (later calls raise it
without Triton), and the dispatchers take the torch reference under `auto`.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import replay
from ._common import KernelTooLargeError

_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
_INT32 = (-(1 << 31), 1 << 31)


#: Triton's pipeline depth when a launch names none (CUDA backend).
DEFAULT_NUM_STAGES = 3
#: Whether a first launch over the device's shared memory is retried at fewer stages (`_first_launch`).
RETRY_FEWER_STAGES = True
#: Keys whose kernel does not fit the device at any depth: the refusal's message, raised again on later calls.
_TOO_LARGE: dict[tuple, str] = {}


class _Unkeyed(Exception):
    """An argument whose specialisation `arg_key` does not model."""


def arg_key(arg: Any) -> Any:
    """What Triton specialises on for one positional argument (finer never hurts, coarser would)."""
    kind = type(arg)
    if kind is int:
        width = 0 if _INT32[0] <= arg < _INT32[1] else (64 if arg < 1 << 63 else 65)
        return width + (1 if arg == 1 else 16 if arg % 16 == 0 else 0)
    if kind is torch.Tensor or isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if kind is float:
        return float
    if kind is bool:
        return bool, arg
    if arg is None:
        return None
    if kind is TensorDescriptor:  # Triton specialises on the element type and the block shape
        return TensorDescriptor, arg.base.dtype, tuple(arg.block_shape), arg.padding
    raise _Unkeyed(kind)


def _tail(kernel: Any, num_args: int, kwargs: dict) -> tuple:
    """Values of the parameters after the positional ones, in signature order (the launcher takes
    every parameter, constexprs included, and ignores the constexprs)."""
    out = []
    for param in kernel.params[num_args:]:
        name = param.name
        if name in kwargs:
            out.append(kwargs[name])
        elif param.has_default:
            out.append(param.default)
        else:
            raise TypeError(f"{kernel.fn.__name__}: no value for parameter {name!r}")
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _runtime() -> tuple[Any, Any, Any] | None:
    """(current device getter, current stream getter, Triton's runtime knobs), or None where no GPU
    driver is active."""
    from triton import knobs
    from triton.runtime.driver import driver

    try:
        active = driver.active
        return active.get_current_device, active.get_current_stream, knobs.runtime
    except RuntimeError:
        return None


def direct_launch_possible() -> bool:
    """Whether a compiled kernel may be launched without Triton's `JITFunction.run`: a GPU driver
    is active and no launch hook (a profiler) wants to see launches."""
    runtime = _runtime()
    return runtime is not None and not (runtime[2].launch_enter_hook.calls or runtime[2].launch_exit_hook.calls)


def current_stream() -> int:
    """The raw CUDA stream Triton would launch on (the current device's current stream)."""
    get_device, get_stream, _ = _runtime()
    return get_stream(get_device())


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """`kernel[grid](*args, **kwargs)`, without Triton's binding when the key was launched before."""
    from triton.runtime.jit import JITFunction

    if type(kernel) is not JITFunction or not direct_launch_possible():  # e.g. the interpreter's kernels
        return _through_triton(kernel, grid, args, kwargs)
    get_device, get_stream, _ = _runtime()
    device = get_device()
    try:
        key = (id(kernel), device, tuple(kwargs.items()), tuple(map(arg_key, args)))
        hit = _COMPILED.get(key)
    except (_Unkeyed, TypeError):  # TypeError: an unhashable keyword value
        return _through_triton(kernel, grid, args, kwargs)
    launched = hit is None
    if launched:  # Triton binds, compiles or finds the kernel, and launches it
        if key in _TOO_LARGE:
            raise KernelTooLargeError(_TOO_LARGE[key])
        try:
            compiled, _ = _first_launch(kernel, grid, args, kwargs)
        except KernelTooLargeError as refusal:
            _TOO_LARGE[key] = str(refusal)
            raise
        if hasattr(compiled, "result"):  # Triton's asynchronous compile mode
            compiled = compiled.result()
        if compiled is None:
            return None
        hit = _COMPILED[key] = (compiled, _tail(kernel, len(args), kwargs))
    compiled, tail = hit
    if replay.recording():
        replay.record_launch(kernel, compiled, grid, args, kwargs, tail)
    if not launched:
        run_compiled(compiled, grid, get_stream(device), args, tail)
    return compiled


def run_compiled(compiled: Any, grid: tuple[int, ...], stream: int, args: tuple, tail: tuple) -> None:
    """Launch a compiled kernel on `stream` through its own launcher: `args` positional, `tail` the
    remaining parameters (`_tail`), no launch hooks."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)


def _first_launch(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> tuple[Any, dict]:
    """(`kernel[grid](*args, **kwargs)`'s result, the keyword arguments it ran with): where the
    tiles do not fit the device, again at one pipeline stage fewer each time (Triton then caches
    that depth for these arguments), else `KernelTooLargeError`."""
    from triton.runtime.errors import OutOfResources

    stages = kwargs.get("num_stages") or DEFAULT_NUM_STAGES
    for depth in range(stages, 0, -1) if RETRY_FEWER_STAGES else (stages,):
        tried = kwargs if depth == stages else {**kwargs, "num_stages": depth}
        try:
            return kernel[grid](*args, **tried), tried
        except OutOfResources as error:
            last = error
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
    depths = f"{stages} to 1 stages" if RETRY_FEWER_STAGES and stages > 1 else f"{stages} stage(s)"
    raise KernelTooLargeError(
        f"{name}: its tiles need more {last.name} than the device has at {depths} ({last.required} > "
        f"{last.limit} at the last); they are sized for head dim 128 with 16-bit or fp8 K/V, and the torch "
        f"references (no fp8 scales) run other shapes") from None


def _through_triton(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> Any:
    result, ran_with = _first_launch(kernel, grid, args, kwargs)
    if replay.recording():  # with the depth that ran, so a replay through `kernel[grid]` fits too
        replay.record_launch(kernel, None, grid, args, ran_with, ())
    return result
