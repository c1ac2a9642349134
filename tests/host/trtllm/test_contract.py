"""The host-symbol contract: consistent with the patches and the manifest, and its static check
finds every symbol in the host double (both layouts) and in the host's real signatures."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m3_eagle_plugin.host.trtllm import contract
from m3_eagle_plugin.host.trtllm.contract import CONTRACT, PATCH_IDS, check_source_tree
from m3_eagle_plugin.host.trtllm.patches import builtin_patches
from m3_eagle_plugin.manifest import load_manifest

from .fakehost import CURRENT, LAYOUTS, LEGACY, build_fake_host

REPO = Path(__file__).resolve().parents[3]
SIGNATURES = REPO.parent / "shared" / "reference" / "trtllm_signatures.json"


def test_patch_ids_agree_between_contract_patches_and_manifest():
    manifest_ids = {p.id for p in load_manifest(REPO / "plugin_manifest.toml").patches}
    patch_ids = {p.id for p in builtin_patches()}
    contract_ids = {s.used_by for s in CONTRACT if s.used_by in PATCH_IDS}
    assert manifest_ids == patch_ids == contract_ids == set(PATCH_IDS)


def test_every_patch_target_and_rebind_is_a_contract_symbol():
    keys = {s.key for s in CONTRACT}
    for patch in builtin_patches():
        assert patch.target.key in keys
        assert all(r.key in keys for r in patch.rebinds)
        assert patch.target.used_by == patch.id


def test_manifest_targets_name_a_contract_candidate():
    candidates = {f"{m}:{s.attribute}" for s in CONTRACT for m in s.modules}
    for record in load_manifest(REPO / "plugin_manifest.toml").patches:
        assert record.target in candidates, record.target
        for other in record.extra.get("also_targets", []):
            assert other in candidates, other


@pytest.mark.parametrize("layout", LAYOUTS)
def test_static_check_passes_on_the_double(tmp_path, layout):
    root = build_fake_host(tmp_path, layout)
    findings = check_source_tree(root)
    assert len(findings) == len(CONTRACT)
    assert [f for f in findings if not f.ok] == []
    used = {f.module for f in findings if f.status == "ok"}
    other = "attention_backend" if layout == CURRENT else "attention.backends"
    assert not any(other in m for m in used)
    # the package directory itself is accepted too
    assert all(f.ok for f in check_source_tree(root / "tensorrt_llm"))


def test_static_check_names_a_missing_symbol_and_a_signature_change(tmp_path):
    root = build_fake_host(tmp_path, LEGACY)
    utils = root / "tensorrt_llm/_torch/attention_backend/sparse/utils.py"
    text = utils.read_text().replace("def _resolve_minimax_m3_backend_cls(sparse_params)",
                                     "def _renamed(sparse_params)")
    utils.write_text(text.replace("def get_sparse_attn_kv_cache_manager(sparse_attention_config,",
                                  "def get_sparse_attn_kv_cache_manager(config,"))
    bad = {f.key: f for f in check_source_tree(root) if not f.ok}
    assert bad["m3_backend_resolver"].status == "missing"
    assert "_resolve_minimax_m3_backend_cls" in bad["m3_backend_resolver"].detail
    assert bad["sparse_kv_manager_dispatch"].status == "signature"
    assert set(bad) == {"m3_backend_resolver", "sparse_kv_manager_dispatch"}


def test_static_check_reports_missing_modules_and_bad_roots(tmp_path):
    root = build_fake_host(tmp_path, CURRENT)
    shutil.rmtree(root / "tensorrt_llm/_torch/attention/backends/fmha")
    bad = {f.key: f.status for f in check_source_tree(root) if not f.ok}
    assert bad == {"trtllm_gen_support_check": "missing-module", "trtllm_gen_page_allowlist": "missing-module"}
    with pytest.raises(FileNotFoundError, match="no tensorrt_llm package"):
        check_source_tree(tmp_path / "nowhere")


def test_static_check_reads_a_source_as_python_imports_it(tmp_path):
    """A module starting with a UTF-8 BOM, or in latin-1 under a coding cookie, imports fine; the check
    read it as UTF-8 text and reported it unparsable ('invalid non-printable character U+FEFF')."""
    root = build_fake_host(tmp_path, LEGACY)
    utils = root / "tensorrt_llm/_torch/attention_backend/sparse/utils.py"
    utils.write_bytes(b"\xef\xbb\xbf" + utils.read_bytes())
    assert [f for f in check_source_tree(root) if not f.ok] == []
    utils.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\n" + utils.read_bytes()[3:])
    assert [f for f in check_source_tree(root) if not f.ok] == []


def test_static_check_follows_lazy_reexports(tmp_path):
    root = build_fake_host(tmp_path, CURRENT)
    pkg = root / "tensorrt_llm/_torch/attention/backends/sparse/__init__.py"
    pkg.write_text('_LAZY_EXPORTS = {"get_sparse_attn_kv_cache_manager": ".registry"}\n\n'
                   "def __getattr__(name):\n    raise AttributeError(name)\n")
    finding = next(f for f in check_source_tree(root) if f.key == "sparse_pkg_kv_manager_binding")
    assert finding.ok


_PARAMS = st.lists(st.sampled_from(["self", "a", "b", "c", "d"]), min_size=0, max_size=4, unique=True)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(expected=_PARAMS, actual=_PARAMS)
def test_leading_parameter_rule_matches_prefix_semantics(expected, actual):
    namespace: dict = {}
    exec(f"def f({', '.join(actual)}): pass", namespace)
    mismatch = contract.leading_params_match(namespace["f"], tuple(expected))
    assert (mismatch is None) == (tuple(actual[: len(expected)]) == tuple(expected))


# ----- the host's real signatures (../shared/reference beside the clone; skipped without it) ------

def _signature_files():
    if not SIGNATURES.is_file():
        pytest.skip(f"{SIGNATURES} not present")
    return json.loads(SIGNATURES.read_text())["files"]


def _params(signature: str) -> tuple[str, ...]:
    inner = signature[signature.index("(") + 1: signature.rindex(")")]
    names = []
    for part in inner.split(","):
        name = part.split(":")[0].split("=")[0].strip()
        if not name or name.startswith("*"):
            break
        names.append(name)
    return tuple(names)


def test_contract_matches_the_hosts_real_signatures():
    files = _signature_files()
    checked = 0
    for sym in CONTRACT:
        if sym.kind not in ("function", "method"):
            continue
        paths = {m.replace(".", "/") + ".py" for m in sym.modules}
        for entry in files:
            if entry["path"] not in paths:
                continue
            if "." in sym.attribute:
                cls_name, method = sym.attribute.split(".")
                cls = next((c for c in entry["classes"] if c["name"] == cls_name), None)
                fn = cls and next((m for m in cls["methods"] if m["name"] == method), None)
            else:
                fn = next((f for f in entry["functions"] if f["name"] == sym.attribute), None)
            if fn is None:
                assert entry["partial"] or sym.key in _KNOWN_ABSENT.get(entry["commit"] or "", ()), (
                    sym.key, entry["path"], entry["commit"])
                continue
            assert _params(fn["signature"])[: len(sym.params)] == sym.params, (sym.key, entry["commit"])
            checked += 1
    assert checked >= 10


# The earliest recorded sparse/utils.py predates MSA (no _resolve_minimax_m3_backend_cls): that host
# is outside the supported range; the M3 manager inherits the V2 methods at the pre-#18872 commits.
_KNOWN_ABSENT = {
    "108df3fa0ff3699c2edc07f8e8aebf446adf566d": ("m3_backend_resolver",),
}


def test_a_broken_import_inside_an_existing_module_surfaces(tmp_path, monkeypatch):
    """Only "this candidate module does not exist" moves on to the next layout: a candidate that exists
    but fails importing one of its own dependencies raises, rather than silently picking the next."""
    import sys

    from m3_eagle_plugin.host.trtllm.contract import import_first

    package = tmp_path / "m3_probe_layouts"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "broken.py").write_text("import m3_no_such_dependency_xyz\n")
    (package / "fallback.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert import_first(["m3_probe_layouts.absent", "m3_probe_layouts.fallback"]).VALUE == 1
        with pytest.raises(ModuleNotFoundError) as err:
            import_first(["m3_probe_layouts.broken", "m3_probe_layouts.fallback"])
        assert err.value.name == "m3_no_such_dependency_xyz"
        with pytest.raises(ImportError, match="none of the candidate modules exists"):
            import_first(["m3_probe_layouts.absent", "m3_probe_missing_pkg.mod"])
    finally:
        for name in [n for n in sys.modules if n.startswith("m3_probe_layouts")]:
            del sys.modules[name]


def test_leading_parameters_of_a_class_or_bound_method_leave_self_out():
    """A class (its constructor) and a bound method do not show `self` in their signature; a declared
    `self` is matched against the rest."""
    class Host:
        def __init__(self, layer_idx, num_heads):
            pass

        def method(self, dst_tensor, request_ids):
            pass

    assert contract.leading_params_match(Host, ("self", "layer_idx", "num_heads")) is None
    assert contract.leading_params_match(Host(1, 2).method, ("self", "dst_tensor")) is None
    assert contract.leading_params_match(Host.method, ("self", "dst_tensor")) is None
    assert "expected leading parameters" in contract.leading_params_match(Host, ("self", "num_heads"))


def test_static_check_finds_a_binding_imported_under_try(tmp_path):
    """Hosts guard optional imports with try/except: a name bound inside the `try` (or its handler)
    still counts as bound."""
    root = build_fake_host(tmp_path, CURRENT)
    util = root / "tensorrt_llm/_torch/pyexecutor/_util.py"
    text = util.read_text()
    before = "from ..speculative import should_use_separate_draft_kv_cache\n"
    assert before in text
    util.write_text(text.replace(before, "try:\n    from ..speculative import should_use_separate_draft_kv_cache\n"
                                         "except ImportError:\n    should_use_separate_draft_kv_cache = None\n"))
    finding = next(f for f in check_source_tree(root) if f.key == "util_predicate_binding")
    assert finding.ok, finding
