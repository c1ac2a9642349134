"""An all-or-nothing, revertible, idempotent patch engine for TensorRT-LLM symbols.

TensorRT-LLM has no extension points for the KV-manager choice, the draft-KV policy or the
trtllm-gen page-size allowlist, so the adapter wraps host functions. Wrapping is only safe if it
is atomic (a half-patched host would route one process differently from another), revertible
(tests, `uninstall()`), refuses to wrap a wrapper (double activation), and also rebinds the
names other modules copied with `from X import name` at import time. This module does exactly
that and records what it did for `m3-eagle doctor`.
"""
from __future__ import annotations

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


class HostPatchError(RuntimeError):
    """Patching the host failed; nothing stays patched. The message names the cause."""


@dataclass(frozen=True)
class Patch:
    """Wrap `target` with `factory(original)` and rebind the result wherever `rebinds` copied it.

    `rebinds` are the namespaces (package `__init__`s, `pyexecutor._util`, ...) that bound the
    target's name at import time; each must currently hold the very same original object.
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
        return f"{getattr(self.owner, '__module__', '')}:{getattr(self.owner, '__qualname__', getattr(self.owner, '__name__', self.owner))}.{self.name}".lstrip(":")


@dataclass
class _State:
    bindings: list[_Binding] = field(default_factory=list)
    undos: list[Callable[[], None]] = field(default_factory=list)
    patch_ids: tuple[str, ...] = ()
    step_names: tuple[str, ...] = ()
    error: str | None = None
    revert_notes: list[str] = field(default_factory=list)


def _owner_value(owner: Any, name: str) -> tuple[Any, bool]:
    own = vars(owner) if hasattr(owner, "__dict__") else {}
    if name in own:
        return own[name], True
    return getattr(owner, name), False


class PatchEngine:
    """Applies a set of patches (plus optional extra steps) atomically; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state = _State()

    @property
    def applied(self) -> bool:
        return bool(self._state.bindings or self._state.undos)

    def apply(self, patches: Sequence[Patch], steps: Sequence[Step] = ()) -> dict:
        """Apply every patch, then every step; on any failure revert all and raise HostPatchError.

        Applying the same patch set again is a no-op that returns the current report; applying a
        different set while one is applied is refused (revert first).
        """
        ids = tuple(p.id for p in patches)
        step_names = tuple(getattr(s, "__name__", repr(s)) for s in steps)
        with self._lock:
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
            done: list[_Binding] = []
            undos: list[Callable[[], None]] = []
            try:
                for binding in plan:
                    setattr(binding.owner, binding.name, binding.replacement)
                    done.append(binding)
                for step in steps:
                    undos.append(step())
            except BaseException as exc:
                for undo in reversed(undos):
                    undo()
                for binding in reversed(done):
                    self._restore(binding, [])
                message = f"applying patches failed midway and was fully reverted: {type(exc).__name__}: {exc}"
                self._state = _State(error=message)
                raise HostPatchError(message) from exc
            self._state = _State(bindings=done, undos=undos, patch_ids=ids, step_names=step_names)
            return self.report()

    def record_error(self, message: str) -> None:
        """Note a failure found before `apply` (e.g. a preflight check) for `report()`."""
        with self._lock:
            if not self.applied:
                self._state = _State(error=message)

    def revert(self) -> dict:
        """Undo everything this engine applied (no-op when nothing is applied)."""
        with self._lock:
            notes: list[str] = []
            for undo in reversed(self._state.undos):
                undo()
            for binding in reversed(self._state.bindings):
                self._restore(binding, notes)
            self._state = _State(revert_notes=notes)
            return self.report()

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
            }

    # -----------------------------------------------------------------------------------------

    def _plan(self, patches: Iterable[Patch]) -> list[_Binding]:
        plan: list[_Binding] = []
        seen: set[tuple[int, str]] = set()
        for patch in patches:
            try:
                _, owner = resolve_owner(patch.target)
            except HostSymbolMissing as exc:
                raise HostPatchError(f"patch {patch.id!r}: {exc}") from None
            name = patch.target.name
            original, had_own = _owner_value(owner, name)
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
            seen.add((id(owner), name))
            for rebind in patch.rebinds:
                try:
                    _, rowner = resolve_owner(rebind)
                except HostSymbolMissing as exc:
                    raise HostPatchError(f"patch {patch.id!r}: {exc}") from None
                if (id(rowner), rebind.name) in seen:
                    continue
                bound = vars(rowner).get(rebind.name)
                if bound is not original:
                    raise HostPatchError(
                        f"patch {patch.id!r}: {getattr(rowner, '__name__', rowner)}.{rebind.name} "
                        f"is not the original {patch.target.attribute} (found {bound!r}); refusing to "
                        "patch a host whose bindings differ")
                plan.append(_Binding(patch.id, rowner, rebind.name, original, replacement, True))
                seen.add((id(rowner), rebind.name))
        return plan

    @staticmethod
    def _restore(binding: _Binding, notes: list[str]) -> None:
        current = vars(binding.owner).get(binding.name) if hasattr(binding.owner, "__dict__") else None
        if current is not binding.replacement:
            notes.append(f"{binding.label} was re-bound by someone else; left as is")
            return
        if binding.had_own:
            setattr(binding.owner, binding.name, binding.original)
        else:
            delattr(binding.owner, binding.name)
