"""An all-or-nothing, revertible, idempotent patch engine for TensorRT-LLM symbols.

TensorRT-LLM has no extension points for the KV-manager choice, the draft-KV policy or the
trtllm-gen page-size allowlist, so the adapter wraps host functions. Wrapping is only safe if it
is atomic (a half-patched host would route one process differently from another), revertible
(tests, `uninstall()`), refuses to wrap a wrapper (double activation, also by another engine
racing in another thread), and also rebinds the names other modules copied with
`from X import name` at import time. This module does exactly that and records what it did for
`m3-eagle doctor`. When undoing itself fails, it still undoes everything else and reports what
stays patched and why.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from m3_eagle_plugin.host.trtllm.contract import (
    HostSymbol,
    HostSymbolMissing,
    leading_params_match,
    resolve_owner,
)

PATCH_MARK = "__m3_eagle_patch__"

WrapperFactory = Callable[[Callable[..., Any]], Callable[..., Any]]
Step = Callable[[], Callable[[], None]]  # performs a change, returns its undo
_Undo = tuple[str, Callable[[], None]]  # (name of the step it undoes, the undo)

# Shared by every engine: host names are checked and bound (or restored) only while holding it, so
# two engines can never both wrap the same host. Engines take their own lock first, then this one.
_BIND_LOCK = threading.RLock()


class HostPatchError(RuntimeError):
    """Patching (or unpatching) the host failed. The message names the cause and anything left patched."""


@dataclass(frozen=True)
class Patch:
    """Wrap `target` with `factory(original)` and rebind the result wherever `rebinds` copied it.

    `rebinds` are the namespaces (package `__init__`s, `pyexecutor._util`, ...) that bound the
    target's name at import time; each must currently hold the very same original object (a
    package that serves the name lazily through a module `__getattr__` holds none and needs none).
    """

    id: str
    target: HostSymbol
    factory: WrapperFactory
    rebinds: tuple[HostSymbol, ...] = ()


@dataclass
class _Binding:
    patch_id: str
    owner: Any
    name: str
    original: Any
    replacement: Any
    had_own: bool  # False when the original was inherited (revert deletes instead of restoring)

    @property
    def label(self) -> str:
        owner_name = getattr(self.owner, "__qualname__", getattr(self.owner, "__name__", self.owner))
        return f"{getattr(self.owner, '__module__', '')}:{owner_name}.{self.name}".lstrip(":")


@dataclass
class _State:
    bindings: list[_Binding] = field(default_factory=list)
    undos: list[_Undo] = field(default_factory=list)
    patch_ids: tuple[str, ...] = ()
    step_names: tuple[str, ...] = ()
    error: str | None = None
    revert_notes: list[str] = field(default_factory=list)
    still_patched: list[str] = field(default_factory=list)  # non-empty after an incomplete rollback


@dataclass
class _Rollback:
    """What a rollback could not undo: kept so that `revert()` can try again."""

    undos: list[_Undo]
    bindings: list[_Binding]
    failures: list[str]


def _owner_value(owner: Any, name: str) -> tuple[Any, bool]:
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    if name in own:
        return own[name], True
    return getattr(owner, name), False


def _reads_through(owner: Any, name: str, original: Any) -> bool:
    """True when `owner` binds no `name` of its own but a module `__getattr__` (PEP 562) serves the
    original on access: it forwards to the definer each time, so it needs no rebind."""
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    if name in own or not callable(own.get("__getattr__")):
        return False
    try:
        return getattr(owner, name) is original
    except AttributeError:
        return False


def _wraps(outer: Any, inner: Any) -> bool:
    """True when `inner` is reached from `outer` through `__wrapped__` links (what `functools.wraps` sets)."""
    try:
        return inspect.unwrap(outer, stop=lambda f: f is inner) is inner
    except ValueError:  # a `__wrapped__` cycle
        return False


def _restore(binding: _Binding, notes: list[str]) -> None:
    current = vars(binding.owner).get(binding.name) if hasattr(binding.owner, "__dict__") else None
    if current is not binding.replacement:
        if current is not None and _wraps(current, binding.replacement):
            # restoring the original would drop their wrapper; leaving it keeps ours running inside theirs
            raise HostPatchError(f"wrapped since by {current!r}, which still calls the plugin's wrapper; "
                                 "revert again once that wrapper is removed")
        notes.append(f"{binding.label} was re-bound by someone else; left as is")
        return
    if binding.had_own:
        setattr(binding.owner, binding.name, binding.original)
    else:
        delattr(binding.owner, binding.name)


def _roll_back(undos: Sequence[_Undo], bindings: Sequence[_Binding], notes: list[str]) -> _Rollback:
    """Run every undo (newest first), then restore every binding; a failure never stops the rest."""
    left_undos: list[_Undo] = []
    left_bindings: list[_Binding] = []
    failures: list[str] = []
    for name, undo in reversed(undos):
        try:
            undo()
        except Exception as exc:  # noqa: BLE001 - collected, reported and kept for a later revert
            left_undos.append((name, undo))
            failures.append(f"step {name!r} is still in effect: its undo raised {type(exc).__name__}: {exc}")
    for binding in reversed(bindings):
        try:
            _restore(binding, notes)
        except Exception as exc:  # noqa: BLE001 - collected, reported and kept for a later revert
            left_bindings.append(binding)
            failures.append(f"{binding.patch_id}: {binding.label} is still patched: restoring it raised "
                            f"{type(exc).__name__}: {exc}")
    return _Rollback(left_undos[::-1], left_bindings[::-1], failures)


def _resolved_owner(patch: Patch, sym: HostSymbol) -> Any:
    try:
        return resolve_owner(sym)[1]
    except HostSymbolMissing as exc:
        raise HostPatchError(f"patch {patch.id!r}: {exc}") from None
    except Exception as exc:  # a host module that exists but fails to import (a CUDA library, say)
        raise HostPatchError(f"patch {patch.id!r}: importing {' | '.join(sym.modules)} for {sym.attribute!r} "
                             f"failed: {type(exc).__name__}: {exc}; nothing was patched") from exc


def _check_unchanged_since_plan(binding: _Binding) -> None:
    """Re-check at bind time (under `_BIND_LOCK`) that the host still holds what was planned against."""
    try:
        current, had_own = _owner_value(binding.owner, binding.name)
    except AttributeError:
        raise HostPatchError(f"patch {binding.patch_id!r}: {binding.label} vanished while the patches were "
                             "planned; nothing was patched") from None
    if current is binding.original and had_own == binding.had_own:
        return
    mark = getattr(current, PATCH_MARK, None)
    if mark is not None:
        raise HostPatchError(f"patch {binding.patch_id!r}: {binding.label} is already wrapped by patch {mark!r}: "
                             "another engine patched the host while this one was planning; this engine patched "
                             "nothing")
    raise HostPatchError(f"patch {binding.patch_id!r}: {binding.label} was re-bound to {current!r} while the "
                         "patches were planned; nothing was patched")


class PatchEngine:
    """Applies a set of patches (plus optional extra steps) atomically; thread-safe across engines."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state = _State()

    @property
    def applied(self) -> bool:
        """True when this engine's whole patch set is in place (not after an incomplete rollback)."""
        s = self._state
        return bool(s.bindings or s.undos) and not s.still_patched

    def apply(self, patches: Sequence[Patch], steps: Sequence[Step] = ()) -> dict:
        """Apply every patch, then every step; on any failure revert all and raise HostPatchError.

        Applying the same patch set again is a no-op that returns the current report; applying a
        different set while one is applied is refused (revert first), and so is applying after a
        rollback that left something patched. If another engine wrapped a target meanwhile, this
        engine patches nothing and says so.
        """
        ids = tuple(p.id for p in patches)
        step_names = tuple(getattr(s, "__name__", repr(s)) for s in steps)
        with self._lock:
            if self._state.still_patched:
                raise HostPatchError("an earlier incomplete rollback left the host partly patched ("
                                     + "; ".join(self._state.still_patched) + "); call revert() first (through the "
                                     "adapter: m3_eagle_plugin.host.trtllm.uninstall() or install(force=True))")
            if self.applied:
                if ids == self._state.patch_ids and step_names == self._state.step_names:
                    return self.report()
                raise HostPatchError(
                    f"a different patch set is already applied ({self._state.patch_ids}); revert first")
            try:
                plan = self._plan(patches)
            except HostPatchError as exc:
                self._state = _State(error=str(exc))
                raise
            with _BIND_LOCK:
                try:
                    for binding in plan:
                        _check_unchanged_since_plan(binding)
                except HostPatchError as exc:
                    self._state = _State(error=str(exc))
                    raise
                self._bind(plan, steps, step_names, ids)
            return self.report()

    def record_error(self, message: str) -> None:
        """Note a failure found before `apply` (e.g. a preflight check) for `report()`."""
        with self._lock:
            if not (self._state.bindings or self._state.undos):
                self._state = _State(error=message)

    def revert(self) -> dict:
        """Undo everything this engine applied (no-op when nothing is applied).

        Every undo and restore is attempted even when one fails; if any failed, the engine keeps
        what is still patched (a later `revert()` retries it) and raises HostPatchError naming it.
        """
        with self._lock, _BIND_LOCK:
            s = self._state
            notes: list[str] = []
            left = _roll_back(s.undos, s.bindings, notes)
            if not left.failures:
                self._state = _State(revert_notes=notes)
                return self.report()
            message = "reverting the patches was incomplete: " + "; ".join(left.failures)
            self._state = _State(bindings=left.bindings, undos=left.undos, patch_ids=s.patch_ids,
                                 step_names=s.step_names, error=message, revert_notes=notes,
                                 still_patched=left.failures)
            raise HostPatchError(message)

    def report(self) -> dict:
        with self._lock:
            s = self._state
            return {
                "applied": self.applied,
                "patches": list(s.patch_ids),
                "steps": list(s.step_names),
                "bindings": [f"{b.patch_id}: {b.label}" for b in s.bindings],
                "error": s.error,
                "revert_notes": list(s.revert_notes),
                "still_patched": list(s.still_patched),
            }

    # -----------------------------------------------------------------------------------------

    def _bind(self, plan: list[_Binding], steps: Sequence[Step], step_names: tuple[str, ...],
              ids: tuple[str, ...]) -> None:
        """Bind the checked plan and run the steps; on failure roll back everything (caller holds locks)."""
        done: list[_Binding] = []
        undos: list[_Undo] = []
        try:
            for binding in plan:
                setattr(binding.owner, binding.name, binding.replacement)
                done.append(binding)
            for name, step in zip(step_names, steps):
                undos.append((name, step()))
        except BaseException as exc:
            notes: list[str] = []
            left = _roll_back(undos, done, notes)
            cause = f"{type(exc).__name__}: {exc}"
            if not left.failures:
                message = f"applying patches failed midway and was fully reverted: {cause}"
                self._state = _State(error=message, revert_notes=notes)
            else:
                message = (f"applying patches failed midway ({cause}) and the rollback was incomplete: "
                           + "; ".join(left.failures))
                self._state = _State(bindings=left.bindings, undos=left.undos, patch_ids=ids,
                                     step_names=step_names, error=message, revert_notes=notes,
                                     still_patched=left.failures)
            raise HostPatchError(message) from exc
        self._state = _State(bindings=done, undos=undos, patch_ids=ids, step_names=step_names)

    def _plan(self, patches: Iterable[Patch]) -> list[_Binding]:
        plan: list[_Binding] = []
        seen: dict[tuple[int, str], str] = {}  # (id(owner), name) -> id of the patch binding it
        wrapped: dict[int, str] = {}  # id(original) -> id of the patch wrapping it
        for patch in patches:
            owner = _resolved_owner(patch, patch.target)
            name = patch.target.name
            original, had_own = _owner_value(owner, name)
            first = seen.get((id(owner), name), wrapped.get(id(original)))
            if first is not None:  # its wrapper would replace the first where defined, re-exports keep the first
                raise HostPatchError(
                    f"patch {patch.id!r}: {patch.target.attribute} is already wrapped by patch {first!r} of the "
                    "same set; a host function takes one wrapper; nothing was patched")
            if getattr(original, PATCH_MARK, None) is not None:
                raise HostPatchError(
                    f"patch {patch.id!r}: {patch.target.attribute} is already wrapped by patch "
                    f"{getattr(original, PATCH_MARK)!r} (double activation from another engine?)")
            mismatch = leading_params_match(original, patch.target.params)
            if mismatch:
                raise HostPatchError(f"patch {patch.id!r}: {patch.target.attribute}: {mismatch}")
            try:
                replacement = patch.factory(original)
                setattr(replacement, PATCH_MARK, patch.id)
                replacement.__wrapped__ = original
            except Exception as exc:
                raise HostPatchError(f"patch {patch.id!r}: building the wrapper failed: {exc}") from exc
            plan.append(_Binding(patch.id, owner, name, original, replacement, had_own))
            seen[(id(owner), name)] = patch.id
            wrapped[id(original)] = patch.id
            for rebind in patch.rebinds:
                rowner = _resolved_owner(patch, rebind)
                if (id(rowner), rebind.name) in seen:
                    continue
                if _reads_through(rowner, rebind.name, original):
                    continue  # a PEP 562 re-export: patching the definer covers it
                bound = vars(rowner).get(rebind.name)
                if bound is not original:
                    raise HostPatchError(
                        f"patch {patch.id!r}: {getattr(rowner, '__name__', rowner)}.{rebind.name} "
                        f"is not the original {patch.target.attribute} (found {bound!r}); refusing to "
                        "patch a host whose bindings differ")
                plan.append(_Binding(patch.id, rowner, rebind.name, original, replacement, True))
                seen[(id(rowner), rebind.name)] = patch.id
        return plan
