"""Bad manifests: wrong types, bad values, not TOML. `ManifestError` (a ValueError) must name the
field, and the file when one is read; nothing else may escape.
"""
from __future__ import annotations

import importlib
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ._counts import bump

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _manifest_mod():
    return importlib.import_module("m3_eagle_plugin.manifest")


def _packaged_raw() -> dict:
    manifest = _manifest_mod()
    return tomllib.loads(manifest.default_manifest_path().read_text(encoding="utf-8"))


def _validated_leaves(raw: dict) -> list[tuple[tuple, object]]:
    """(path, value) of every field the loader validates (not the free-form `provides` contents)."""
    leaves = []
    for key, value in raw.items():
        if key == "provides":
            leaves.append(((key,), value))
        elif isinstance(value, dict):
            leaves.append(((key,), value))
            leaves += [((key, k), v) for k, v in value.items()]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            leaves.append(((key,), value))
            for i, entry in enumerate(value):
                leaves.append(((key, i), entry))
                leaves += [((key, i, k), v) for k, v in entry.items()
                           if k in ("id", "target", "why", "upstream", "remove_when")]
        else:
            leaves.append(((key,), value))
    return leaves


def _wrong_value(value):
    if isinstance(value, str):
        return [7, True, ["x"], {"a": 1}]
    if isinstance(value, list):
        return ["x", 3, {"a": 1}]
    if isinstance(value, dict):
        return ["x", 3, "x"]
    return ["x"]


def _set(raw: dict, path: tuple, value) -> None:
    node = raw
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _field_name(path: tuple) -> str:
    """The field as the loader names it: `host.requires`, `patches[2].id`, `patches[2]` (a whole entry)."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name


@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data())
def test_manifest_field_of_wrong_type_is_named(data):
    manifest = _manifest_mod()
    raw = _packaged_raw()
    leaves = _validated_leaves(raw)
    path, value = data.draw(st.sampled_from(leaves), label="field")
    wrong = data.draw(st.sampled_from(_wrong_value(value)), label="wrong value")
    _set(raw, path, wrong)
    bump("faults.injected")
    with pytest.raises(manifest.ManifestError) as info:
        manifest.parse_manifest(raw, source="fuzzed.toml")
    # the whole name, quoted: a bare last component ("id", "why") also matched another entry's field
    assert str(info.value).startswith("fuzzed.toml: "), str(info.value)
    assert f"'{_field_name(path)}'" in str(info.value), str(info.value)


@pytest.mark.parametrize("edit,field", [
    (lambda r: r["host"].pop("requires"), "host.requires"),
    (lambda r: r["host"].__setitem__("requires", ">>=1.3"), "host.requires"),
    (lambda r: r["host"].__setitem__("tested", ["not a version!"]), "host.tested"),
    (lambda r: r.__setitem__("manifest_version", "99"), "manifest_version"),
    (lambda r: r["patches"][1].__setitem__("remove_when", "when it is done"), "remove_when"),
    (lambda r: r["patches"].append(dict(r["patches"][0])), "duplicate"),
])
def test_manifest_with_bad_values_is_refused_naming_the_field(edit, field):
    manifest = _manifest_mod()
    raw = _packaged_raw()
    edit(raw)
    bump("faults.injected")
    with pytest.raises(manifest.ManifestError, match=field.replace(".", r"\.")):
        manifest.parse_manifest(raw, source="x.toml")


def test_manifest_file_error_names_the_file_loaded(tmp_path):
    manifest = _manifest_mod()
    text = manifest.default_manifest_path().read_text(encoding="utf-8")
    bad = tmp_path / "site_override.toml"
    bad.write_text(text.replace('requires = ">=1.3.0rc1,<1.5"', "requires = 13", 1))
    assert "requires = 13" in bad.read_text()
    bump("faults.injected")
    with pytest.raises(manifest.ManifestError) as info:
        manifest.load_manifest(bad)
    assert "host.requires" in str(info.value) and str(bad) in str(info.value), str(info.value)


def test_manifest_that_is_not_toml_names_the_file(tmp_path):
    manifest = _manifest_mod()
    bad = tmp_path / "broken.toml"
    bad.write_text("manifest_version = \n[host\n")
    bump("faults.injected")
    with pytest.raises(manifest.ManifestError, match="broken.toml"):
        manifest.load_manifest(bad)


@pytest.mark.parametrize("value", ["[" * 100_000 + "]" * 100_000, "{a = " * 50_000 + "1" + "}" * 50_000],
                         ids=["arrays", "inline-tables"])
def test_manifest_nested_past_the_stack_names_the_file(tmp_path, value):
    """tomllib recurses per level: a RecursionError escaped, naming neither the file nor the cause."""
    manifest = _manifest_mod()
    bad = tmp_path / "deep.toml"
    bad.write_text(f"manifest_version = {value}\n")
    bump("faults.injected")
    with pytest.raises(manifest.ManifestError, match=rf"^{re.escape(str(bad))}: not valid TOML: nested too deeply$"):
        manifest.load_manifest(bad)
