"""The adapter's built-in host patches, one per file (see each file's Why/How/Upstream header)."""
from __future__ import annotations

from m3_eagle_plugin.host.trtllm.patching import Patch


def builtin_patches() -> list[Patch]:
    """Every built-in patch, in application order (several `Patch`es may share one id)."""
    from m3_eagle_plugin.host.trtllm.patches import (
        route_msa_backend,
        route_sparse_kv_cache_manager,
        trtllm_gen_page_size_opt_in,
        unified_draft_kv_policy,
    )

    return [
        *route_sparse_kv_cache_manager.PATCHES,
        *route_msa_backend.PATCHES,
        *unified_draft_kv_policy.PATCHES,
        *trtllm_gen_page_size_opt_in.PATCHES,
    ]
