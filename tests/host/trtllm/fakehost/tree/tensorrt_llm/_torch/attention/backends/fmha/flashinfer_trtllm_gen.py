"""Double of the trtllm-gen FMHA gate: the page-size allowlist is the last check. As in the host, the
page size is the metadata's `tokens_per_block` (a property that reads the KV manager's)."""
from typing import Tuple


class FlashInferTrtllmGenFmha:
    MIN_TOKENS_PER_BLOCK = 8
    SUPPORTED_TOKENS_PER_BLOCK = {16, 32, 64}
    MAX_HEADS_RATIO_GENERATION = 32

    def __init__(self, attn) -> None:
        self.attn = attn

    def is_supported(self, q, k, v, metadata, forward_args) -> bool:
        return self._is_supported_with_reason(q, k, v, self.attn, metadata, forward_args)[0]

    def _is_supported_with_reason(self, q, k, v, attn, meta, fwd) -> Tuple[bool, str]:
        if getattr(attn, "sparse_params", None) is not None:
            return False, "sparse attention is not supported"
        if attn.num_heads // attn.num_kv_heads > self.MAX_HEADS_RATIO_GENERATION:
            return False, "heads ratio too large"
        tokens_per_block = meta.tokens_per_block
        if tokens_per_block is None:
            tokens_per_block = 0
        if tokens_per_block <= 0:
            return False, f"non-positive tokens_per_block ({tokens_per_block})."
        if tokens_per_block & (tokens_per_block - 1) != 0:
            return False, f"tokens_per_block ({tokens_per_block}) must be power of 2."
        if tokens_per_block not in self.SUPPORTED_TOKENS_PER_BLOCK:
            return False, f"tokens_per_block ({tokens_per_block}) is not supported by trtllm-gen kernels."
        return True, ""
