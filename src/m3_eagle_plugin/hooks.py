"""The pluggy hook specifications through which hosts discover the plugin's components.

A host (the TensorRT-LLM adapter or the embedded reference host) never imports a component
directly: it asks the plugin manager, and the built-in implementation (`m3_eagle_plugin.builtin`)
is only one plugin among possible others (entry-point group `m3_eagle_plugin`). Components are
named lazily as "module:qualname" strings so that discovery imports no torch and no host code.
The docstrings below are the contract for third-party implementations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import pluggy

from m3_eagle_plugin._ints import as_int

PROJECT_NAME = "m3_eagle_plugin"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees for one speculative step.

    `request_ids[i]` owns `tokens[i]`, the prompt followed by every token generated so far;
    `draft_len` is how many draft tokens each request wants this step.
    """

    request_ids: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    draft_len: int

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.tokens):
            raise ValueError(
                f"DraftContext: {len(self.request_ids)} request_ids but {len(self.tokens)} token sequences"
            )
        # a string or float compared with 0 failed with a bare TypeError; refused by name, as `build` does
        if as_int("DraftContext: draft_len", self.draft_len) < 0:
            raise ValueError(f"DraftContext: draft_len must be >= 0, got {self.draft_len}")

    @classmethod
    def build(cls, request_ids: Sequence[int], tokens: Sequence[Sequence[int]], draft_len: int) -> "DraftContext":
        """Freeze plain lists into a context (convenience for hosts); a float, bool or string id or
        length is refused by name (`_ints.as_int`), not truncated."""
        return cls(_int_tuple("request id", request_ids), tuple(_int_tuple("token id", seq) for seq in tokens),
                   as_int("draft_len", draft_len))


def _int_tuple(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(values)
    if all(type(v) is int for v in values):  # the hosts' case, a sequence of plain ints: no call per entry
        return values
    return tuple(as_int(name, v) for v in values)


class M3EagleSpecs:
    """Hook specifications (project name "m3_eagle_plugin")."""

    @hookspec
    def m3_eagle_model_classes(self, host: str) -> dict[str, str]:
        """Map HF architecture names to the model class the host should build, as "module:qualname".

        Every implementation's mapping is collected; the registry rejects two plugins claiming one
        architecture with different classes (a conflict), the built-in plugin's architectures
        included: a plugin adds architectures, it does not replace built-in ones. `host` is
        "tensorrt_llm" or "reference".

        Example::

            @hookimpl
            def m3_eagle_model_classes(host):
                return {"MyM3VariantForCausalLM": "my_pkg.model:MyM3VariantForCausalLM"}
        """

    @hookspec(firstresult=True)
    def m3_eagle_kv_cache_manager(self, host: str, sparse_config: Any) -> str | None:
        """Pick the KV cache manager class ("module:qualname") for a sparse-attention config.

        `sparse_config` is the host's sparse-attention config object (TensorRT-LLM's, with an `algorithm`
        attribute), or None; activation and `status()` ask with a probe that reads both as such an object
        and as a mapping. Return None when the config is not yours (e.g. not MiniMax-M3); the first
        non-None answer wins.

        Example::

            @hookimpl
            def m3_eagle_kv_cache_manager(host, sparse_config):
                if getattr(sparse_config, "algorithm", None) != "minimax_m3":
                    return None
                return "my_pkg.kv:MyManager"
        """

    @hookspec(firstresult=True)
    def m3_eagle_attention_metadata(self, host: str) -> str | None:
        """Pick the MSA multi-token decode metadata class ("module:qualname"); first non-None wins.

        On "tensorrt_llm" the class must derive from the host's `MiniMaxM3MsaSparseAttentionMetadata`
        (the built-in one, `m3_eagle_plugin.host.trtllm.msa_backend:M3EagleMsaMetadata`, is a good
        base): the adapter serves it as the `Metadata` of the MSA backend it routes MiniMax-M3 to.

        Example::

            @hookimpl
            def m3_eagle_attention_metadata(host):
                if host != "tensorrt_llm":
                    return None
                return "my_pkg.msa:MyMsaMetadata"
        """

    @hookspec
    def m3_eagle_host_patches(self, host: str) -> list[Any]:
        """Return the patch objects to apply to `host`; all implementations' lists are concatenated.

        Import patch modules lazily inside the implementation so that discovery stays cheap.

        Example::

            @hookimpl
            def m3_eagle_host_patches(host):
                if host != "tensorrt_llm":
                    return []
                from my_pkg.patches import my_patch
                return [my_patch()]
        """

    @hookspec(firstresult=True)
    def m3_eagle_propose_drafts(self, context: DraftContext) -> list[list[int]] | None:
        """Propose draft tokens: one list of `context.draft_len` token ids per request, in order.

        Return None to let the Eagle3 head draft (the default). The first non-None answer wins.

        Example (an n-gram drafter that repeats the last token)::

            @hookimpl
            def m3_eagle_propose_drafts(context):
                return [[seq[-1]] * context.draft_len for seq in context.tokens]
        """

    @hookspec(historic=True)
    def m3_eagle_host_ready(self, host: str, report: Any) -> None:
        """Called once the plugin is active on `host`, with the activation report.

        Historic: a plugin registered later is called at registration with the same arguments.

        Example::

            @hookimpl
            def m3_eagle_host_ready(host, report):
                print(f"m3-eagle active on {host}: {report['patches']}")
        """
