"""Eagle3 auxiliary hidden-state capture from the target model.

`AuxCapture(layer_ids)` records, for each configured id i, the residual stream at the INPUT of
target layer i (hidden + residual, before `input_layernorm`; equal to transformers'
`output_hidden_states[i]`) for every token of the step, verify tokens included.

Convention: ids mean "input of layer i" (vLLM; default (2, L//2, L-3) = (2, 30, 57) for M3).
TensorRT-LLM, NeMo and SpecForge's exports name the same tensors "output of layer j" with
j = i - 1 (1, 29, 56); use `from_output_layer_ids` to convert such ids. (SGLang adds 1 to ids
whose first is 1; a config does not say which convention its ids follow.)

Two storage modes: by default the recorded tensors are kept and concatenated by `stacked()`;
after `allocate(max_tokens, hidden_size, ...)` they are copied into one preallocated
`[max_tokens, n * H]` buffer (stable addresses for CUDA graphs) and `stacked()` is a view.
The buffer takes states of its own width, dtype and device only (a copy would cast or move them,
which the default mode does not); `check_step` refuses a step it cannot take before any layer runs.
"""
from __future__ import annotations

from typing import Sequence

import torch

from m3_eagle_plugin._ints import as_int


def _check_state(what: str, hidden: torch.Tensor) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden of {what} must be a [T, H] tensor, got {type(hidden).__name__}")
    # Without a buffer a [T] or [1, T, H] state would be kept as is and misshape `stacked()`.
    if hidden.dim() != 2:
        raise ValueError(f"hidden of {what} must be [T, H] (tokens, hidden size), "
                         f"got shape {tuple(hidden.shape)}")


class AuxCapture:
    def __init__(self, layer_ids: Sequence[int]) -> None:
        ids = [as_int("aux layer id", i) for i in layer_ids]
        if not ids:
            raise ValueError("AuxCapture needs at least one layer id")
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"aux layer ids must be distinct and non-negative, got {ids}")
        self.layer_ids: tuple[int, ...] = tuple(ids)
        self._slot = {layer: n for n, layer in enumerate(ids)}
        self._records: dict[int, torch.Tensor] = {}
        self._recorded: set[int] = set()  # ids recorded since `reset` (the buffer keeps older steps' data)
        self._buffer: torch.Tensor | None = None
        self._num_tokens = 0

    @classmethod
    def from_output_layer_ids(cls, output_layer_ids: Sequence[int]) -> "AuxCapture":
        """Build from TensorRT-LLM style ids ("output of layer j" = input of layer j + 1)."""
        ids = [as_int("output layer id", j) for j in output_layer_ids]
        if any(j < 0 for j in ids):
            # TensorRT-LLM's -1 is the model's final hidden state, no layer's input; j + 1 = 0 read the embeddings
            raise ValueError(f"output layer ids must be non-negative, got {ids}; TensorRT-LLM's -1 (the final "
                             "hidden state) is not the input of a target layer, which is what AuxCapture records")
        return cls([j + 1 for j in ids])

    def allocate(self, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> "AuxCapture":
        max_tokens = as_int("max_tokens", max_tokens, 0)  # torch's own refusal named neither size
        hidden_size = as_int("hidden_size", hidden_size, 1)  # True made a buffer one column a layer
        buffer = torch.zeros(max_tokens, len(self.layer_ids) * hidden_size, dtype=dtype, device=device)
        self.reset()  # the new buffer holds no step: nothing may read as recorded in it
        self._buffer = buffer
        return self

    def wants(self, layer_id: int) -> bool:
        return layer_id in self._slot

    def reset(self) -> None:
        self._records.clear()
        self._recorded.clear()
        self._num_tokens = 0

    def check_step(self, hidden: torch.Tensor) -> None:
        """Refuse a step whose residual stream is like `hidden [T, H]` (its embeddings) where the
        buffer could not record it: call it before the first layer runs, so such a step fails before
        the layers ahead of the first aux layer wrote their KV. Records nothing; without a buffer it
        only checks the shape."""
        _check_state("the step", hidden)
        if self._buffer is not None:
            self._check_fits(hidden, "the step's", "for the step")

    def _check_fits(self, hidden: torch.Tensor, whose: str, where: str) -> None:
        t, h = hidden.shape
        buffer = self._buffer
        width = buffer.shape[1] // len(self.layer_ids)  # the hidden size given to `allocate`
        if h != width:
            raise ValueError(f"{whose} state is {h} wide, the capture buffer was allocated for hidden size {width}")
        if t > buffer.shape[0]:
            raise ValueError(f"capture buffer {tuple(buffer.shape)} too small for [{t}, {h}] {where}")
        # the copy would cast (or move) the state, where the default mode keeps it as the layer made it
        if hidden.dtype != buffer.dtype or hidden.device != buffer.device:
            raise ValueError(f"{whose} state is {hidden.dtype} on {hidden.device}, the capture buffer was allocated "
                             f"as {buffer.dtype} on {buffer.device}: allocate it in the target's dtype and device")

    def record(self, layer_id: int, hidden: torch.Tensor) -> None:
        """Store `hidden [T, H]`, the residual stream entering `layer_id`."""
        slot = self._slot.get(layer_id)
        if slot is None:
            return
        _check_state(f"layer {layer_id}", hidden)
        if self._buffer is None:
            earlier = next(iter(self._records.values()), None)
            if earlier is not None and hidden.shape[0] != earlier.shape[0]:
                raise ValueError(f"layer {layer_id} recorded {hidden.shape[0]} tokens, earlier layers of this step "
                                 f"{earlier.shape[0]}")
            self._records[layer_id] = hidden
            return
        self._check_fits(hidden, f"layer {layer_id}", f"at layer {layer_id}")
        t, h = hidden.shape
        if self._recorded and t != self._num_tokens:
            raise ValueError(f"layer {layer_id} recorded {t} tokens, earlier layers of this step {self._num_tokens}")
        self._buffer[:t, slot * h:(slot + 1) * h].copy_(hidden)
        self._recorded.add(layer_id)
        self._num_tokens = t

    def get(self, layer_id: int) -> torch.Tensor:
        if layer_id not in self._slot:
            raise KeyError(f"layer {layer_id} is not captured (ids {self.layer_ids})")
        if layer_id not in (self._records if self._buffer is None else self._recorded):
            raise RuntimeError(f"layer {layer_id} was not recorded in this step")
        if self._buffer is None:
            return self._records[layer_id]
        h = self._buffer.shape[1] // len(self.layer_ids)
        slot = self._slot[layer_id]
        return self._buffer[:self._num_tokens, slot * h:(slot + 1) * h]

    def stacked(self) -> torch.Tensor:
        """`[T, n * H]`, chunks in the order of `layer_ids`."""
        recorded = self._records if self._buffer is None else self._recorded
        missing = [i for i in self.layer_ids if i not in recorded]
        if missing:
            raise RuntimeError(f"aux layers {missing} were not recorded; did the target forward run with this capture?")
        if self._buffer is not None:
            return self._buffer[:self._num_tokens]
        return torch.cat([self._records[i] for i in self.layer_ids], dim=-1)
