from .interface import SpecMetadata, SpeculativeDecodingMode, should_use_separate_draft_kv_cache
from .utils import get_num_spec_layers, get_spec_worker

__all__ = ["SpecMetadata", "SpeculativeDecodingMode", "get_num_spec_layers", "get_spec_worker",
           "should_use_separate_draft_kv_cache"]
