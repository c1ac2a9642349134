"""Decide whether to activate on the installed TensorRT-LLM, do it once, and report what happened.

`M3_EAGLE_PLUGIN=off|auto|require` (default off) is the source of truth; `M3_EAGLE_PLUGIN_FORCE=1`
lifts the manifest's "defer" verdict (and, under `require`, the "untested" one). `auto` never breaks
the host: any mismatch or failure logs one line and leaves it untouched (a failure after the
patches went in, such as another plugin's `m3_eagle_host_ready` hook raising, takes them out
again). `require` raises instead. On a host inside the supported range but not in the tested
list, the activation line is a warning.
Activation is idempotent and thread-safe (one exception: an activation in one thread while another
thread runs the process's first `import tensorrt_llm` can hang both, see `registry`); a process logs
one line saying what was activated. A later `activate("require")` returns an `auto` activation only
where `require` would have taken the host too; otherwise it raises.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterator

from m3_eagle_plugin._bootstrap import is_namespace_spec
from m3_eagle_plugin._version import __version__
from m3_eagle_plugin.log import get_logger
from m3_eagle_plugin.switches import FORCE_ENV, MODE_ENV, MODES, read_switch

HOST_PACKAGE = "tensorrt_llm"


class _SparseConfigProbe(dict):
    """The MiniMax-M3 sparse-attention config that activation and `status` ask the cache-manager hook about:
    read as the host's config object is (`sparse_config.algorithm`, the hook's documented example) and as a
    mapping (`sparse_config["algorithm"]`). As a plain dict, a plugin written as documented answered None,
    and the report named another manager than the one the host then builds."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


_M3_SPARSE_PROBE = _SparseConfigProbe(algorithm="minimax_m3")


class InvalidModeError(ValueError):
    """`M3_EAGLE_PLUGIN` (or the `mode` argument) is not one of off, auto, require."""


class InvalidSwitchError(ValueError):
    """`M3_EAGLE_PLUGIN_FORCE` is neither true (1, true, yes, on) nor false (0, false, no, off, unset)."""


class ActivationError(RuntimeError):
    """`require` mode could not activate the plugin; the message names the cause."""


class IncompleteRollbackError(ActivationError):
    """Activation failed after the host was patched, and taking the patches out failed too: the
    message names both failures and what stays patched."""


@dataclass
class ActivationReport(Mapping):
    """What activation decided and did; reads like a dict (`report["verdict"]`, `dict(report)`)."""

    mode: str
    host: str = HOST_PACKAGE
    host_version: str | None = None
    verdict: str | None = None
    components: dict[str, Any] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    reason: str = ""
    ok: bool = True
    activated: bool = False
    plugin_version: str = __version__
    plugin_errors: list[str] = field(default_factory=list)
    host_report: dict[str, Any] = field(default_factory=dict)  # what the host adapter's install() returned
    fingerprint: str = ""  # plugin version + applied patches: equal on every rank of one deployment

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_mode(mode: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The effective mode: `mode` if given, else `$M3_EAGLE_PLUGIN` (unset or empty: off)."""
    if mode is None:
        raw = (os.environ if environ is None else environ).get(MODE_ENV, "")
        source = f"{MODE_ENV}={raw!r}"
    else:
        if not isinstance(mode, str):
            raise InvalidModeError(f"activate(mode={mode!r}) is not a valid mode; allowed values: {', '.join(MODES)} "
                                   f"(strings), got {type(mode).__name__}")
        raw, source = mode, f"activate(mode={mode!r})"
    value = raw.strip().lower() or "off"
    if value not in MODES:
        raise InvalidModeError(f"{source} is not a valid mode; allowed values: {', '.join(MODES)}")
    return value


def force_requested(environ: Mapping[str, str] | None = None) -> bool:
    """`$M3_EAGLE_PLUGIN_FORCE` as a bool; any other value raises `InvalidSwitchError` (a typo such as
    `force` must not quietly mean "not forced": under `require` it decides whether the host is taken)."""
    on, problem = read_switch(FORCE_ENV, environ)
    if problem is not None:
        raise InvalidSwitchError(problem)
    return on


def host_version(package: str = HOST_PACKAGE) -> tuple[bool, str | None]:
    """(installed?, version) of the host without importing it (unless it is already imported).

    An imported host's own `__version__` wins over the installed metadata: a source checkout on
    `PYTHONPATH` can shadow an installed wheel, and the code that runs is the one to judge."""
    module = sys.modules.get(package)
    imported = getattr(module, "__version__", None) if module is not None else None
    if isinstance(imported, str) and imported.strip():
        return True, imported.strip()
    try:
        return True, importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    if module is not None:
        return True, None
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    return found, None


_lock = threading.RLock()
_active: ActivationReport | None = None
_last: dict[tuple[str, tuple[bool, str | None]], ActivationReport] = {}  # by _decision_key
_in_progress: ActivationReport | None = None  # re-entry guard: install() may import tensorrt_llm
_logged = False


def _decision_key(mode: str) -> tuple[str, tuple[bool, str | None]]:
    """A decision holds for its mode and force switch: the config key may export
    `M3_EAGLE_PLUGIN_FORCE` after this process decided, and processes it spawns decide with it."""
    return mode, read_switch(FORCE_ENV)


def _unknown_version(package: str) -> str:
    return f"{package} is importable but its version is unknown (no dist-info)"


def namespace_host_dirs(package: str = HOST_PACKAGE) -> list[str] | None:
    """The directories of `package` where Python finds it only as a namespace package (no `__init__.py`
    anywhere on sys.path: an incomplete install or a stray directory of that name), else None."""
    module = sys.modules.get(package)
    if module is not None:
        spec = getattr(module, "__spec__", None)
    else:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
    if not is_namespace_spec(spec):
        return None
    return [str(path) for path in spec.submodule_search_locations]


def _namespace_host(package: str, dirs: list[str]) -> str:
    return (f"{package} is a namespace package (no __init__.py in {', '.join(dirs) or 'any directory'}), "
            f"not a TensorRT-LLM install: an incomplete install, or a stray {package} directory on sys.path")


def fingerprint(patches: list[str]) -> str:
    """A short digest of what is active, logged per process so a driver/worker split is visible."""
    import hashlib

    text = "\n".join([__version__, *sorted(patches)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _log_once(message: str, *, warning: bool = False) -> None:
    global _logged
    if _logged:
        return
    _logged = True
    logger = get_logger()
    (logger.warning if warning else logger.info)(message)


def _patch_id(patch: Any) -> str:
    for attr in ("id", "name"):
        value = getattr(patch, attr, None)
        if isinstance(value, str):
            return value
    return repr(patch)


def _collect_components(manager: Any, host: str) -> dict[str, Any]:
    return {
        "model_classes": manager.model_classes(host),
        "kv_cache_manager": manager.kv_cache_manager(host, _M3_SPARSE_PROBE),
        "attention_metadata": manager.attention_metadata(host),
    }


def _verdict_refusal(mode: str, verdict: Any, manifest: Any, force: bool) -> str | None:
    """Why `mode` (auto or require) refuses a host with this manifest verdict, or None."""
    from m3_eagle_plugin.manifest import DEFER, UNSUPPORTED, UNTESTED

    if verdict.status == UNSUPPORTED or (verdict.status == DEFER and mode == "require"):
        return verdict.reason
    if verdict.status == UNTESTED and not force:
        if mode == "require":
            return f"{verdict.reason}; set {FORCE_ENV}=1 to activate anyway"
        if manifest.activation.on_untested_host == "refuse":
            return f"{verdict.reason}; the manifest refuses untested hosts"
    return None


def _judge_host(report: ActivationReport, force: bool | None = None) -> tuple[Any, bool, str | None, bool, Any]:
    """(manifest, installed, version, force, verdict) of the manifest's host; fills `report`'s host,
    host_version, verdict and reason (what activate and status both report first). `force` defaults to
    the switch, a malformed value raising (`force_requested`)."""
    from m3_eagle_plugin.manifest import host_verdict, load_manifest

    manifest = load_manifest()
    installed, version = host_version(manifest.host.package)
    report.host, report.host_version = manifest.host.package, version
    if force is None:
        force = force_requested()
    verdict = host_verdict(version, manifest, force=force)
    report.verdict, report.reason = verdict.status, verdict.reason
    return manifest, installed, version, force, verdict


def _evaluate(mode: str, report: ActivationReport) -> None:
    """Fill `report` and activate; raises ActivationError (require) or returns with ok=False (auto)."""
    global _active
    from m3_eagle_plugin.manifest import DEFER

    manifest, installed, version, force, verdict = _judge_host(report)
    if not installed:
        raise ActivationError(f"{manifest.host.package} is not installed (pip install {manifest.host.package})")
    namespace = namespace_host_dirs(manifest.host.package)
    if namespace is not None:
        raise ActivationError(_namespace_host(manifest.host.package, namespace))
    if version is None:
        raise ActivationError(_unknown_version(manifest.host.package))
    refusal = _verdict_refusal(mode, verdict, manifest, force)
    if refusal is not None:
        raise ActivationError(refusal)
    if verdict.status == DEFER:
        report.ok = True
        return

    from m3_eagle_plugin.registry import get_plugin_manager

    manager = get_plugin_manager()
    report.plugin_errors = [str(error) for error in manager.load_errors]
    if report.plugin_errors and mode == "require":
        raise ActivationError("; ".join(report.plugin_errors))
    report.components = _collect_components(manager, manifest.host.package)
    planned = list(dict.fromkeys(_patch_id(p) for p in manager.host_patches(manifest.host.package)))

    from m3_eagle_plugin.host import trtllm as adapter

    history, recorded, installing = None, 0, True
    try:
        answer = adapter.install()
        installing = False
        installed_report = dict(answer or {})
        report.patches = list(installed_report.get("patches", planned))
        if installed_report.get("models"):
            report.components["registered_models"] = installed_report["models"]
        report.host_report = installed_report
        report.fingerprint = fingerprint(report.patches)
        report.activated, report.ok = True, True
        host_ready = manager.hook.m3_eagle_host_ready
        history = getattr(host_ready, "_call_history", None)
        recorded = len(history) if history is not None else 0
        host_ready.call_historic(kwargs={"host": manifest.host.package, "report": report})
        _active = report  # here, not in the caller: an interrupt in between would leave the host unrecorded
    except BaseException as exc:  # e.g. another plugin's host_ready hook: leave the host as it was found
        if installing and isinstance(exc, Exception):  # install() failing is all-or-nothing itself; an
            raise  # interrupt raised as it returns (a pending Ctrl-C) left it applied
        try:
            _undo_install(adapter, report, history, recorded)
        except Exception as undo_exc:  # noqa: BLE001 - named together with the failure that caused the undo
            raise IncompleteRollbackError(
                f"{type(exc).__name__}: {exc}; undoing the install failed: {undo_exc}") from exc
        raise


def _undo_install(adapter: Any, report: ActivationReport, history: Any, recorded: int) -> None:
    """Take the install out again. The report and pluggy's historic `host_ready` record are reset
    even when undoing fails: the activation failed either way."""
    try:
        adapter.uninstall()
    finally:
        report.patches, report.fingerprint, report.host_report = [], "", {}
        report.components.pop("registered_models", None)
        # pluggy records a historic call before running it and replays it to every plugin
        # registered later: the host is not ready after all, so that call must not stay recorded.
        if history is not None:
            del history[recorded:]


def _require_refusal(active: ActivationReport) -> str | None:
    """Why `require` refuses what `auto` activated (an untested host without the force switch, a plugin
    that failed to load), or None: returning that activation would make `require` pass it silently."""
    try:
        manifest, _, _, force, verdict = _judge_host(ActivationReport(mode="require"))
    except Exception as exc:  # noqa: BLE001 - a malformed force switch, as a fresh require names it
        return f"{type(exc).__name__}: {exc}"
    refusal = _verdict_refusal("require", verdict, manifest, force)
    if refusal is None and active.plugin_errors:
        refusal = "; ".join(active.plugin_errors)
    return refusal


def _export_mode(mode: str | None, resolved: str) -> None:
    """An explicit `activate(mode)` is exported: spawned workers, and the bootstrap when this process
    imports `tensorrt_llm` later, must make the same decision (`off` included)."""
    if mode is not None:
        os.environ[MODE_ENV] = resolved


def activate(mode: str | None = None) -> ActivationReport:
    """Activate on TensorRT-LLM according to `mode` (default `$M3_EAGLE_PLUGIN`); see the module doc."""
    global _in_progress, _logged  # _active is set by _evaluate
    resolved = resolve_mode(mode)
    key = _decision_key(resolved)
    with _lock:
        if _active is not None:
            if resolved == "require" and _active.mode != "require":  # auto activated first (the bootstrap)
                refusal = _require_refusal(_active)
                if refusal is not None:
                    raise ActivationError(f"already activated under {_active.mode}, which require refuses: {refusal}")
            return _active
        if _in_progress is not None:  # same thread, from inside install(): the outer call decides
            return _in_progress
        if resolved == "off":
            _export_mode(mode, resolved)
            return _last.setdefault(key, ActivationReport(mode="off", reason=f"{MODE_ENV} is off"))
        if key in _last:
            return _last[key]
        report = ActivationReport(mode=resolved)
        _in_progress = report
        try:
            _evaluate(resolved, report)
        except Exception as exc:  # noqa: BLE001 - auto must never break the host
            report.ok, report.activated = False, False
            report.reason = str(exc) if isinstance(exc, ActivationError) else f"{type(exc).__name__}: {exc}"
            if resolved == "require":
                _log_once(f"activation failed (require): {report.reason}", warning=True)
                if isinstance(exc, ActivationError):
                    raise
                raise ActivationError(f"activation failed: {report.reason}") from exc
            host_state = "still partly patched" if isinstance(exc, IncompleteRollbackError) else "left untouched"
            _log_once(f"not activated (auto): {report.reason}; TensorRT-LLM {host_state}", warning=True)
            _export_mode(mode, resolved)  # a refusal too: a later host import must not decide again
            _last[key] = report
            return report
        finally:
            _in_progress = None
        _export_mode(mode, resolved)
        if report.activated:
            from m3_eagle_plugin.manifest import UNTESTED  # loaded by _evaluate already

            _logged = False  # a refusal logged before (e.g. before the config key set FORCE) no longer holds
            _log_once(
                f"activated m3-eagle-plugin {__version__} ({resolved}) on {report.host} {report.host_version} "
                f"[{report.verdict}]: model={report.components.get('model_classes')}, "
                f"kv={report.components.get('kv_cache_manager')}, patches={report.patches}, "
                f"fingerprint={report.fingerprint}", warning=report.verdict == UNTESTED
            )
        else:
            _log_once(f"not activated ({resolved}): {report.reason}")
        _last[key] = report
        return report


def status() -> ActivationReport:
    """The active report if activated, else what activation would see now (nothing is patched)."""
    with _lock:
        if _active is not None:
            return _active
    try:
        mode = resolve_mode()
    except InvalidModeError as exc:
        # activating refuses the mode, but the host, its verdict and the components do not depend on
        # it: they are reported as with it unset (the doctor read "version unknown" for a known host)
        report = _status("off")
        if report is not _active:
            report.mode, report.ok = os.environ.get(MODE_ENV, ""), False
            report.reason = f"{exc}; with it unset: {report.reason}"
        return report
    return _status(mode)


def _status(mode: str) -> ActivationReport:
    """`status` for a valid `mode`."""
    report = ActivationReport(mode=mode)
    # a malformed force switch: activating refuses it (below), but the verdict (judged with it unset),
    # the components and the plugin errors do not depend on it, so they are still reported
    force, force_problem = read_switch(FORCE_ENV)
    try:
        manifest, installed, version, force, verdict = _judge_host(report, force)
        if not installed:
            report.reason = f"{manifest.host.package} is not installed"
            report.ok = mode != "require"  # activating would raise (`activate`)
        elif (namespace := namespace_host_dirs(manifest.host.package)) is not None:
            report.reason = _namespace_host(manifest.host.package, namespace)
            report.ok = mode == "off"  # activating refuses it in auto and require
        elif version is None:  # found, so not "not installed" (the verdict's word for no version)
            report.reason = _unknown_version(manifest.host.package)
            report.ok = mode == "off"  # activating refuses it in auto and require
        from m3_eagle_plugin.registry import get_plugin_manager

        manager = get_plugin_manager()
        if _active is not None:  # building it imported the host, and that activated (`on_host_imported`)
            return _active
        report.plugin_errors = [str(error) for error in manager.load_errors]
        report.components = _collect_components(manager, manifest.host.package)
        report.components["reference"] = _collect_components(manager, "reference")
        if installed and version is not None and mode != "off":  # what activating now would decide
            refusal = _verdict_refusal(mode, verdict, manifest, force)
            if refusal is None and mode == "require" and report.plugin_errors:
                refusal = "; ".join(report.plugin_errors)
            if refusal is not None:
                report.ok, report.reason = False, refusal
    except Exception as exc:  # noqa: BLE001 - status reports, it does not fail
        report.ok = False
        failure = f"{type(exc).__name__}: {exc}"
        report.reason = f"{report.reason}; {failure}" if report.reason else failure
    if force_problem is not None:
        report.ok = False
        report.reason = f"{force_problem}; activating (auto or require) refuses it; with it unset: {report.reason}"
    last = _last.get(_decision_key(mode))
    if last is not None and not last.ok:
        report.ok, report.reason = False, last.reason
    return report


def on_host_imported(module: Any) -> None:
    """Called by the bootstrap right after `tensorrt_llm` is imported in this process."""
    try:
        from m3_eagle_plugin.config_key import install_host_hook

        install_host_hook()
    except Exception as exc:  # noqa: BLE001 - the config key is sugar; never break the host import
        get_logger().warning(f"could not watch the host's YAML options for the config key: {exc}")
    registry = sys.modules.get("m3_eagle_plugin.registry")  # not imported yet: no manager is being built
    if registry is None or not registry.when_built(activate):  # else a plugin it loads imported the host
        activate()


def _reset_for_tests() -> None:
    """Forget every decision (tests only; real processes activate at most once)."""
    global _active, _logged, _in_progress
    with _lock:
        _active = None
        _in_progress = None
        _logged = False
        _last.clear()
