"""The MiniMax-M3 KV-cache manager with the Eagle3 draft layer inside the target's pools.

Imported only once TensorRT-LLM is present (the route patch returns this class for MiniMax-M3).
It subclasses the host's `MiniMaxM3KVCacheManagerV2` and adds what one-model Eagle3 needs:
the draft layer(s) appended after the target layers are reached through one *virtual*
attention-op pool each (the M3 mega-slot is not on a uniform per-layer stride; a host whose
manager already keeps a page table per layer, TensorRT-LLM's own shared draft layers, gets
none), the block-offset copy that feeds those pools, the trtllm-gen P128 opt-in, and a refusal
of tree acceptance (the mega-slot cannot relocate KV). All table arithmetic is `m3_eagle_plugin.kv`'s.

Setup refuses two layouts where a draft layer would read pages it does not own: a draft-layer
count that differs from the one the host's base manager appends (its `get_num_spec_layers`,
whose rule changed across host versions), and an NVFP4 cache where virtual draft pools are added
(its pool pointers pair data with block scales; a virtual draft pool has no block-scale root).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterable, List, Optional

import torch

from m3_eagle_plugin import kv as core_kv
from m3_eagle_plugin.host.trtllm.contract import resolve

HostMiniMaxM3KVCacheManagerV2 = resolve("m3_kv_manager")

TRTLLM_GEN_OPT_IN_PAGE_SIZE = 128


def _pinned_like(new: torch.Tensor, old: Any) -> torch.Tensor:
    if isinstance(old, torch.Tensor) and old.device.type == "cpu" and old.is_pinned():
        return new.pin_memory()
    return new


def _host_name(name: str, required: bool = True) -> Any:
    """A name the host's M3 manager module (or its V2 base module) imported, e.g. `Role`."""
    for cls in (HostMiniMaxM3KVCacheManagerV2, HostMiniMaxM3KVCacheManagerV2.__mro__[1]):
        value = getattr(sys.modules[cls.__module__], name, None)
        if value is not None:
            return value
    if required:
        raise LookupError(f"the host KV-cache modules bind no {name!r}")
    return None


def _check_draft_layer_count(spec_config: Any, layer_mask: Any, reserved: int) -> None:
    """The base manager appends the host's `get_num_spec_layers(spec_config)` draft layers after the
    target's (`get_pp_layers`); the shared draft layout must reserve (give a virtual pool to)
    exactly that many. A layer the layout missed keeps the base's uniform-stride mapping into the
    mega-slot and silently reads another layer's pages; one it reserved in excess is a target layer."""
    if spec_config is None or layer_mask is not None:
        return
    appended = int(resolve("spec_layer_count")(spec_config))
    if appended != reserved:
        raise ValueError(
            f"spec_config gives the KV cache {appended} Eagle3 draft layer(s) (the host's "
            f"get_num_spec_layers) but the shared draft layout reserves {reserved} "
            "(m3_eagle_plugin.kv.shared_draft_layer_count); the draft layers would address the "
            "wrong pages. The two must agree (the layout counts spec_config._num_draft_hidden_layers, "
            "default 1)")


def _requests(scheduled_batch: Any) -> Iterable[Any]:
    all_requests = getattr(scheduled_batch, "all_requests", None)
    if callable(all_requests):
        return all_requests()
    return [*getattr(scheduled_batch, "context_requests", ()),
            *getattr(scheduled_batch, "generation_requests", ())]


class M3EagleKVCacheManagerV2(HostMiniMaxM3KVCacheManagerV2):
    """`MiniMaxM3KVCacheManagerV2` plus shared Eagle3 draft layers on virtual attention-op pools."""

    supports_shared_draft_layers = True
    trtllm_gen_extra_tokens_per_block: frozenset = frozenset()

    def __init__(self, *args: Any, sparse_layer_ids: Any = None, **kwargs: Any) -> None:
        num_layers = kwargs.get("num_layers")
        num_draft = core_kv.shared_draft_layer_count(kwargs.get("spec_config"), kwargs.get("layer_mask"))
        _check_draft_layer_count(kwargs.get("spec_config"), kwargs.get("layer_mask"), num_draft)
        draft_ids, num_target = core_kv.derive_shared_draft_layout(
            num_layers, kwargs.get("num_kv_heads", 1), num_draft)
        if sparse_layer_ids is None and num_target is not None and num_layers is not None \
                and int(num_layers) != num_target:
            # num_layers already counts the draft tail: keep the host's dense-prefix convention
            # but stop the sparse range at the last target layer.
            sparse_layer_ids = list(range(self._NUM_DENSE_PREFIX_LAYERS, num_target))
        # Set before the base constructor: it builds the page tables (and calls our override).
        self.shared_draft_layer_ids: tuple[int, ...] = tuple(draft_ids)
        self.num_target_layers: Optional[int] = num_target
        self.max_draft_len: int = int(getattr(kwargs.get("spec_config"), "max_draft_len", 0) or 0)
        self.virtual_pools: Optional[core_kv.VirtualPools] = None
        self._draft_op_pools: tuple[tuple[int, int], ...] = ()
        super().__init__(*args, sparse_layer_ids=sparse_layer_ids, **kwargs)

    _NUM_DENSE_PREFIX_LAYERS = 3  # MiniMax-M3: layers 0-2 use dense attention

    # ----- page tables ---------------------------------------------------------------------
    def _prepare_page_table_tensor(self, index_mapper_capacity: int) -> None:
        super()._prepare_page_table_tensor(index_mapper_capacity)
        self._add_virtual_draft_pools()

    def _add_virtual_draft_pools(self) -> None:
        if getattr(self, "is_draft", False) or not self.shared_draft_layer_ids:
            return
        # before the early returns below: under SWA scratch reuse the V2 base itself builds a
        # pointer per layer (more rows than pools), which would pass for a host's own draft pools
        if getattr(self, "enable_swa_scratch_reuse", False):
            raise NotImplementedError(
                "MiniMax-M3 shared draft layers cannot be combined with SWA scratch reuse")
        if getattr(self, "_use_per_layer_page_tables", False):  # hosts with #18872: a pool per layer already
            return
        num_pools = getattr(self, "num_pools", None)
        if isinstance(num_pools, int) and self.kv_cache_pool_pointers.shape[0] > num_pools:
            # the host's own manager (#18872, activation forced) already appended the draft layers'
            # op pools and fills them itself; a second set would leave the draft layers on pools
            # whose source is one of those op pools, which no block-offset copy ever fills
            return
        layer_offsets = getattr(self, "layer_offsets", None)
        draft_layers = [self._draft_layer_entry(layer) for layer in self.shared_draft_layer_ids
                        if layer_offsets is None or layer in layer_offsets]
        if not draft_layers:  # pipeline ranks that do not own the draft tail
            return
        if self.kv_cache_pool_pointers.dim() == 3:
            raise NotImplementedError(
                "MiniMax-M3 shared draft layers cannot use an NVFP4 KV cache: its pool pointers pair "
                "data with block scales, and a virtual draft pool has no block-scale root (the draft "
                "layer would read its scales from address 0); use an FP8 or BF16 KV cache")
        pools = core_kv.extend_attention_op_pools(
            self.kv_cache_pool_pointers, self.kv_cache_pool_mapping, draft_layers)
        # the host's device copy reads index_scales / kv_offsets inside its kernel, so they are
        # pinned whenever the host's own tables are (a pageable pointer is not device-addressable)
        host_pointers = self.kv_cache_pool_pointers
        pools = dataclasses.replace(
            pools, pool_pointers=_pinned_like(pools.pool_pointers, host_pointers),
            pool_mapping=_pinned_like(pools.pool_mapping, self.kv_cache_pool_mapping),
            index_scales=_pinned_like(pools.index_scales, host_pointers),
            kv_offsets=_pinned_like(pools.kv_offsets, host_pointers))
        self.kv_cache_pool_pointers = pools.pool_pointers
        self.kv_cache_pool_mapping = pools.pool_mapping
        self.num_attention_op_pools = pools.num_op_pools
        self.virtual_pools = pools
        self._draft_op_pools = tuple(pools.op_pools)
        if getattr(self, "tokens_per_block", None) == TRTLLM_GEN_OPT_IN_PAGE_SIZE:
            self.trtllm_gen_extra_tokens_per_block = frozenset({TRTLLM_GEN_OPT_IN_PAGE_SIZE})

    def _draft_layer_entry(self, global_layer: int) -> tuple[int, int, int]:
        """(local layer, K page base address, sub-pages per slot) of a draft layer.

        The address must be this layer's own K page in slot 0 (pool base plus the layer's offset
        in the mega-slot): the virtual pool's block offsets are `slot * sub_pages` (+1 for V) and
        carry no layer offset. In the host's V2 storage that is `PageIndexMode.SHARED`, and the
        two-argument call (`index_mode=None`, as upstream's own `_kv_slot_geometry` makes it)
        means SHARED too; it only differs by raising when SWA scratch reuse is on, which
        `_add_virtual_draft_pools` refuses before this runs. `PER_LAYER` would be wrong here: it
        returns the pool-group base without the layer offset (for page tables whose indices add
        the offset), i.e. the first layer's pages. Storage that predates `PageIndexMode` takes
        (layer, role) and already returns the per-layer address.
        """
        layer_offsets = getattr(self, "layer_offsets", None)
        local = layer_offsets[global_layer] if layer_offsets is not None else global_layer
        role = _host_name("Role")
        index_mode = _host_name("PageIndexMode", required=False)
        if index_mode is None:  # older V2 storage: (layer, role)
            address = self.impl.get_mem_pool_base_address(local, role.KEY)
        else:
            address = self.impl.get_mem_pool_base_address(local, role.KEY, index_mode.SHARED)
        sub_pages = int(self.impl.get_page_index_converter(local, role.KEY).scale)
        return local, int(address), sub_pages

    # ----- per-step block offsets ----------------------------------------------------------
    def copy_batch_block_offsets(self, dst_tensor: torch.Tensor, request_ids: List[int],
                                 beam_width: int, num_contexts: int, num_seqs: int,
                                 max_blocks: Optional[int] = None) -> None:
        pools = self.virtual_pools
        last = max((p for p, _ in pools.op_pools), default=-1) if pools is not None else -1
        if dst_tensor.shape[0] <= last:
            # a host that sizes the table by num_pools (not num_attention_op_pools) has no row for the
            # draft layer's op pool: the native copy would get an empty slice and the op read past it
            raise RuntimeError(
                f"the block-offset table has {dst_tensor.shape[0]} pool rows but the draft layer reads "
                f"attention-op pool {last}: this host sizes it by num_pools, not "
                f"num_attention_op_pools ({self.num_attention_op_pools}); the shared draft layer needs a host "
                "that reads num_attention_op_pools")
        if max_blocks is None:
            super().copy_batch_block_offsets(dst_tensor, request_ids, beam_width, num_contexts, num_seqs)
        else:
            super().copy_batch_block_offsets(dst_tensor, request_ids, beam_width, num_contexts,
                                             num_seqs, max_blocks=max_blocks)
        if pools is None or not pools.op_pools:
            return
        device_copy = resolve("device_block_offset_copy")
        copy_index = self.index_mapper.get_copy_index(request_ids, num_contexts, beam_width)
        stream = self._stream.cuda_stream
        for i, (op_pool, source) in enumerate(pools.op_pools):
            # The host's device copy writes K = slot * scale and V = K + kv_offset per pool row.
            device_copy(self.host_kv_cache_block_offsets[source: source + 1],
                        dst_tensor[op_pool: op_pool + 1], copy_index,
                        pools.index_scales[i: i + 1], pools.kv_offsets[i: i + 1], stream)

    # ----- acceptance ----------------------------------------------------------------------
    def update_resources(self, scheduled_batch: Any, *args: Any, **kwargs: Any) -> Any:
        for request in _requests(scheduled_batch):
            if getattr(request, "py_num_accepted_draft_tokens_indices", None):
                raise NotImplementedError(
                    "tree speculative acceptance relocates KV, which the MiniMax-M3 mega-slot "
                    f"cannot do (request {getattr(request, 'py_request_id', '?')}); use linear Eagle3")
        return super().update_resources(scheduled_batch, *args, **kwargs)
