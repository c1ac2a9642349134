"""`m3-eagle doctor`: what is installed, what the manifest says about it, and what is active.

The one command an operator runs when something looks wrong: plugin version, mode, host found and
version, manifest verdict, registered plugins and components (and the plugins left out, with why),
patches applied (or why not), the kernel backend choice (FlashInfer's status, the measured table in
force and its verdict per shape), and optionally a static check of a TensorRT-LLM source tree (no
import) against every host symbol the adapter touches. `--json` prints the same as one JSON object.
It exits 1 when anything would fail or run otherwise than asked, a malformed setting included.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from typing import Any

from m3_eagle_plugin.cli import path_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--host-source", metavar="DIR", default=None, type=path_option,
                        help="statically check a TensorRT-LLM source tree for every host symbol the adapter uses")


def _optional_call(module_name: str, function: str, *args: Any) -> tuple[Any, str | None]:
    """Call module.function(*args) if both exist; (result, None) or (None, why not)."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return None, f"{module_name} unavailable: {exc}"
    target = getattr(module, function, None)
    if target is None:
        return None, f"{module_name}.{function} not provided"
    try:
        return target(*args), None
    except Exception as exc:  # noqa: BLE001 - doctor reports, it does not crash
        return None, f"{module_name}.{function} failed: {type(exc).__name__}: {exc}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return _jsonable(asdict(value))
    return repr(value)


def _override_table_error() -> str | None:
    """Why the table `M3_EAGLE_KERNEL_TABLE` names cannot be used, or None (unset, or fine)."""
    try:
        from m3_eagle_plugin.msa.kernels import kernel_table
    except ImportError as exc:
        return f"m3_eagle_plugin.msa.kernels unavailable: {exc}"
    try:
        kernel_table.check_override()
    except kernel_table.KernelTableError as exc:  # names the file and the problem
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - doctor reports, it does not crash
        return f"{type(exc).__name__}: {exc}"
    return None


def _setting_errors() -> list[str]:
    """Plugin settings that are not values the README allows: the log level and the trace switch
    (their readers warn and fall back, so only the doctor can fail on them) and the mode and the force
    switch (activation refuses them too; named here beside the others)."""
    from m3_eagle_plugin.activation import InvalidModeError, resolve_mode
    from m3_eagle_plugin.log import level_from_env
    from m3_eagle_plugin.registry import trace_from_env
    from m3_eagle_plugin.switches import FORCE_ENV, read_switch

    try:
        resolve_mode()
        mode_problem = None
    except InvalidModeError as exc:
        mode_problem = str(exc)
    checks = ((None, mode_problem), level_from_env(), trace_from_env(), read_switch(FORCE_ENV))
    return [problem for _, problem in checks if problem is not None] + _kernel_setting_errors()


def _kernel_setting_errors() -> list[str]:
    """The kernel backend choice `M3_EAGLE_KERNELS` and the kernels' switches (hand-off, PDL, replay)
    that hold a value their readers refuse (every kernel call would raise), each named; the backend
    report stops at the first of them, so it is named there too."""
    try:
        from m3_eagle_plugin.msa.kernels._common import SWITCHES, KernelInputError, env_switch
        from m3_eagle_plugin.msa.kernels.backend import requested_backend
    except ImportError:  # the kernel backend row says why
        return []
    problems = []
    for read in (requested_backend, *(lambda name=name: env_switch(name) for name in SWITCHES)):
        try:
            read()
        except KernelInputError as exc:
            problems.append(str(exc))
    return problems


def _why_not_patched(report: dict[str, Any], host_found: bool) -> str:
    """Why `status()`'s `report` has nothing patched: a missing host or a refusal first, else the mode being
    off, else (a host activating would take) that this process never imported it; not a verdict that
    says all is well."""
    from m3_eagle_plugin.manifest import DEFER
    from m3_eagle_plugin.switches import MODE_ENV

    if not host_found or not report["ok"]:
        return report["reason"] or f"mode is {report['mode']}"
    if report["mode"] == "off":  # before a defer: its "set ..._FORCE=1 to override" alone would patch nothing
        return f"{MODE_ENV} is off"
    if report["verdict"] == DEFER:
        return report["reason"]
    return (f"{report['host']} is not imported by the doctor; {MODE_ENV}={report['mode']} activates when "
            f"{report['host']} is imported")


def collect(host_source: str | None = None) -> dict[str, Any]:
    """Everything the doctor prints, as plain data."""
    from m3_eagle_plugin import __version__
    from m3_eagle_plugin.activation import host_version, status

    report = status().to_dict()
    host_found, _ = host_version(report["host"])
    data: dict[str, Any] = {
        "plugin_version": __version__,
        "mode": report["mode"],
        "host": report["host"],
        "host_found": host_found,
        "host_version": report["host_version"],
        "verdict": report["verdict"],
        "reason": report["reason"],
        "activated": report["activated"],
        "components": report["components"],
        "patches_applied": report["patches"],
        "plugin_errors": report["plugin_errors"],
        "ok": report["ok"],
    }
    data["setting_errors"] = _setting_errors()
    if data["setting_errors"] or data["plugin_errors"]:  # a plugin installed or asked for would not run
        data["ok"] = False
    try:
        from m3_eagle_plugin.manifest import load_manifest

        manifest = load_manifest()
        data["manifest"] = {
            "source": manifest.source,
            "host_requires": str(manifest.host.requires),
            "tested": list(manifest.host.tested),
            "defer_from": None if manifest.host.defer_from is None else str(manifest.host.defer_from),
            "patches": [record.id for record in manifest.patches],
        }
    except Exception as exc:  # noqa: BLE001
        data["manifest"] = {"error": f"{type(exc).__name__}: {exc}"}
        data["ok"] = False
    if not data["patches_applied"]:
        data["patches_reason"] = "not activated: " + _why_not_patched(report, host_found)
    try:
        from m3_eagle_plugin.registry import get_plugin_manager

        manager = get_plugin_manager()
        data["plugins"] = manager.plugin_summary()
        data["plugins_skipped"] = [str(skip) for skip in manager.skipped]  # left out on purpose, with why
    except Exception as exc:  # noqa: BLE001
        data["plugins"] = [{"error": f"{type(exc).__name__}: {exc}"}]
        data["plugins_skipped"] = []
    adapter, why = _optional_call("m3_eagle_plugin.host.trtllm", "report")
    data["adapter"] = adapter if why is None else {"unavailable": why}
    backend, why = _optional_call("m3_eagle_plugin.msa.kernels", "backend_report")
    data["kernel_backend"] = backend if why is None else {"unavailable": why}
    if why is not None and " failed: " in why:
        data["ok"] = False  # e.g. a bad M3_EAGLE_KERNELS, which every kernel call would refuse
        table_error = _override_table_error()
        if table_error is not None:  # the report stopped before the table: name it all the same
            data["kernel_backend"]["kernel_table"] = {"error": table_error}
    if "error" in data["kernel_backend"]:
        data["ok"] = False  # a forced backend that cannot run here: `m3-eagle run` and every kernel call refuse it
    if "error" in (data["kernel_backend"].get("kernel_table") or {}):
        data["ok"] = False  # a broken M3_EAGLE_KERNEL_TABLE would raise at the first eligible call
    if host_source is not None:
        findings, why = _optional_call("m3_eagle_plugin.host.trtllm.contract", "check_source_tree", host_source)
        data["host_source"] = {"dir": host_source, "findings": findings} if why is None else {
            "dir": host_source, "error": why}
        if why is not None or not all(getattr(f, "ok", False) for f in findings):
            data["ok"] = False
    return _jsonable(data)


def _format_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return "-" if value is None else str(value)


def _kernel_rows(backend: dict[str, Any]) -> list[tuple[str, Any]]:
    """The kernel backend row, then FlashInfer's status, the measured table in force and the
    table's verdict per kernel and measured shape, one row each."""
    backend = dict(backend)
    fi, table, verdicts = (backend.pop(k, None) for k in ("flashinfer", "kernel_table", "table_verdicts"))
    rows: list[tuple[str, Any]] = [("kernel backend", backend)]
    if fi is not None:
        rows.append(("flashinfer", f"{fi['status']}; device: {fi['device']}; {fi['policy']}"))
    if table is not None:
        rows.append(("kernel table", table["error"] if "error" in table else
                     f"{table['source']} ({table['device']}, {table['date']}, `{table['command']}`; "
                     f"applies here: {table['applies']})"))
    for name, lines in (verdicts or {}).items():
        rows.append((f"  {name}", "; ".join(lines)))
    return rows


def render_table(data: dict[str, Any]) -> str:
    rows = [
        ("plugin version", data["plugin_version"]),
        ("mode", data["mode"]),
        ("setting errors", data["setting_errors"] or None),
        ("host", f"{data['host']} "
                 f"{data['host_version'] or ('(version unknown)' if data['host_found'] else '(not found)')}"),
        ("manifest verdict", f"{data['verdict']}: {data['reason']}"),
        ("manifest", data["manifest"]),
        ("activated", data["activated"]),
        ("patches applied", data["patches_applied"] or data.get("patches_reason")),
        ("model classes", data["components"].get("model_classes")),
        ("kv cache manager", data["components"].get("kv_cache_manager")),
        ("attention metadata", data["components"].get("attention_metadata")),
        ("reference host", data["components"].get("reference")),
        ("plugins", [p["error"] if "error" in p else f"{p.get('name')} ({p.get('distribution') or p.get('module')})"
                     for p in data["plugins"]]),
        ("plugins skipped", data["plugins_skipped"] or None),
        ("plugin errors", data["plugin_errors"] or None),
        ("host adapter", data["adapter"]),
        *_kernel_rows(data["kernel_backend"]),
    ]
    if "host_source" in data:
        rows.append(("host source check", data["host_source"]))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {_format_value(value)}" for name, value in rows)


def main(args: argparse.Namespace) -> int:
    as_json = getattr(args, "json", False)
    # --json: stdout holds the one JSON object; what collecting prints goes to stderr (TensorRT-LLM prints
    # its version line when imported, e.g. by a third-party plugin's module that the manager loads)
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        data = collect(host_source=getattr(args, "host_source", None))
    if not as_json:
        print(render_table(data))
    elif sys.stdout is not None:  # None: started with stdout closed (`>&-`), nothing to write to, as for print()
        json.dump(data, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    return 0 if data["ok"] else 1
