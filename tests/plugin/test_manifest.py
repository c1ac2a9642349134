"""plugin_manifest.toml: the shipped file, validation errors naming the field, host verdicts."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from m3_eagle_plugin.manifest import (
    DEFER,
    SUPPORTED,
    UNSUPPORTED,
    UNTESTED,
    ManifestError,
    host_verdict,
    load_manifest,
    parse_manifest,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
ROOT_MANIFEST = REPO_ROOT / "plugin_manifest.toml"
REQUIRED_PATCHES = {
    "route-sparse-kv-cache-manager",
    "route-msa-backend",
    "unified-draft-kv-policy",
    "trtllm-gen-page-size-opt-in",
}


def raw_manifest() -> dict:
    return tomllib.loads(ROOT_MANIFEST.read_text())


def test_shipped_manifest_loads_and_lists_the_patches():
    manifest = load_manifest()
    assert manifest.name == "m3-eagle-plugin"
    assert manifest.host.package == "tensorrt_llm"
    assert REQUIRED_PATCHES <= {p.id for p in manifest.patches}
    for record in manifest.patches:
        assert record.why and record.upstream and ":" in record.target
    assert manifest.patch("route-msa-backend").remove_when.startswith("tensorrt_llm")


def test_packaged_manifest_is_the_root_file():
    from m3_eagle_plugin.manifest import default_manifest_path

    assert default_manifest_path().read_bytes() == ROOT_MANIFEST.read_bytes()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m.pop("manifest_version"), "manifest_version"),
        (lambda m: m["host"].pop("requires"), "host.requires"),
        (lambda m: m["host"].__setitem__("requires", 13), "host.requires"),
        (lambda m: m["host"].__setitem__("requires", ">>1.3"), "host.requires"),
        (lambda m: m["host"].__setitem__("defer_from", "=<1.4"), "host.defer_from"),
        (lambda m: m["host"].__setitem__("tested", "1.3.0"), "host.tested"),
        (lambda m: m["host"].__setitem__("tested", ["not a version!"]), "host.tested"),
        (lambda m: m.__setitem__("name", "other-plugin"), "name"),
        (lambda m: m.__setitem__("manifest_version", "99"), "manifest_version"),
        (lambda m: m["activation"].__setitem__("on_untested_host", "maybe"), "activation.on_untested_host"),
        (lambda m: m["patches"][0].pop("why"), "patches[0].why"),
        (lambda m: m["patches"][1].__setitem__("target", "no_colon"), "patches[1].target"),
        (lambda m: m["patches"][2].__setitem__("remove_when", ">=1.4"), "patches[2].remove_when"),
        (lambda m: m["patches"][3].__setitem__("id", m["patches"][0]["id"]), "duplicate patch id"),
        (lambda m: m["patches"][0].__setitem__("upstream", True), "patches[0].upstream"),
    ],
)
def test_bad_manifest_names_the_field(mutate, field):
    raw = copy.deepcopy(raw_manifest())
    mutate(raw)
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_manifest(raw)


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(ManifestError, match="cannot read"):
        load_manifest(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("manifest_version = \n")
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(bad)


def test_extra_patch_fields_are_kept():
    raw = copy.deepcopy(raw_manifest())
    raw["patches"][0]["test_only_field"] = ["driver", "worker"]
    extra = parse_manifest(raw).patches[0].extra
    assert extra["test_only_field"] == ["driver", "worker"]
    assert not {"id", "target", "why", "upstream", "remove_when"} & set(extra)


@pytest.mark.parametrize(
    "version, force, status",
    [
        (None, False, UNSUPPORTED),
        ("garbage", False, UNSUPPORTED),
        ("1.2.0", False, UNSUPPORTED),
        ("1.3.0rc0", False, UNSUPPORTED),
        ("1.3.0rc1", False, UNTESTED),
        ("1.3.0rc24", False, SUPPORTED),
        ("1.3.0rc24+cu130", False, SUPPORTED),  # a local build of the tested release (PEP 440 ==)
        ("1.3.0rc24.post1", False, UNTESTED),
        ("1.3.0", False, UNTESTED),
        ("1.4.0rc1", False, DEFER),   # prerelease must match >=1.4.0rc1
        ("1.4.0rc1", True, UNTESTED),
        ("1.4.2", False, DEFER),
        ("1.5.0rc1", False, UNSUPPORTED),  # <1.5 excludes 1.5 prereleases (PEP 440)
        ("1.5.0", False, UNSUPPORTED),
    ],
)
def test_host_verdict_examples(version, force, status):
    verdict = host_verdict(version, force=force)
    assert verdict.status == status, verdict.reason
    if version is None:
        assert "tensorrt_llm is not installed" in verdict.reason
    if status == DEFER:
        assert "18872" in verdict.reason and "M3_EAGLE_PLUGIN_FORCE" in verdict.reason
    assert verdict.forced == (force and status != UNSUPPORTED and version == "1.4.0rc1")


versions = st.builds(
    lambda major, minor, patch, pre: f"{major}.{minor}.{patch}{pre}",
    st.integers(0, 2), st.integers(0, 6), st.integers(0, 3),
    st.sampled_from(["", "rc1", "rc7", "rc24", "a1", "b2", ".post1", ".dev3"]),
).flatmap(lambda v: st.sampled_from([v, v + "+cu130", v + "+local.7"]))


def _expected(version: str, force: bool) -> str:
    # Independent restatement of the manifest's rules with plain version comparisons.
    v = Version(version)
    if not (Version("1.3.0rc1") <= v and v.release < (1, 5)):
        return UNSUPPORTED
    if v >= Version("1.4.0rc1") and not force:
        return DEFER
    return SUPPORTED if SpecifierSet("==1.3.0rc24").contains(v, prereleases=True) else UNTESTED


@settings(max_examples=25, deadline=None, derandomize=True)
@given(versions, st.booleans())
# the draws fall in the supported range about one time in ten and never on the tested release
@example("1.3.0rc24", False)
@example("1.3.0rc24+cu130", False)  # a local build label is the tested release
@example("1.4.0rc1", False)  # the first deferred version
@example("1.3.0rc1", True)  # the first version in range
def test_host_verdict_property(version, force):
    assert host_verdict(version, force=force).status == _expected(version, force)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m["host"].__setitem__("requires", 13), "host.requires"),
        (lambda m: m["host"].__setitem__("requires", ">>1.3"), "host.requires"),
        (lambda m: m["activation"].pop("bootstrap"), "activation.bootstrap"),
        (lambda m: m["patches"][1].__setitem__("target", "no_colon"), "patches[1].target"),
    ],
)
def test_field_error_names_the_file_loaded(tmp_path, mutate, field):
    raw = copy.deepcopy(raw_manifest())
    mutate(raw)
    bad = tmp_path / "site_override.toml"
    bad.write_text(_to_toml(raw), encoding="utf-8")
    with pytest.raises(ManifestError) as info:
        load_manifest(bad)
    message = str(info.value)
    assert message.startswith(f"{bad}: ") and field in message, message
    assert "plugin_manifest.toml" not in message, message


def test_parsed_manifest_errors_name_the_given_source():
    raw = copy.deepcopy(raw_manifest())
    raw["host"]["defer_from"] = "=<1.4"
    with pytest.raises(ManifestError, match=r"^overrides/site\.toml: field 'host\.defer_from'") as info:
        parse_manifest(raw, source="overrides/site.toml")
    assert type(info.value.__cause__).__name__ == "InvalidSpecifier"


def _to_toml(raw: dict) -> str:
    """A minimal TOML writer for the manifest's shapes (strings, numbers, string lists, tables)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(type(v))

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, (dict, list)) or
             isinstance(v, list) and not (v and isinstance(v[0], dict))]
    for key, v in raw.items():
        if isinstance(v, dict):
            lines += ["", f"[{key}]"] + [f"{k} = {value(x)}" for k, x in v.items()]
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for entry in v:
                lines += ["", f"[[{key}]]"] + [f"{k} = {value(x)}" for k, x in entry.items()]
    return "\n".join(lines) + "\n"


def test_toml_writer_round_trips_the_shipped_manifest():
    assert tomllib.loads(_to_toml(raw_manifest())) == raw_manifest()


def _with_host(**host) -> "object":
    raw = copy.deepcopy(raw_manifest())
    raw["host"].pop("defer_from", None)
    raw["host"].update(host)
    return parse_manifest(raw)


def test_prereleases_count_as_inside_ranges_that_name_none():
    """Docstring: prereleases count as inside a range, also where the specifier names no prerelease
    (PEP 440's default would leave 1.3.0rc1 outside >=1.2,<2 and 1.5.1rc2 outside >=1.5)."""
    manifest = _with_host(requires=">=1.2,<2", tested=["1.4.0"], defer_from=">=1.5")
    assert host_verdict("1.3.0rc1", manifest).status == UNTESTED
    assert host_verdict("1.5.1rc2", manifest).status == DEFER
    assert host_verdict("1.5.1rc2", manifest, force=True).status == UNTESTED
    assert host_verdict("1.4.0", manifest).status == SUPPORTED


def test_a_tested_final_release_does_not_cover_its_prereleases_or_post_releases():
    manifest = _with_host(requires=">=1.2,<2", tested=["1.4.0"])
    assert host_verdict("1.4.0+cu130", manifest).status == SUPPORTED  # local label: the same release
    for other in ("1.4.0rc3", "1.4.0.post1", "1.4.0.dev1"):
        assert host_verdict(other, manifest).status == UNTESTED, other


@pytest.mark.parametrize("status, allowed", [(SUPPORTED, True), (UNTESTED, True), (DEFER, False), (UNSUPPORTED, False)])
def test_only_supported_and_untested_verdicts_allow_activation(status, allowed):
    from m3_eagle_plugin.manifest import Verdict

    assert Verdict(status, "why", "1.0").allows_activation is allowed


def test_verdicts_of_the_shipped_manifest_allow_activation_as_documented():
    assert host_verdict("1.3.0rc24").allows_activation
    assert not host_verdict("1.4.2").allows_activation  # defer
    assert host_verdict("1.4.2", force=True).allows_activation
    assert not host_verdict("1.2.0").allows_activation


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m["patches"][0].__setitem__("id", ""), "patches[0].id"),
        (lambda m: m["patches"][1].__setitem__("target", ":qualname"), "patches[1].target"),
        (lambda m: m["patches"][1].__setitem__("target", "module:"), "patches[1].target"),
        (lambda m: m["activation"].__setitem__("bootstrap", "m3_eagle_plugin._bootstrap"), "activation.bootstrap"),
    ],
)
def test_more_bad_fields_are_named(mutate, field):
    raw = copy.deepcopy(raw_manifest())
    mutate(raw)
    with pytest.raises(ManifestError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_manifest(raw)


@pytest.mark.parametrize("value", ["m3_eagle_plugin._bootstrap:main:extra", ":main", "m3_eagle_plugin._bootstrap:",
                                   "m3_eagle_plugin.:main", "m3_eagle_plugin._bootstrap: main"])
@pytest.mark.parametrize("table, key, index", [("activation", "bootstrap", None), ("patches", "target", 0)])
def test_a_reference_that_names_no_callable_is_refused(value, table, key, index):
    """The bootstrap and patch targets are 'module:qualname': each value here either is not one as the
    standard library reads it (pkgutil.resolve_name) or names a module, not a callable in it. Only the
    colon was looked for in the bootstrap (all five passed), only non-empty sides in a target."""
    import pkgutil

    try:
        resolved = pkgutil.resolve_name(value)
    except ValueError:
        pass
    else:
        assert not callable(resolved)
    raw = copy.deepcopy(raw_manifest())
    (raw[table] if index is None else raw[table][index])[key] = value
    field = f"{table}.{key}" if index is None else rf"{table}\[{index}\]\.{key}"
    with pytest.raises(ManifestError, match=f"field '{field}' must be 'module:"):
        parse_manifest(raw)


def test_the_shipped_bootstrap_names_the_start_files_callable():
    import pkgutil

    from m3_eagle_plugin._bootstrap import main

    assert pkgutil.resolve_name(load_manifest().activation.bootstrap) is main


def test_display_name_defaults_to_the_name():
    raw = copy.deepcopy(raw_manifest())
    raw.pop("display_name", None)
    assert parse_manifest(raw).display_name == "m3-eagle-plugin"


def test_patch_lookup_is_by_exact_id():
    manifest = load_manifest()
    assert manifest.patch("route-msa-backend").id == "route-msa-backend"
    for partial in ("route", "route-msa", "route-msa-backend-x"):
        with pytest.raises(KeyError, match=partial):
            manifest.patch(partial)


@pytest.mark.parametrize("table, key", [("host", "gpu_archs"), ("host", "tested")])
def test_a_string_list_holding_a_number_names_the_field(table, key):
    raw = copy.deepcopy(raw_manifest())
    raw[table][key] = [90]
    with pytest.raises(ManifestError, match=f"'{table}.{key}' must be a list of strings"):
        parse_manifest(raw)


def test_optional_fields_default_to_what_the_package_declares_and_reads():
    """Left out: python is the distribution's requires-python, the force switch is the variable activation
    reads, an untested host warns (DESIGN: the activation line is a warning), no GPU archs are listed."""
    from m3_eagle_plugin.switches import FORCE_ENV

    raw = copy.deepcopy(raw_manifest())
    for key in ("python", "gpu_archs"):
        raw["host"].pop(key)
    for key in ("force_env", "on_untested_host"):
        raw["activation"].pop(key)
    manifest = parse_manifest(raw)
    requires_python = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert manifest.host.python == requires_python
    assert manifest.host.gpu_archs == ()
    assert manifest.activation.force_env == FORCE_ENV
    assert manifest.activation.on_untested_host == "warn"


def test_a_patch_entry_that_is_not_a_table_is_named():
    raw = copy.deepcopy(raw_manifest())
    raw["patches"][1] = "route-msa-backend"
    with pytest.raises(ManifestError, match=r"'patches\[1\]' must be a table, got str"):
        parse_manifest(raw)


def test_a_defer_verdict_without_a_defer_reason_still_says_why():
    raw = copy.deepcopy(raw_manifest())
    raw["host"].pop("defer_reason")
    verdict = host_verdict("1.4.2", parse_manifest(raw))
    why, _, rest = verdict.reason.partition("; deferring")
    assert verdict.status == DEFER and why.strip() and rest


@pytest.mark.parametrize("key", ["requires", "defer_from"])
def test_an_empty_version_range_is_refused_naming_it(key):
    """An empty PEP 440 specifier set holds every version: requires = "" called 0.1 and 9.0 in range,
    defer_from = "" deferred every host, the tested one included."""
    assert SpecifierSet("").contains("0.1") and SpecifierSet("").contains("9.0")
    raw = raw_manifest()
    raw["host"][key] = ""
    with pytest.raises(ManifestError, match=f"field 'host.{key}' must name at least one version bound"):
        parse_manifest(raw, source="m.toml")


def test_a_manifest_that_is_not_utf8_is_a_manifest_error_naming_the_file(tmp_path):
    """A Latin-1 byte escaped as a bare UnicodeDecodeError that named no file."""
    path = tmp_path / "plugin_manifest.toml"
    path.write_bytes(ROOT_MANIFEST.read_bytes().replace(b'"MiniMax-M3 one-model', b'"Mini\xe9Max-M3'))
    with pytest.raises(ManifestError, match=f"cannot read manifest {path}: .*utf-8"):
        load_manifest(path)


def test_a_tested_host_inside_the_defer_range_is_supported_and_marked_forced_when_forced():
    """Verdict's docstring: `forced` when the force switch lifted a defer, whatever the host's status then
    is (the shipped manifest tests no deferring version, so only the untested case was exercised)."""
    manifest = _with_host(requires=">=1.2,<2", tested=["1.6.0"], defer_from=">=1.5")
    assert host_verdict("1.6.0", manifest).status == DEFER
    forced = host_verdict("1.6.0", manifest, force=True)
    assert (forced.status, forced.forced) == (SUPPORTED, True) and "overridden" in forced.reason
    assert host_verdict("1.4.0", _with_host(requires=">=1.2,<2", tested=["1.4.0"], defer_from=">=1.5"),
                        force=True).forced is False  # nothing deferred, nothing lifted
