"""The plugin manager: where hosts look up model classes, cache managers, metadata, patches, drafters.

`M3PluginManager` registers the built-in implementation as one plugin, then loads third-party plugins
from the entry-point group `m3_eagle_plugin`, one at a time: a broken plugin is recorded in
`load_errors` (and logged) instead of aborting the others; callers that must not run degraded
(`M3_EAGLE_PLUGIN=require`) turn those errors into a failure. `M3_EAGLE_PLUGIN_LOAD` is an allow-list
of entry-point names ("" = third-party plugins off). Nothing is left out without a line naming the
entry point and its distribution: a name the allow-list asks for that no distribution declares, and an
entry point whose name another plugin already holds (a third-party `builtin` included), are load
errors (the user would otherwise run without a plugin they installed or asked for); one the
allow-list leaves out, a blocked name, or a second name for a plugin already registered is recorded
in `skipped`. The package's own `builtin` entry point names the plugin registered first: not a clash.
`M3_EAGLE_PLUGIN_TRACE=1` logs every hook call (another value than a switch logs a warning and leaves
tracing off; `m3-eagle doctor` fails on it).
`get_plugin_manager()` is the per-process singleton; `make_plugin_manager()` builds hermetic ones.

Known limitation (threads): building the singleton holds this module's lock while plugins import,
and the first `import tensorrt_llm` activates from inside that import, which holds the host's
import lock, and asks for the manager. So a plugin whose module imports `tensorrt_llm`, loaded by
one thread's first `get_plugin_manager()` (or `activate()`, `status()`) while another thread's first
`import tensorrt_llm` runs, hangs both threads (Python detects such cycles between module import
locks only); so does an `activate()` whose install imports `tensorrt_llm` meanwhile (activation's
lock). Importing `tensorrt_llm` once before starting such threads avoids it; one thread, or
separate processes, never meet it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable, Iterator, Mapping

import pluggy

from m3_eagle_plugin._ints import exact_index
from m3_eagle_plugin.hooks import PROJECT_NAME, DraftContext, M3EagleSpecs
from m3_eagle_plugin.log import get_logger
from m3_eagle_plugin.switches import TRACE_ENV, read_switch

ENTRY_POINT_GROUP = "m3_eagle_plugin"
BUILTIN_NAME = "builtin"
LOAD_ENV = "M3_EAGLE_PLUGIN_LOAD"


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered (raised only where failure must be fatal)."""


class PluginConflictError(PluginError):
    """Two plugins claim the same component with different implementations."""


class ResolveError(ImportError):
    """A "module:qualname" reference does not resolve to an object."""


def _entry_point(name: str, value: str, distribution: str | None) -> str:
    """'plugin NAME (VALUE from DIST)', the parts known."""
    dist = f" from {distribution}" if distribution else ""
    return f"plugin {name!r}" + (f" ({value}{dist})" if value else "")


@dataclass(frozen=True)
class _EntryPointRecord:
    """An entry point the manager did not load: its name, value ("module:object") and distribution."""

    name: str
    value: str
    distribution: str | None

    def _label(self) -> str:
        return _entry_point(self.name, self.value, self.distribution)


@dataclass(frozen=True)
class PluginLoadError(_EntryPointRecord):
    error: str

    def __str__(self) -> str:
        return f"{self._label()} failed to load: {self.error}"


@dataclass(frozen=True)
class PluginSkip(_EntryPointRecord):
    """An entry point deliberately not loaded (allow-list, blocked name, plugin already registered)."""

    reason: str

    def __str__(self) -> str:
        return f"{self._label()} not loaded: {self.reason}"


def resolve(reference: str) -> Any:
    """Import "package.module:Qual.name" and return the object it names."""
    if not isinstance(reference, str):
        raise TypeError(f"resolve() expects a 'module:qualname' string, got {type(reference).__name__}")
    module_name, sep, qualname = reference.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"resolve() expects 'module:qualname', got {reference!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ResolveError(f"cannot import module {module_name!r} for {reference!r}: {exc}") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ResolveError(f"{reference!r}: {module_name!r} has no attribute path {qualname!r}") from exc
    return obj


def trace_from_env(environ: Mapping[str, str] | None = None) -> tuple[bool, str | None]:
    """(trace?, None) from `$M3_EAGLE_PLUGIN_TRACE`, or (False, why the value is not a switch): a typo
    must not quietly mean "no trace", and a manager must not fail over it (hosts build one mid-run)."""
    on, problem = read_switch(TRACE_ENV, environ)
    return on, None if problem is None else f"{problem}; tracing stays off"


def _same_value(a: str, b: str) -> bool:
    """Two entry-point values name the same object ("pkg.mod:obj", spaces aside)."""
    return "".join(a.split()) == "".join(b.split())


def _allow_list(environ: Mapping[str, str]) -> set[str] | None:
    raw = environ.get(LOAD_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


class M3PluginManager(pluggy.PluginManager):
    """pluggy manager for project "m3_eagle_plugin" with safe entry-point loading and conflict checks."""

    def __init__(self, *, register_builtin: bool = True, trace: bool | None = None) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(M3EagleSpecs)
        self.load_errors: list[PluginLoadError] = []
        self.skipped: list[PluginSkip] = []
        self.distributions: dict[str, str] = {}  # plugin name -> "dist-name version" (entry points)
        self._entry_values: dict[str, str] = {}  # plugin name -> entry-point value it was loaded from
        self._undo_trace: Callable[[], None] | None = None
        if register_builtin:
            from m3_eagle_plugin import builtin

            self.register(builtin, name=BUILTIN_NAME)
        if trace is None:
            trace, problem = trace_from_env()
            if problem is not None:
                get_logger().warning(problem)
        if trace:
            self.enable_trace()

    # -- loading ---------------------------------------------------------------------------------
    def load_entrypoints(self, group: str = ENTRY_POINT_GROUP, *, strict: bool = False,
                         entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> list[str]:
        """Load and register every entry point of `group`; returns the names registered.

        A failing plugin (one that raises, implements an unknown hook, takes a name another plugin holds,
        or is named in `M3_EAGLE_PLUGIN_LOAD` but not installed) is recorded in `load_errors` and logged;
        with `strict` it raises `PluginError`. One left out on purpose is recorded in `skipped`, logged.
        """
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=group)
        allowed = _allow_list(os.environ)
        loaded: list[str] = []
        seen: set[str] = set()

        def fail(failure: PluginLoadError, exc: BaseException | None = None) -> None:
            self.load_errors.append(failure)
            get_logger().warning(str(failure))
            if strict:
                raise PluginError(str(failure)) from exc

        for ep in entry_points:
            seen.add(ep.name)
            ep_dist = getattr(ep, "dist", None)
            dist = getattr(ep_dist, "name", None)
            registered = self.get_plugin(ep.name)
            if registered is not None and _same_value(ep.value, self._source_of(ep.name)):
                continue  # this entry point is what holds the name (the package's own `builtin`, a second load)
            if allowed is not None and ep.name not in allowed:
                self._skip(PluginSkip(ep.name, ep.value, dist, f"not in {LOAD_ENV}={os.environ[LOAD_ENV]!r}"))
                continue
            if self.is_blocked(ep.name):
                self._skip(PluginSkip(ep.name, ep.value, dist, "the name is blocked in this plugin manager"))
                continue
            if registered is not None:
                fail(PluginLoadError(ep.name, ep.value, dist, f"the name {ep.name!r} is already taken by "
                                     f"{self._describe(ep.name)}; entry-point names in group {group!r} must be unique"))
                continue
            try:
                plugin = ep.load()
                if self.is_registered(plugin):
                    self._skip(PluginSkip(ep.name, ep.value, dist,
                                          f"the same plugin is already registered as {self.get_name(plugin)!r}"))
                    continue
                self.register(plugin, name=ep.name)
                unknown = self._unknown_hooks(plugin)
                if unknown:  # check_pending() below would otherwise fail the whole manager
                    self.unregister(plugin)
                    raise pluggy.PluginValidationError(plugin, f"implements unknown hook(s) {unknown}")
                self._entry_values[ep.name] = ep.value
                if dist is not None:
                    self.distributions[ep.name] = f"{dist} {ep_dist.version}"
            except Exception as exc:  # a broken plugin must not take the others down
                if self.get_plugin(ep.name) is not None:  # pluggy < 1.7 keeps the hookimpls it took before failing
                    self.unregister(name=ep.name)
                fail(PluginLoadError(ep.name, ep.value, dist, f"{type(exc).__name__}: {exc}"), exc)
                continue
            loaded.append(ep.name)
        for name in sorted((allowed or set()) - seen):
            if self.get_plugin(name) is None:  # asked for by name: running without it is not what was asked
                fail(PluginLoadError(name, "", None, f"{LOAD_ENV} names it, but it is not installed (no "
                                     f"distribution declares an entry point {name!r} in group {group!r})"))
        self.check_pending()
        return loaded

    def _skip(self, skip: PluginSkip) -> None:
        self.skipped.append(skip)
        get_logger().info(str(skip))

    def _source_of(self, name: str) -> str:
        """What holds `name`: the entry-point value it was loaded from, else "module" or "module:Class"."""
        if name in self._entry_values:
            return self._entry_values[name]
        plugin = self.get_plugin(name)
        if isinstance(plugin, ModuleType):
            return plugin.__name__
        cls = plugin if isinstance(plugin, type) else type(plugin)
        return f"{cls.__module__}:{cls.__qualname__}"

    def _describe(self, name: str) -> str:
        return _entry_point(name, self._source_of(name), self.distributions.get(name))

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """Hooks `plugin` implements that no spec declares (and are not marked optional)."""
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or ()
                      if not caller.has_spec()
                      and any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls()))

    # -- tracing ---------------------------------------------------------------------------------
    def enable_trace(self, writer: Callable[[str], None] | None = None) -> None:
        """Log every hook call (name, implementing plugins, arguments, outcome)."""
        if self._undo_trace is not None:
            return
        write = writer or get_logger().info

        def before(hook_name: str, impls: list, kwargs: dict) -> None:
            write(f"hook {hook_name}({kwargs}) -> impls {[impl.plugin_name for impl in impls]}")

        def after(outcome: Any, hook_name: str, impls: list, kwargs: dict) -> None:
            try:
                write(f"hook {hook_name} returned {outcome.get_result()!r}")
            except BaseException as exc:  # noqa: BLE001 - report, the caller sees the exception
                write(f"hook {hook_name} raised {type(exc).__name__}: {exc}")

        self._undo_trace = self.add_hookcall_monitoring(before, after)

    def disable_trace(self) -> None:
        if self._undo_trace is not None:
            self._undo_trace()
            self._undo_trace = None

    # -- queries used by hosts -------------------------------------------------------------------
    def model_classes(self, host: str) -> dict[str, str]:
        """Architecture -> "module:qualname", merged over all plugins; conflicting claims raise."""
        merged: dict[str, str] = {}
        owner: dict[str, str] = {}
        for plugin_name, results in self._per_plugin("m3_eagle_model_classes", host=host):
            for result in results:
                if not isinstance(result, dict):
                    raise PluginError(
                        f"plugin {plugin_name!r}: m3_eagle_model_classes must return a dict, "
                        f"got {type(result).__name__}"
                    )
                for arch, reference in result.items():
                    if arch in merged and merged[arch] != reference:
                        raise PluginConflictError(
                            f"architecture {arch!r} claimed by plugin {owner[arch]!r} ({merged[arch]}) "
                            f"and plugin {plugin_name!r} ({reference})"
                        )
                    merged[arch] = reference
                    owner[arch] = plugin_name
        return merged

    def _per_plugin(self, name: str, **kwargs: Any) -> Iterator[tuple[str, list[Any]]]:
        """(plugin name, its answers) for each plugin implementing hook ``name``, in pluggy's call
        order, each called through pluggy (traced; a wrapper runs as one), so every answer has its owner."""
        impls = list(reversed(getattr(self.hook, name).get_hookimpls()))
        owners = []  # once each: a plugin may implement the hook twice (pluggy's `specname`)
        for impl in impls:
            if not any(impl.plugin is owner.plugin for owner in owners):
                owners.append(impl)
        for impl in owners:
            others = [other.plugin for other in impls if other.plugin is not impl.plugin]
            try:
                answers = self.subset_hook_caller(name, others)(**kwargs)
            except Exception as exc:  # a bare "RuntimeError: boom" in the activation line named no plugin
                raise PluginError(f"plugin {impl.plugin_name!r}: {name} raised {type(exc).__name__}: {exc}") from exc
            yield impl.plugin_name, answers

    def kv_cache_manager(self, host: str, sparse_config: Any) -> str | None:
        return self.hook.m3_eagle_kv_cache_manager(host=host, sparse_config=sparse_config)

    def attention_metadata(self, host: str) -> str | None:
        return self.hook.m3_eagle_attention_metadata(host=host)

    def host_patches(self, host: str) -> list[Any]:
        patches: list[Any] = []
        for plugin_name, results in self._per_plugin("m3_eagle_host_patches", host=host):
            for result in results:
                if not isinstance(result, (list, tuple)):  # a lone patch, or a string read as its letters
                    raise PluginError(f"plugin {plugin_name!r}: m3_eagle_host_patches must return a list "
                                      f"of patches, got {type(result).__name__} {result!r}")
                patches.extend(result)
        return patches

    def propose_drafts(self, context: DraftContext) -> list[list[int]] | None:
        """Drafts from the first drafter plugin that answers, or None (use the Eagle3 head); validates the
        answer's shape. A malformed answer, or one that raises while it is read (its rows, or a row's ids,
        from generators), is a PluginError naming the plugin. With a wrapper among the implementations
        the hook runs once through pluggy, the wrappers around the drafters (called plugin by plugin, a
        wrapper saw no drafter's answer and the drafters' went out unwrapped), and errors name them all."""
        for owner, drafts in self._drafter_answers(context):
            if drafts is not None:
                break
        else:
            return None
        hook = f"{owner}: m3_eagle_propose_drafts"
        try:
            rows = _rows(drafts)
        except Exception as exc:
            raise PluginError(f"{hook}: reading its answer raised {type(exc).__name__}: {exc}") from exc
        lengths = None if rows is None else [len(row) for row in rows]
        if lengths is None or len(lengths) != len(context.request_ids) or any(n != context.draft_len for n in lengths):
            got = f"{lengths} tokens" if lengths is not None else repr(drafts)
            raise PluginError(
                f"{hook} returned {got} for {len(context.request_ids)} requests; expected a list "
                f"of {context.draft_len} token ids each"
            )
        return [[_token_id(t, rid, hook) for t in row] for rid, row in zip(context.request_ids, rows)]

    def _drafter_answers(self, context: DraftContext) -> Iterator[tuple[str, Any]]:
        """(who answered, the answer) of `m3_eagle_propose_drafts`, plugin by plugin where no wrapper needs
        the whole call."""
        impls = self.hook.m3_eagle_propose_drafts.get_hookimpls()
        if not any(impl.wrapper or impl.hookwrapper for impl in impls):
            for plugin_name, drafts in self._per_plugin("m3_eagle_propose_drafts", context=context):
                yield f"plugin {plugin_name!r}", drafts
            return
        owner = "plugins " + ", ".join(repr(name) for name in dict.fromkeys(i.plugin_name for i in reversed(impls)))
        try:
            drafts = self.hook.m3_eagle_propose_drafts(context=context)
        except Exception as exc:
            raise PluginError(f"{owner}: m3_eagle_propose_drafts raised {type(exc).__name__}: {exc}") from exc
        yield owner, drafts

    def plugin_summary(self) -> list[dict[str, Any]]:
        """One row per registered plugin: name, distribution/version, implemented hooks."""
        rows = []
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                continue
            hooks = sorted(caller.name for caller in (self.get_hookcallers(plugin) or []))
            rows.append({
                "name": name,
                "module": getattr(plugin, "__name__", type(plugin).__name__) if isinstance(plugin, ModuleType)
                else type(plugin).__name__,
                "distribution": self.distributions.get(name),
                "hooks": hooks,
            })
        return rows


def _rows(drafts: Any) -> list[list[Any]] | None:
    """A drafter's answer as one list per request, read once (a generator's rows were counted, then
    zipped from the exhausted generator: no drafts at all), or None when it is not rows of ids.
    An exception raised while reading it (a generator's body) is the drafter's own, and propagates."""
    if isinstance(drafts, (str, bytes)):
        return None
    try:  # iter() alone: a TypeError raised inside a generator's body is the drafter's own
        answer = iter(drafts)
    except TypeError:
        return None
    rows = []
    for row in answer:
        if isinstance(row, (str, bytes)):
            return None
        try:  # likewise for each row (a TypeError inside it was read as "not rows of ids")
            ids = iter(row)
        except TypeError:
            return None
        rows.append(list(ids))
    return rows


def _token_id(token: Any, rid: Any, hook: str) -> int:
    """A drafter's token as an int, else PluginError: `int` would quietly turn 2.7 into 2 or "3"
    into 3, and the host would verify a token never proposed."""
    index = exact_index(token)
    if index is None:
        raise PluginError(f"{hook} returned {token!r} for request {rid}; token ids must be ints")
    return index


def make_plugin_manager(*, autoload: bool = False, strict: bool = False, register_builtin: bool = True,
                        trace: bool | None = None) -> M3PluginManager:
    """A fresh manager (hermetic by default: no entry points are loaded)."""
    manager = M3PluginManager(register_builtin=register_builtin, trace=trace)
    if autoload:
        manager.load_entrypoints(strict=strict)
    else:
        manager.check_pending()
    return manager


_singleton: M3PluginManager | None = None
_singleton_lock = threading.RLock()
_building = False
_when_built: list[Callable[[], Any]] = []


def get_plugin_manager(autoload: bool = True) -> M3PluginManager:
    """The process-wide manager, built on first use (with entry points unless `autoload=False`)."""
    global _singleton, _building
    with _singleton_lock:
        if _singleton is not None:
            return _singleton
        if _building:
            raise PluginError("the plugin manager was asked for while it is loading its plugins "
                              "(from a plugin's import); ask for it after the import")
        _building = True
        try:
            manager = _singleton = make_plugin_manager(autoload=autoload)
        finally:
            _building = False
            pending, _when_built[:] = _when_built[:], []
    for callback in pending:  # outside the lock: activating takes its own lock, then this one
        callback()
    return manager


def when_built(callback: Callable[[], Any]) -> bool:
    """Run `callback` right after the manager this thread is building is built (False, not run: none
    is being built here). A plugin whose import imports `tensorrt_llm` activates the plugin
    (`_bootstrap`), which needs the manager still loading that plugin."""
    with _singleton_lock:  # another thread's build: waited for, then done
        if not _building:
            return False
        _when_built.append(callback)
        return True


def trace_switched_on() -> None:
    """`$M3_EAGLE_PLUGIN_TRACE` was set to 1 after the process-wide manager was built (the config key,
    read after the environment activated): that manager traces from now on, as one built now would."""
    with _singleton_lock:
        if _singleton is not None:
            _singleton.enable_trace()


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (tests, or after installing a plugin at runtime)."""
    global _singleton
    with _singleton_lock:
        _singleton = None
