"""README and CI agree: `.ci/run` runs the README's two newcomer commands verbatim; the README,
`docs/internals.md` and the design note document only options, settings and host patches the code has;
and the README's serving example selects what the plugin serves."""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from m3_eagle_plugin.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    main_job, tests = _bash_blocks(readme)[:2]
    assert main_job.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e \".[test]\"")
    assert tests == ".venv/bin/python -m pytest -q"
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert main_job in ci_lines and tests in ci_lines


def test_readme_documents_every_setting():
    readme = (REPO / "README.md").read_text()
    for name in ("M3_EAGLE_PLUGIN", "M3_EAGLE_PLUGIN_FORCE", "M3_EAGLE_PLUGIN_TRACE", "M3_EAGLE_PLUGIN_LOAD",
                 "M3_EAGLE_PLUGIN_LOG_LEVEL", "M3_EAGLE_KERNELS", "M3_EAGLE_KERNEL_TABLE", "m3_eagle_plugin:",
                 "## Guarantees", "## Compatibility"):
        assert name in readme, name


# ----- the documented command line, settings and host patches against the code -------------------
DESIGN = REPO.parent / "shared" / "DESIGN.md"  # the design note lives beside the repository


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"m3-eagle {command}")
    importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _documented_invocations(text: str) -> list[tuple[str, list[str]]]:
    """(sub-command, its --flags) for every `m3-eagle COMMAND ...` in backticks."""
    found = []
    for span in re.findall(r"`(m3-eagle [^`]+)`", text):
        words = span.split()
        if len(words) > 1 and words[1] in COMMANDS:
            found.append((words[1], re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span)))
    return found


@pytest.mark.parametrize("doc", ["README.md", "docs/internals.md", "DESIGN.md"])
def test_every_documented_command_line_option_exists(doc):
    path = DESIGN if doc == "DESIGN.md" else REPO / doc
    if not path.exists():
        pytest.skip(f"{path} is not beside this checkout")
    invocations = _documented_invocations(path.read_text())
    assert doc == "docs/internals.md" or invocations
    parsers = {name: _options(_subparser(name)) for name in {c for c, _ in invocations}}
    missing = [(command, flag) for command, flags in invocations for flag in flags if flag not in parsers[command]]
    assert not missing, f"{doc} documents options the command line does not have: {missing}"


def test_bench_json_is_stdout_or_a_path_as_the_readme_says():
    """DESIGN.md: `--json` prints one JSON object on stdout; `m3-eagle bench --json PATH` also
    writes it to a file instead."""
    readme = (REPO / "README.md").read_text()
    assert "`--json` prints every row and the context as one JSON object on stdout" in readme
    assert "`--json PATH` writes it to that file" in readme
    bench_json = _options(_subparser("bench"))["--json"]
    assert bench_json.nargs == "?" and bench_json.const == "-" and bench_json.metavar == "PATH"
    for command in ("doctor", "run"):
        assert _options(_subparser(command))["--json"].nargs == 0  # store_true: one object on stdout


def test_make_tiny_train_steps_default_is_the_documented_one():
    readme = (REPO / "README.md").read_text()
    documented = int(re.search(r"for N steps \(default (\d+)", readme).group(1))
    assert _options(_subparser("make-tiny"))["--train-steps"].default == documented


def test_every_setting_the_code_reads_is_documented():
    readme = (REPO / "README.md").read_text()
    names = set()
    for source in (REPO / "src" / "m3_eagle_plugin").rglob("*.py"):
        names |= set(re.findall(r"[\"'](M3_EAGLE_[A-Z0-9_]*[A-Z0-9])[\"']", source.read_text()))
    assert {"M3_EAGLE_PLUGIN", "M3_EAGLE_PDL", "M3_EAGLE_REPLAY"} <= names
    undocumented = sorted(name for name in names if f"`{name}`" not in readme)
    assert not undocumented, undocumented


def test_plugin_load_unset_and_empty_are_documented_as_they_behave():
    from m3_eagle_plugin.registry import _allow_list

    assert _allow_list({}) is None  # unset: every installed entry point loads
    assert _allow_list({"M3_EAGLE_PLUGIN_LOAD": ""}) == set()  # empty: none
    row = next(line for line in (REPO / "README.md").read_text().splitlines()
               if line.startswith("| `M3_EAGLE_PLUGIN_LOAD`"))
    assert "unset (default) = every installed one" in row and "empty = none" in row


def test_every_host_rebinding_outside_the_manifest_is_named_in_compatibility():
    """The README says every host patch is in the manifest; what is not must be named there."""
    from m3_eagle_plugin.config_key import HOST_FUNCTION
    from m3_eagle_plugin.manifest import load_manifest

    manifest_ids = {record.id for record in load_manifest().patches}
    patch_dir = REPO / "src" / "m3_eagle_plugin" / "host" / "trtllm" / "patches"
    ids = {}
    for module in sorted(patch_dir.glob("*.py")):
        match = re.match(r'"{3}Patch `([^`]+)`', module.read_text())  # each module's header names its id
        if match:
            ids[match.group(1)] = module.name
    assert manifest_ids <= set(ids), "a manifest patch without its module"
    compatibility = _section((REPO / "README.md").read_text(), "## Compatibility")
    unnamed = [f"{pid} ({name})" for pid, name in ids.items() if pid not in manifest_ids and pid not in compatibility]
    if HOST_FUNCTION not in compatibility:
        unnamed.append(HOST_FUNCTION)
    assert not unnamed, f"host rebindings neither in the manifest nor in the README's Compatibility: {unnamed}"


def test_readme_serving_yaml_reaches_the_plugins_msa_backend(tmp_path):
    """The README's `extra.yaml`, on the host double with the plugin installed, gets the plugin's
    attention backend and KV manager. The host lowers `sparse_attention_config` with `implementation`
    defaulting to `triton` (its own reference attention, which the plugin leaves alone), and with no
    such section M3 is not routed as sparse at all."""
    yaml = pytest.importorskip("yaml")
    from m3_eagle_plugin.host import trtllm as adapter
    from m3_eagle_plugin.host.trtllm.contract import import_first, symbol
    from tests.host.trtllm.fakehost import CURRENT, build_fake_host, purge_host_modules

    block = re.findall(r"```yaml\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)[0]
    sparse = yaml.safe_load(block).get("sparse_attention_config") or {}
    params = SimpleNamespace(**{"algorithm": None, "implementation": "triton", **sparse})
    host = build_fake_host(tmp_path, CURRENT)
    adapter.uninstall()
    purge_host_modules()
    sys.path.insert(0, str(host))
    importlib.invalidate_caches()
    try:
        adapter.install()
        dispatch = import_first(symbol("m3_backend_resolver").modules)
        manager = dispatch.get_sparse_attn_kv_cache_manager(params) if params.algorithm else None
        backend = dispatch.get_trtllm_sparse_attn_attention_backend(params) if params.algorithm else None
    finally:
        adapter.uninstall()
        purge_host_modules()
        sys.path.remove(str(host))
    assert getattr(manager, "__name__", None) == "M3EagleKVCacheManagerV2", f"{sparse=}: {manager}"
    assert getattr(backend, "__name__", None) == "M3EagleMsaSparseAttention", f"{sparse=}: {backend}"
