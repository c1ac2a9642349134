"""Where the shared one-model draft layers sit in the cache's layer range.

With one-model Eagle3 the draft head's layer(s) share the target's KV cache: the cache manager
appends them after the target layers. The creation site is ambiguous about ``num_layers``
(the target count, or the already extended total) and may pass a per-layer KV-head list that
already includes the draft tail; these helpers resolve that the same way the host does.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from m3_eagle_plugin._ints import as_int, exact_index


def derive_shared_draft_layout(
    num_layers: Optional[int],
    num_kv_heads: Union[int, Sequence[int]],
    num_draft_layers: int,
) -> tuple[list[int], Optional[int]]:
    """Locate the appended draft layers: ``(draft_layer_ids, num_target_layers)``.

    - scalar ``num_kv_heads``: ``num_layers`` is the target count, the draft tail is appended;
    - a per-layer head list already includes the draft tail, so its length pins the total
      (a larger ``num_layers`` means it was already extended, and wins);
    - ``num_layers=None`` with scalar heads pins nothing: ``([], None)``.
    """
    num_draft = as_int("num_draft_layers", num_draft_layers)
    if num_draft < 0:
        raise ValueError(f"num_draft_layers must be >= 0, got {num_draft}")
    if num_layers is not None:
        num_layers = as_int("num_layers", num_layers)
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")

    # A numpy array or a tensor of per-layer heads must not pass for a scalar: read as "append the
    # draft tail" it gave a layout shifted by the extra entries.
    per_layer = isinstance(num_kv_heads, Sequence) and not isinstance(num_kv_heads, (str, bytes))
    if not per_layer and exact_index(num_kv_heads) is None:  # named as both forms it may take
        raise TypeError(f"num_kv_heads must be an int or a list of per-layer ints, got "
                        f"{type(num_kv_heads).__name__} {num_kv_heads!r}")
    if per_layer:
        total = len(num_kv_heads)
        if num_layers is not None:
            total = max(total, num_layers)
    else:
        if num_layers is None:
            return [], None
        total = num_layers + num_draft

    num_target = total - num_draft
    if num_target < 0:
        raise ValueError(
            f"{num_draft} draft layers do not fit in a layer range of {total} "
            f"(num_layers={num_layers}, num_kv_heads={num_kv_heads!r})"
        )
    return list(range(num_target, total)), num_target


def num_spec_layers(spec_config: Any) -> int:
    """Draft layers a one-model speculative config appends (0 when it appends none)."""
    if getattr(spec_config, "_use_shared_kv_cache", False):
        return 0
    mode = getattr(spec_config, "spec_dec_mode", None)
    if mode is None:
        raise TypeError(f"spec_config has no spec_dec_mode: {spec_config!r}")

    def is_(name: str) -> bool:
        probe = getattr(mode, name, None)
        return bool(probe()) if callable(probe) else False

    if is_("is_mtp_eagle_one_model"):
        return 1
    if is_("is_mtp_vanilla"):
        return as_int("num_nextn_predict_layers", spec_config.num_nextn_predict_layers, minimum=0)
    if is_("is_eagle3_one_model"):
        layers = getattr(spec_config, "_num_draft_hidden_layers", None)
        return 1 if layers is None else as_int("_num_draft_hidden_layers", layers, minimum=0)
    return 0


def shared_draft_layer_count(spec_config: Any, layer_mask: Any) -> int:
    """How many draft layers the base manager appends to this (target) cache.

    Only with a speculative config and no ``layer_mask``: a separate draft cache always
    passes a mask, and then the target cache carries no draft layers.
    """
    if spec_config is None or layer_mask is not None:
        return 0
    return num_spec_layers(spec_config)
