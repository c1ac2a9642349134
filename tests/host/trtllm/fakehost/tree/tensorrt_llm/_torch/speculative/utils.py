def get_num_spec_layers(spec_config):
    if spec_config.spec_dec_mode.is_eagle3_one_model():
        layers = getattr(spec_config, "_num_draft_hidden_layers", None)
        return 1 if layers is None else layers
    return 0


class _Worker:
    def __init__(self, spec_config, use_separate_draft_kv_cache):
        self.spec_config = spec_config
        self.use_separate_draft_kv_cache = use_separate_draft_kv_cache


def get_spec_worker(spec_config, model_config, mapping, use_separate_draft_kv_cache=False):
    return _Worker(spec_config, use_separate_draft_kv_cache)
