from typing import Dict, Generic, Optional

from ..speculative import get_spec_worker, should_use_separate_draft_kv_cache
from .modeling_utils import DecoderModelForCausalLM, TConfig, TModel


class SpecDecOneEngineForCausalLM(DecoderModelForCausalLM[TModel, TConfig], Generic[TModel, TConfig]):
    def __init__(self, model: TModel, model_config, hidden_size: int | None = None,
                 vocab_size: int | None = None) -> None:
        cfg = model_config.pretrained_config
        super().__init__(model, config=model_config, hidden_size=hidden_size or cfg.hidden_size,
                         vocab_size=vocab_size or cfg.vocab_size)
        self.draft_model = None
        self.spec_worker = None
        self.use_separate_draft_kv_cache = False
        spec_config = getattr(model_config, "spec_config", None)
        if spec_config is not None and spec_config.spec_dec_mode.use_one_engine():
            self.use_separate_draft_kv_cache = should_use_separate_draft_kv_cache(spec_config)
            self.spec_worker = get_spec_worker(spec_config, model_config, None,
                                               use_separate_draft_kv_cache=self.use_separate_draft_kv_cache)
        self.aliases_set_up = False

    def setup_aliases(self) -> None:
        self.aliases_set_up = True

    def forward(self, attn_metadata, input_ids=None, position_ids=None, inputs_embeds=None,
                return_context_logits=False, spec_metadata=None, resource_manager=None, **kwargs):
        hidden = self.model(attn_metadata=attn_metadata, input_ids=input_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds,
                            spec_metadata=spec_metadata, **kwargs)
        return self.lm_head(hidden)

    def load_weights(self, weights: Dict, weight_mapper=None, params_map: Optional[Dict[str, str]] = None,
                     allow_partial_loading: bool = False):
        super().load_weights(weights=weights, weight_mapper=weight_mapper, skip_modules=["draft_model"],
                             params_map=params_map, allow_partial_loading=allow_partial_loading)
