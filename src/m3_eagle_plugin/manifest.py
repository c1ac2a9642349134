"""Load, validate and query `plugin_manifest.toml`.

The manifest is the plugin's declaration to the outside world: which host package and versions it
supports, where it defers to upstream, what it provides and which host symbols it patches (with
why / upstream / remove-when for each). It is data, never code, so reading it imports neither torch
nor the host. `host_verdict()` turns a host version into supported / untested / defer / unsupported.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DIST_NAME = "m3-eagle-plugin"
SUPPORTED_MANIFEST_VERSIONS = ("1",)
MANIFEST_FILENAME = "plugin_manifest.toml"
UNTESTED_POLICIES = ("warn", "refuse")

SUPPORTED = "supported"
UNTESTED = "untested"
DEFER = "defer"
UNSUPPORTED = "unsupported"


class ManifestError(ValueError):
    """The manifest is missing, malformed, or a field has the wrong type or value."""


class _FieldProblem(ManifestError):
    """A bad field, raised without the file name; `parse_manifest` re-raises it naming its source."""


@dataclass(frozen=True)
class PatchRecord:
    """One host patch as the manifest documents it; `extra` keeps fields this loader does not know."""

    id: str
    target: str
    why: str
    upstream: str
    remove_when: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HostSpec:
    package: str
    requires: SpecifierSet
    tested: tuple[str, ...]
    defer_from: SpecifierSet | None
    defer_reason: str
    python: str
    gpu_archs: tuple[str, ...]


@dataclass(frozen=True)
class ActivationSpec:
    env: str
    force_env: str
    config_key: str
    bootstrap: str
    on_untested_host: str


@dataclass(frozen=True)
class Manifest:
    manifest_version: str
    name: str
    display_name: str
    host: HostSpec
    activation: ActivationSpec
    provides: Mapping[str, Any]
    patches: tuple[PatchRecord, ...]
    source: str

    def patch(self, patch_id: str) -> PatchRecord:
        for record in self.patches:
            if record.id == patch_id:
                return record
        raise KeyError(f"no patch {patch_id!r} in {self.source}")


@dataclass(frozen=True)
class Verdict:
    """What the manifest says about one host version; `forced` when the force switch lifted a defer."""

    status: str
    reason: str
    host_version: str | None
    forced: bool = False

    @property
    def allows_activation(self) -> bool:
        return self.status in (SUPPORTED, UNTESTED)


def _get(table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, *, default: Any = ...) -> Any:
    name = f"{where}.{key}" if where else key
    if key not in table:
        if default is ...:
            raise _FieldProblem(f"missing required field {name!r}")
        return default
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _FieldProblem(
            f"field {name!r} must be {expected}, got {type(value).__name__} ({value!r})"
        )
    return value


def _str_list(table: Mapping[str, Any], key: str, where: str, *, default: Any = ...) -> tuple[str, ...]:
    values = _get(table, key, list, where, default=default)
    for item in values:
        if not isinstance(item, str):
            raise _FieldProblem(f"field '{where}.{key}' must be a list of strings, got {item!r}")
    return tuple(values)


def _specifier(text: str, name: str) -> SpecifierSet:
    try:
        specifier = SpecifierSet(text)
    except InvalidSpecifier as exc:
        raise _FieldProblem(f"field {name!r} is not a valid PEP 440 specifier: {text!r}") from exc
    if not specifier:  # an empty set holds every version: "" would support, or defer, every host
        raise _FieldProblem(f"field {name!r} must name at least one version bound, got {text!r}")
    return specifier


def _is_reference(text: str) -> bool:
    """`text` is "module:qualname", each side dotted Python identifiers (as an entry point's value)."""
    module, sep, qualname = text.partition(":")
    return bool(sep) and all(part.isidentifier() for part in (*module.split("."), *qualname.split(".")))


def _parse_host(raw: Mapping[str, Any]) -> HostSpec:
    table = _get(raw, "host", dict, "")
    tested = _str_list(table, "tested", "host")
    for version in tested:
        try:
            Version(version)
        except InvalidVersion as exc:
            raise _FieldProblem(f"'host.tested' holds an invalid version {version!r}") from exc
    defer_text = _get(table, "defer_from", str, "host", default=None)
    return HostSpec(
        package=_get(table, "package", str, "host"),
        requires=_specifier(_get(table, "requires", str, "host"), "host.requires"),
        tested=tested,
        defer_from=None if defer_text is None else _specifier(defer_text, "host.defer_from"),
        defer_reason=_get(table, "defer_reason", str, "host", default="upstream provides the same feature"),
        python=_get(table, "python", str, "host", default=">=3.10"),
        gpu_archs=_str_list(table, "gpu_archs", "host", default=[]),
    )


def _parse_activation(raw: Mapping[str, Any]) -> ActivationSpec:
    table = _get(raw, "activation", dict, "")
    policy = _get(table, "on_untested_host", str, "activation", default="warn")
    if policy not in UNTESTED_POLICIES:
        raise _FieldProblem(
            f"field 'activation.on_untested_host' must be one of {UNTESTED_POLICIES}, got {policy!r}"
        )
    bootstrap = _get(table, "bootstrap", str, "activation")
    if not _is_reference(bootstrap):
        raise _FieldProblem(f"field 'activation.bootstrap' must be 'module:callable', got {bootstrap!r}")
    return ActivationSpec(
        env=_get(table, "env", str, "activation"),
        force_env=_get(table, "force_env", str, "activation", default="M3_EAGLE_PLUGIN_FORCE"),
        config_key=_get(table, "config_key", str, "activation"),
        bootstrap=bootstrap,
        on_untested_host=policy,
    )


_PATCH_FIELDS = ("id", "target", "why", "upstream", "remove_when")


def _parse_patches(raw: Mapping[str, Any]) -> tuple[PatchRecord, ...]:
    entries = _get(raw, "patches", list, "", default=[])
    records: list[PatchRecord] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"patches[{index}]"
        if not isinstance(entry, dict):
            raise _FieldProblem(f"{where!r} must be a table, got {type(entry).__name__}")
        values = {key: _get(entry, key, str, where) for key in _PATCH_FIELDS}
        if not values["id"]:
            raise _FieldProblem(f"field '{where}.id' must not be empty")
        if values["id"] in seen:
            raise _FieldProblem(f"duplicate patch id {values['id']!r} at {where!r}")
        seen.add(values["id"])
        if not _is_reference(values["target"]):
            raise _FieldProblem(
                f"field '{where}.target' must be 'module:qualname', got {values['target']!r}"
            )
        try:
            Requirement(values["remove_when"])
        except InvalidRequirement as exc:
            raise _FieldProblem(
                f"field '{where}.remove_when' must be a requirement such as "
                f"'tensorrt_llm>=1.4.0rc1', got {values['remove_when']!r}"
            ) from exc
        extra = {key: value for key, value in entry.items() if key not in _PATCH_FIELDS}
        records.append(PatchRecord(extra=extra, **values))
    return tuple(records)


def parse_manifest(raw: Mapping[str, Any], source: str = "<memory>") -> Manifest:
    """Validate a manifest already parsed from TOML; raises `ManifestError` naming `source` and the bad field."""
    try:
        return _parse_fields(raw, source)
    except _FieldProblem as exc:
        raise ManifestError(f"{source}: {exc}") from exc.__cause__


def _parse_fields(raw: Mapping[str, Any], source: str) -> Manifest:
    version = _get(raw, "manifest_version", str, "")
    if version not in SUPPORTED_MANIFEST_VERSIONS:
        raise _FieldProblem(
            f"field 'manifest_version' is {version!r}; this loader reads {SUPPORTED_MANIFEST_VERSIONS}"
        )
    name = _get(raw, "name", str, "")
    if name != DIST_NAME:
        raise _FieldProblem(f"field 'name' must equal the distribution name {DIST_NAME!r}, got {name!r}")
    return Manifest(
        manifest_version=version,
        name=name,
        display_name=_get(raw, "display_name", str, "", default=name),
        host=_parse_host(raw),
        activation=_parse_activation(raw),
        provides=_get(raw, "provides", dict, "", default={}),
        patches=_parse_patches(raw),
        source=source,
    )


def default_manifest_path() -> Path:
    """The copy shipped inside the package (a symlink to the repository root file in a checkout)."""
    return Path(__file__).with_name(MANIFEST_FILENAME)


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Read and validate a manifest file (default: the packaged one, cached)."""
    if path is None:
        return _load_default()
    return _load_path(Path(path))


@lru_cache(maxsize=1)
def _load_default() -> Manifest:
    return _load_path(default_manifest_path())


def _load_path(path: Path) -> Manifest:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError:  # arrays or inline tables nested past Python's stack
        raise ManifestError(f"{path}: not valid TOML: nested too deeply") from None
    return parse_manifest(raw, source=str(path))


def host_verdict(host_version: str | None, manifest: Manifest | None = None, *, force: bool = False) -> Verdict:
    """Classify a host version against the manifest.

    - `unsupported`: no host, an unparsable version, or outside `host.requires`;
    - `defer`: inside `host.defer_from` (upstream ships the feature) unless `force`;
    - `supported`: in range and listed in `host.tested` (a local label aside); `untested`: in range
      but not listed.
    Prereleases count as inside a range (`1.4.0rc1` matches `>=1.4.0rc1`).
    """
    manifest = manifest or load_manifest()
    package = manifest.host.package
    if host_version is None:
        return Verdict(UNSUPPORTED, f"{package} is not installed", None)
    try:
        version = Version(host_version)
    except InvalidVersion:
        return Verdict(UNSUPPORTED, f"{package} version {host_version!r} is not a PEP 440 version", host_version)
    if not manifest.host.requires.contains(version, prereleases=True):
        return Verdict(
            UNSUPPORTED, f"{package} {version} is outside the supported range {manifest.host.requires}", host_version
        )
    forced = False
    defer_from = manifest.host.defer_from
    if defer_from is not None and defer_from.contains(version, prereleases=True):
        if not force:
            return Verdict(
                DEFER,
                f"{manifest.host.defer_reason}; deferring to the built-in path "
                f"(set {manifest.activation.force_env}=1 to override)",
                host_version,
            )
        forced = True
    tested = {Version(v) for v in manifest.host.tested}
    note = f" (defer to upstream overridden by {manifest.activation.force_env}=1)" if forced else ""
    # a local build label (`1.3.0rc24+cu130`) is the tested release, as PEP 440's `==` reads it
    if version in tested or Version(version.public) in tested:
        return Verdict(SUPPORTED, f"{package} {version} is a tested host{note}", host_version, forced)
    return Verdict(
        UNTESTED,
        f"{package} {version} is inside {manifest.host.requires} but not in the tested list "
        f"{list(manifest.host.tested)}{note}",
        host_version,
        forced,
    )
