"""MiniMax-M3 as a one-model Eagle3 target on TensorRT-LLM (`SpecDecOneEngineForCausalLM`).

Imported only once TensorRT-LLM is present; registered for the two MiniMax-M3 architectures by
`registration.py`. Before NVIDIA/TensorRT-LLM#18872 the host's M3 class derives from
`DecoderModelForCausalLM` (no draft model, no spec worker) and its layers never capture Eagle3
hidden states. This class reuses the host's `MiniMaxM3Model` and weight loading unchanged and:
- derives from `SpecDecOneEngineForCausalLM` (draft model, spec worker, draft-weight loading);
- captures the Eagle3 auxiliary hidden states with forward hooks at each decoder layer's exit
  (`spec_metadata.maybe_capture_hidden_states(layer, hidden_states, residual)`), so the host's
  layer code needs no `spec_metadata` parameter. Once `setup_aliases` has wired a layer's
  `next_layer_layernorm`, the layer exits through the next layer's add+RMSNorm (fused with the
  AllReduce under TP) and returns `(rmsnorm(out + residual), out + residual)`; the raw output
  `out + residual` (what the post-#18872 host captures before that norm) is then the residual;
- runs both `setup_aliases` (the host M3 override does not chain to the Eagle3 one);
- marks its speculative config for the unified draft/target KV policy.

The host M3 class comes first in the MRO, ahead of the Eagle3 base, as in the host after #18872:
its `load_weights` (index-QK fusion, norm folding, weight mapper) runs, then hands on to the
Eagle3 base's, which adds `skip_modules=["draft_model"]` for the generic loader (the host M3
method takes no `skip_modules`, so the other order fails), and `isinstance` checks against the
host class still hold. A VL config becomes its text config here, before any host constructor
runs (the pre-#18872 one is bypassed; the later one would convert it itself, into a deep copy
whose speculative config would miss the unified-KV mark).
"""
from __future__ import annotations

from typing import Any, Optional

from m3_eagle_plugin.host.trtllm.contract import resolve
from m3_eagle_plugin.host.trtllm.scope import mark_unified_draft_kv

SpecDecOneEngineForCausalLM = resolve("spec_one_engine_base")
HostMiniMaxM3Model = resolve("m3_model")
HostMiniMaxM3ForCausalLM = resolve("m3_causal_lm")
is_minimax_m3_vl_config = resolve("m3_is_vl_config")
get_text_model_config = resolve("m3_text_model_config")


class Eagle3CaptureHooks:
    """Forward hooks that hand each decoder layer's exit state to the step's spec metadata."""

    def __init__(self, layers: Any) -> None:
        self.spec_metadata: Optional[Any] = None
        self._handles = [layer.register_forward_hook(self._hook(self._layer_id(i, layer)))
                         for i, layer in enumerate(layers)]

    @staticmethod
    def _layer_id(index: int, layer: Any) -> int:
        layer_idx = getattr(layer, "layer_idx", None)
        return layer_idx if isinstance(layer_idx, int) else index

    def _hook(self, layer_id: int):
        # The layer comes in as the hook's first argument: a closure holding it would make a
        # layer -> hook -> layer cycle that keeps every layer's weights alive after the model is
        # dropped, until the cyclic garbage collector happens to run.
        def capture(layer: Any, _inputs: Any, output: Any) -> None:
            spec = self.spec_metadata
            if spec is None or not spec.is_layer_capture(layer_id):
                return
            hidden, residual = output if isinstance(output, tuple) else (output, None)
            if getattr(layer, "next_layer_layernorm", None) is not None and residual is not None:
                # Once setup_aliases wired the boundary norm, the layer returns
                # (rmsnorm(out + residual), out + residual): the raw output is the residual.
                hidden, residual = residual, None
            spec.maybe_capture_hidden_states(layer_id, hidden, residual)

        return capture

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# A host that already ships NVIDIA/TensorRT-LLM#18872 (only reached when activation is forced)
# has an Eagle3-capable M3 class whose layers capture by themselves: it is built by its own
# constructor. The bases below give that host the same MRO as the M3 class alone.
HOST_M3_IS_EAGLE3 = issubclass(HostMiniMaxM3ForCausalLM, SpecDecOneEngineForCausalLM)


class MiniMaxM3Eagle3ForCausalLM(HostMiniMaxM3ForCausalLM, SpecDecOneEngineForCausalLM):
    """MiniMax-M3 text model as a one-model Eagle3 target."""

    def __init__(self, model_config: Any) -> None:
        mark_unified_draft_kv(getattr(model_config, "spec_config", None))
        if is_minimax_m3_vl_config(model_config.pretrained_config):  # here, not in the host's constructor:
            model_config = get_text_model_config(model_config)  # a deep copy, whose spec config needs the mark too
            mark_unified_draft_kv(getattr(model_config, "spec_config", None))
        if HOST_M3_IS_EAGLE3:
            HostMiniMaxM3ForCausalLM.__init__(self, model_config)
            self.eagle3_capture = Eagle3CaptureHooks([])
        else:
            # model_config already holds the text config, whose hidden_size / vocab_size the base
            # reads itself; hosts before the VLM-wrapper change take no such keywords
            # (`__init__(self, model, model_config)`), so none are passed.
            SpecDecOneEngineForCausalLM.__init__(self, HostMiniMaxM3Model(model_config), model_config)
            self.eagle3_capture = Eagle3CaptureHooks(self.model.layers)

    def forward(self, attn_metadata: Any, input_ids: Any = None, position_ids: Any = None,
                inputs_embeds: Any = None, return_context_logits: bool = False,
                spec_metadata: Any = None, resource_manager: Any = None, **kwargs: Any) -> Any:
        self.eagle3_capture.spec_metadata = spec_metadata
        try:
            return super().forward(attn_metadata, input_ids=input_ids, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds,
                                   return_context_logits=return_context_logits,
                                   spec_metadata=spec_metadata, resource_manager=resource_manager,
                                   **kwargs)
        finally:
            self.eagle3_capture.spec_metadata = None

    def setup_aliases(self) -> None:
        HostMiniMaxM3ForCausalLM.setup_aliases(self)
        SpecDecOneEngineForCausalLM.setup_aliases(self)


_VL_PREFIX = "language_model."
# The host's VL split (`_VL_PREFIXES`): the tower, its projector and the patch merger the checkpoint
# stores at the top level; then the MTP block it drops.
_VL_DROPPED = ("vision_tower.", "vision_model.", "visual.", "multi_modal_projector.", "patch_merge_mlp.",
               "model.mtp.")


class MiniMaxM3VLEagle3ForConditionalGeneration(MiniMaxM3Eagle3ForCausalLM):
    """The VL checkpoint served text-only: language-model weights are loaded, the vision tower is not.

    `load_weights` names the host VL method's parameters: the host's loader passes `weight_mapper`
    and `allow_partial_loading` only to a method whose signature names them
    (`ModelLoader._call_load_weights` reads `inspect.getfullargspec(...).args`).
    """

    def load_weights(self, weights: dict, weight_mapper: Any = None, params_map: Optional[dict] = None,
                     allow_partial_loading: bool = False) -> None:
        text = {}
        for name, tensor in weights.items():
            name = name[len(_VL_PREFIX):] if name.startswith(_VL_PREFIX) else name
            if not name.startswith(_VL_DROPPED):
                text[name] = tensor
        super().load_weights(text, weight_mapper=weight_mapper, params_map=params_map,
                             allow_partial_loading=allow_partial_loading)
