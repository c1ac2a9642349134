"""A host double of TensorRT-LLM for the adapter's tests (never shipped, never imported by the plugin).

`tree/tensorrt_llm` is the post-refactor layout (`_torch/attention/backends`, sparse dispatch in
`sparse/registry.py`, `pyexecutor/kv_cache/kv_cache_manager_v2.py`). `build_fake_host(dest,
layout)` materialises it, or its pre-refactor twin (`_torch/attention_backend`, `sparse/utils.py`,
`pyexecutor/kv_cache_manager_v2.py`) derived by moving those files and rewriting the imports.
The module contents model a host *before* NVIDIA/TensorRT-LLM#18872.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

TREE = Path(__file__).parent / "tree"
CURRENT = "attention/backends"
LEGACY = "attention_backend"
LAYOUTS = (CURRENT, LEGACY)

_LEGACY_MOVES = {
    "tensorrt_llm/_torch/attention/backends": "tensorrt_llm/_torch/attention_backend",
    "tensorrt_llm/_torch/attention_backend/sparse/registry.py":
        "tensorrt_llm/_torch/attention_backend/sparse/utils.py",
    "tensorrt_llm/_torch/pyexecutor/kv_cache/kv_cache_manager_v2.py":
        "tensorrt_llm/_torch/pyexecutor/kv_cache_manager_v2.py",
}
_LEGACY_REWRITES = (
    ("attention.backends", "attention_backend"),
    ("from .registry import", "from .utils import"),
    ("pyexecutor.kv_cache.kv_cache_manager_v2", "pyexecutor.kv_cache_manager_v2"),
)


def build_fake_host(dest: Path, layout: str = CURRENT) -> Path:
    """Write the double's `tensorrt_llm` package under `dest` (returned, for sys.path)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    dest = Path(dest)
    shutil.copytree(TREE, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if layout == LEGACY:
        for old, new in _LEGACY_MOVES.items():
            shutil.move(str(dest / old), str(dest / new))
        shutil.rmtree(dest / "tensorrt_llm/_torch/attention")
        shutil.rmtree(dest / "tensorrt_llm/_torch/pyexecutor/kv_cache")
        for path in dest.rglob("*.py"):
            text = path.read_text()
            for before, after in _LEGACY_REWRITES:
                text = text.replace(before, after)
            path.write_text(text)
    return dest


#: Adapter modules that bind host classes at import time, so they go with the host.
ADAPTER_COMPONENTS = ("model", "cache_manager", "msa_backend", "registration")


def purge_host_modules() -> None:
    """Forget every imported `tensorrt_llm` module and the adapter modules bound to them."""
    for name in list(sys.modules):
        if name == "tensorrt_llm" or name.startswith("tensorrt_llm."):
            del sys.modules[name]
    package = sys.modules.get("m3_eagle_plugin.host.trtllm")
    for component in ADAPTER_COMPONENTS:
        sys.modules.pop(f"m3_eagle_plugin.host.trtllm.{component}", None)
        if package is not None:
            vars(package).pop(component, None)
