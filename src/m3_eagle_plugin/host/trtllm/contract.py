"""The one list of every TensorRT-LLM symbol the adapter touches, and a static check of it.

TensorRT-LLM moves quickly (the `attention_backend` -> `attention/backends` refactor, sparse
dispatch moving from `sparse/utils.py` to `sparse/registry.py`, names re-exported through
package `__init__`s). Everything the patches and components reach for is declared here once,
with the candidate modules across layouts and the leading parameters it must accept. The patch
engine resolves targets from this list, `m3-eagle doctor --host-source DIR` checks it against a
source tree with `ast` (no import), and a test keeps it in step with the manifest's patch ids.
"""
from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Literal

_T = "tensorrt_llm._torch"
_NEW = f"{_T}.attention.backends"  # after NVIDIA/TensorRT-LLM#17968
_OLD = f"{_T}.attention_backend"  # before it

Kind = Literal["function", "class", "method", "binding", "attribute"]

ROUTE_KV = "route-sparse-kv-cache-manager"
ROUTE_MSA = "route-msa-backend"
UNIFIED_KV = "unified-draft-kv-policy"
PAGE_SIZE = "trtllm-gen-page-size-opt-in"
PATCH_IDS = (ROUTE_KV, ROUTE_MSA, UNIFIED_KV, PAGE_SIZE)


@dataclass(frozen=True)
class HostSymbol:
    """One host name: where it may live (first existing module wins) and what it must accept.

    `attribute` is `name` or `Class.name`. `params` are the leading parameter names the adapter
    relies on (positional order, `self` included for methods). A `binding` is a name another
    module bound at import time (`from X import name`), which a patch must rebind too.
    """

    key: str
    modules: tuple[str, ...]
    attribute: str
    kind: Kind
    params: tuple[str, ...] = ()
    used_by: str = ""
    source_checkable: bool = True

    @property
    def name(self) -> str:
        return self.attribute.rsplit(".", 1)[-1]


def _sym(key, modules, attribute, kind, params=(), used_by="", source_checkable=True):
    return HostSymbol(key, tuple(modules), attribute, kind, tuple(params), used_by, source_checkable)


_SPARSE_DISPATCH = (f"{_NEW}.sparse.registry", f"{_OLD}.sparse.utils", f"{_OLD}.sparse.registry")
_M3_PKG = (f"{_NEW}.sparse.minimax_m3", f"{_OLD}.sparse.minimax_m3")
_KV_V2 = (
    f"{_T}.pyexecutor.kv_cache.kv_cache_manager_v2",
    f"{_T}.pyexecutor.kv_cache_manager_v2",
)
_FMHA_GEN = (f"{_NEW}.fmha.flashinfer_trtllm_gen", f"{_OLD}.fmha.flashinfer_trtllm_gen")

CONTRACT: tuple[HostSymbol, ...] = (
    # (1) route MiniMax-M3 to the plugin's KV manager: the definer and every re-export.
    _sym("sparse_kv_manager_dispatch", _SPARSE_DISPATCH, "get_sparse_attn_kv_cache_manager",
         "function", ("sparse_attention_config",), ROUTE_KV),
    _sym("sparse_pkg_kv_manager_binding", (f"{_NEW}.sparse", f"{_OLD}.sparse"),
         "get_sparse_attn_kv_cache_manager", "binding", used_by=ROUTE_KV),
    _sym("attention_pkg_kv_manager_binding", (_NEW, _OLD),
         "get_sparse_attn_kv_cache_manager", "binding", used_by=ROUTE_KV),
    _sym("util_kv_manager_binding", (f"{_T}.pyexecutor._util",),
         "get_sparse_attn_kv_cache_manager", "binding", used_by=ROUTE_KV),
    # (1b) route the MSA implementation to the plugin's backend/metadata.
    _sym("m3_backend_resolver", _SPARSE_DISPATCH, "_resolve_minimax_m3_backend_cls",
         "function", ("sparse_params",), ROUTE_MSA),
    # (2) unified draft/target KV for MiniMax-M3.
    _sym("separate_draft_kv_predicate", (f"{_T}.speculative.interface",),
         "should_use_separate_draft_kv_cache", "function", ("spec_config",), UNIFIED_KV),
    _sym("speculative_pkg_predicate_binding", (f"{_T}.speculative",),
         "should_use_separate_draft_kv_cache", "binding", used_by=UNIFIED_KV),
    _sym("modeling_speculative_predicate_binding", (f"{_T}.models.modeling_speculative",),
         "should_use_separate_draft_kv_cache", "binding", used_by=UNIFIED_KV),
    _sym("util_predicate_binding", (f"{_T}.pyexecutor._util",),
         "should_use_separate_draft_kv_cache", "binding", used_by=UNIFIED_KV),
    _sym("kv_creator_separate_draft", (f"{_T}.pyexecutor._util",),
         "KvCacheCreator._should_create_separate_draft_kv_cache", "method", ("self",), UNIFIED_KV),
    # (3) trtllm-gen page-size opt-in.
    _sym("trtllm_gen_support_check", _FMHA_GEN, "FlashInferTrtllmGenFmha._is_supported_with_reason",
         "method", ("self", "q", "k", "v", "attn", "meta", "fwd"), PAGE_SIZE),
    _sym("trtllm_gen_page_allowlist", _FMHA_GEN, "FlashInferTrtllmGenFmha.SUPPORTED_TOKENS_PER_BLOCK",
         "attribute", used_by=PAGE_SIZE),
    # Components: model registration and the Eagle3 base.
    _sym("register_auto_model", (f"{_T}.models.modeling_utils",), "register_auto_model",
         "function", ("name",), "model"),
    _sym("model_class_mapping", (f"{_T}.models.modeling_utils",), "MODEL_CLASS_MAPPING",
         "attribute", used_by="model"),
    _sym("spec_one_engine_base", (f"{_T}.models.modeling_speculative",),
         "SpecDecOneEngineForCausalLM.__init__", "method", ("self", "model", "model_config"), "model"),
    _sym("m3_model", (f"{_T}.models.modeling_minimaxm3",), "MiniMaxM3Model.__init__", "method",
         ("self", "model_config"), "model"),
    _sym("m3_causal_lm", (f"{_T}.models.modeling_minimaxm3",), "MiniMaxM3ForCausalLM.load_weights",
         "method", ("self", "weights"), "model"),
    _sym("m3_is_vl_config", (f"{_T}.models.modeling_minimaxm3",), "is_minimax_m3_vl_config", "function",
         ("pretrained_config",), "model"),
    _sym("m3_text_model_config", (f"{_T}.models.modeling_minimaxm3",), "get_text_model_config", "function",
         ("model_config",), "model"),
    # Components: MSA metadata and backend.
    _sym("msa_metadata_prepare", tuple(f"{m}.msa_backend" for m in _M3_PKG),
         "MiniMaxM3MsaSparseAttentionMetadata.prepare", "method", ("self",), "msa_metadata"),
    _sym("msa_metadata_on_update_kv_lens", tuple(f"{m}.msa_backend" for m in _M3_PKG),
         "MiniMaxM3MsaSparseAttentionMetadata.on_update_kv_lens", "method", ("self",), "msa_metadata"),
    # The host's decode-scratch sizing hook, which the plugin metadata overrides to size scratch by
    # verify tokens. A host without it (the first MSA metadata) sizes that scratch by batch and its
    # prepare() refuses any decode row of more than one token, so verify steps cannot run there.
    # Declared as an attribute: only its presence matters (the override keeps its `(self)` signature).
    _sym("msa_decode_scratch_sizing", tuple(f"{m}.msa_backend" for m in _M3_PKG),
         "MiniMaxM3MsaSparseAttentionMetadata._msa_max_decode_tokens", "attribute", used_by="msa_metadata"),
    _sym("msa_attention", tuple(f"{m}.msa_backend" for m in _M3_PKG),
         "MiniMaxM3MsaSparseAttention.__init__", "method",
         ("self", "layer_idx", "num_heads", "head_dim"), "msa_metadata"),
    # Components: the KV manager and its V2 base.
    _sym("m3_kv_manager", tuple(f"{m}.cache_manager" for m in _M3_PKG),
         "MiniMaxM3KVCacheManagerV2.__init__", "method", ("self",), "cache_manager"),
    _sym("m3_kv_slot_ids", tuple(f"{m}.cache_manager" for m in _M3_PKG),
         "MiniMaxM3KVCacheManagerV2.get_block_ids_per_seq", "method", ("self", "request_ids"),
         "msa_metadata"),
    _sym("m3_kv_role", tuple(f"{m}.cache_manager" for m in _M3_PKG), "Role", "binding",
         used_by="cache_manager"),
    _sym("spec_layer_count", (f"{_T}.speculative.utils",), "get_num_spec_layers", "function",
         ("spec_config",), "cache_manager"),
    _sym("v2_prepare_page_table", _KV_V2, "KVCacheManagerV2._prepare_page_table_tensor", "method",
         ("self", "index_mapper_capacity"), "cache_manager"),
    _sym("v2_copy_block_offsets", _KV_V2, "KVCacheManagerV2.copy_batch_block_offsets", "method",
         ("self", "dst_tensor", "request_ids", "beam_width", "num_contexts", "num_seqs"),
         "cache_manager"),
    _sym("v2_update_resources", _KV_V2, "KVCacheManagerV2.update_resources", "method",
         ("self", "scheduled_batch"), "cache_manager"),
    _sym("device_block_offset_copy",
         ("tensorrt_llm.bindings.internal.batch_manager.kv_cache_manager_v2_utils",),
         "copy_batch_block_offsets_to_device", "function", used_by="cache_manager",
         source_checkable=False),
)


def symbol(key: str) -> HostSymbol:
    for s in CONTRACT:
        if s.key == key:
            return s
    raise KeyError(f"no host symbol {key!r} in the contract")


# ---------------------------------------------------------------------------------------------
# Runtime resolution (imports the host; used by the patch engine and the components)
# ---------------------------------------------------------------------------------------------


class HostSymbolMissing(LookupError):
    """A contract symbol could not be found in the installed host."""

    def __init__(self, sym: HostSymbol, why: str):
        super().__init__(f"host symbol {sym.attribute!r} ({sym.key}) not found in "
                         f"{' | '.join(sym.modules)}: {why}")
        self.symbol = sym


def import_first(modules: Iterable[str]) -> ModuleType:
    """Import the first of `modules` that exists (a layout probe); ImportError if none does."""
    errors = []
    for name in modules:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Only "this module does not exist" means try the next layout; a broken import
            # inside an existing module must surface.
            if exc.name is None or not (name == exc.name or name.startswith(exc.name + ".")):
                raise
            errors.append(f"{name}: {exc}")
    raise ImportError("none of the candidate modules exists: " + "; ".join(errors))


def resolve_owner(sym: HostSymbol) -> tuple[ModuleType, Any]:
    """Return (module, owner) where `owner` holds `sym.name` (the module or a class in it)."""
    try:
        module = import_first(sym.modules)
    except ImportError as exc:
        raise HostSymbolMissing(sym, str(exc)) from None
    owner: Any = module
    for part in sym.attribute.split(".")[:-1]:
        if not hasattr(owner, part):
            raise HostSymbolMissing(sym, f"{module.__name__} has no {part!r}")
        owner = getattr(owner, part)
    if sym.name not in _namespace(owner) and not hasattr(owner, sym.name):
        raise HostSymbolMissing(sym, f"{getattr(owner, '__name__', owner)!r} has no {sym.name!r}")
    return module, owner


def resolve(key: str) -> Any:
    """The live object for contract symbol `key` (the class for `Class.method` entries)."""
    sym = symbol(key)
    _, owner = resolve_owner(sym)
    if sym.kind == "method":
        return owner
    return getattr(owner, sym.name)


def _namespace(owner: Any) -> dict:
    return vars(owner) if hasattr(owner, "__dict__") else {}


def leading_params_match(func: Any, params: tuple[str, ...]) -> str | None:
    """None when `func` accepts `params` as its leading parameters, else the reason."""
    import inspect

    if not params:
        return None
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        return f"signature not readable: {exc}"
    names = [p.name for p in sig.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if isinstance(func, type) or inspect.ismethod(func):
        params = params[1:] if params[:1] == ("self",) else params
    if tuple(names[: len(params)]) != params:
        return f"expected leading parameters {params}, found {tuple(names)}"
    return None


# ---------------------------------------------------------------------------------------------
# Static check of a source tree (no import)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """The result of checking one contract symbol in a source tree."""

    key: str
    attribute: str
    status: Literal["ok", "skipped", "missing-module", "missing", "signature", "unparsable"]
    module: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "skipped")


def _package_root(directory: Path) -> Path:
    directory = Path(directory)
    if (directory / "tensorrt_llm" / "__init__.py").is_file():
        return directory
    if directory.name == "tensorrt_llm" and (directory / "__init__.py").is_file():
        return directory.parent
    raise FileNotFoundError(
        f"{directory} holds no tensorrt_llm package (expected {directory}/tensorrt_llm/__init__.py)")


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_level(nodes: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, descending into `if`/`try` blocks (conditional imports)."""
    for node in nodes:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _module_level(
                node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in _module_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
                    if target.id == "_LAZY_EXPORTS" and isinstance(node.value, ast.Dict):
                        for k in node.value.keys:  # PEP 562 lazy re-exports
                            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                                names.setdefault(k.value, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _leading_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    return tuple(a.arg for a in fn.args.posonlyargs + fn.args.args)


def _check_one(sym: HostSymbol, root: Path, cache: dict[Path, ast.Module | Exception]) -> Finding:
    if not sym.source_checkable:
        return Finding(sym.key, sym.attribute, "skipped", sym.modules[0],
                       "compiled extension: not checkable from source")
    for module in sym.modules:
        path = _module_file(root, module)
        if path is not None:
            break
    else:
        return Finding(sym.key, sym.attribute, "missing-module", " | ".join(sym.modules),
                       "no candidate module file in the tree")
    if path not in cache:
        try:
            # bytes, as the import system reads a source: a UTF-8 BOM or a coding cookie is honoured
            cache[path] = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, UnicodeDecodeError) as exc:
            cache[path] = exc
    tree = cache[path]
    if isinstance(tree, Exception):
        return Finding(sym.key, sym.attribute, "unparsable", module, str(tree))
    parts = sym.attribute.split(".")
    scope: list[ast.stmt] = tree.body
    names = _bound_names(scope)
    for part in parts[:-1]:
        node = names.get(part)
        if not isinstance(node, ast.ClassDef):
            return Finding(sym.key, sym.attribute, "missing", module, f"no class {part!r}")
        scope = node.body
        names = _bound_names(scope)
    node = names.get(parts[-1])
    if node is None:
        return Finding(sym.key, sym.attribute, "missing", module, f"{parts[-1]!r} is not bound")
    if sym.kind in ("function", "method"):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Finding(sym.key, sym.attribute, "missing", module,
                           f"{parts[-1]!r} is bound but not defined as a function here")
        found = _leading_params(node)
        if found[: len(sym.params)] != sym.params:
            return Finding(sym.key, sym.attribute, "signature", module,
                           f"expected leading parameters {sym.params}, found {found}")
    elif sym.kind == "class" and not isinstance(node, ast.ClassDef):
        return Finding(sym.key, sym.attribute, "missing", module, f"{parts[-1]!r} is not a class")
    return Finding(sym.key, sym.attribute, "ok", module)


def check_source_tree(directory: str | Path,
                      symbols: Iterable[HostSymbol] = CONTRACT) -> list[Finding]:
    """Statically check every contract symbol in a TensorRT-LLM source tree or installed package.

    `directory` is a checkout root (holding `tensorrt_llm/`) or the `tensorrt_llm` package
    directory itself. Nothing is imported. Returns one `Finding` per symbol; `.ok` is False for
    a missing module, a missing name or a parameter mismatch.
    """
    root = _package_root(Path(directory))
    cache: dict[Path, ast.Module | Exception] = {}
    return [_check_one(sym, root, cache) for sym in symbols]
