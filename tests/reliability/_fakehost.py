"""A throwaway in-memory host (a few modules in `sys.modules`) for patch-engine fault tests.

It mimics what the adapter patches in TensorRT-LLM: a dispatch function re-bound by two other
modules at import time (`from dispatch import pick_manager`), and a class method. Each call
builds fresh modules under a unique prefix, so tests never share host state.
"""
from __future__ import annotations

import sys
import types
import uuid
from dataclasses import dataclass


class _Gen:
    def supported(self, q, k):
        return ("host", q, k)


@dataclass
class FakeHost:
    prefix: str
    dispatch: types.ModuleType
    pkg: types.ModuleType
    util: types.ModuleType
    fmha: types.ModuleType

    def untouched(self) -> bool:
        """Every host name is bound to its original object again."""
        return (self.dispatch.pick_manager is self._pick and self.pkg.pick_manager is self._pick
                and self.util.pick_manager is self._pick and self.fmha.Gen.__dict__["supported"] is self._supported)

    def fully_patched(self) -> bool:
        """Every host name is bound to one wrapper around its original (never a wrapper of a wrapper)."""
        pick = self.dispatch.pick_manager
        sup = self.fmha.Gen.__dict__["supported"]
        return (pick is not self._pick and getattr(pick, "__wrapped__", None) is self._pick
                and self.pkg.pick_manager is pick and self.util.pick_manager is pick
                and sup is not self._supported and getattr(sup, "__wrapped__", None) is self._supported)

    def remove(self) -> None:
        for name in [n for n in sys.modules if n.startswith(self.prefix)]:
            del sys.modules[name]


def make_fake_host(prefix: str | None = None) -> FakeHost:
    prefix = prefix or f"m3rel_fakehost_{uuid.uuid4().hex[:8]}"

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(f"{prefix}.{name}" if name else prefix)
        sys.modules[mod.__name__] = mod
        return mod

    root = module("")
    root.__path__ = []  # a package, so the submodules import
    dispatch, pkg, util, fmha = module("dispatch"), module("pkg"), module("util"), module("fmha")

    def pick_manager(sparse_attention_config, *rest):
        return f"host-manager-for-{sparse_attention_config}"

    dispatch.pick_manager = pkg.pick_manager = util.pick_manager = pick_manager
    fmha.Gen = type("Gen", (), {"supported": _Gen.supported})
    host = FakeHost(prefix, dispatch, pkg, util, fmha)
    host._pick, host._supported = pick_manager, fmha.Gen.__dict__["supported"]
    return host


def host_patches(host: FakeHost, patching, contract, *, missing: str | None = None):
    """Two patches like the adapter's: a routed dispatch (+ 2 rebinds) and a method wrap."""
    sym = contract.HostSymbol

    def route(original):
        import functools

        @functools.wraps(original)
        def pick_manager(sparse_attention_config, *rest):
            if sparse_attention_config == "minimax_m3":
                return "plugin-manager"
            return original(sparse_attention_config, *rest)
        return pick_manager

    def widen(original):
        import functools

        @functools.wraps(original)
        def supported(self, q, k):
            return ("plugin",) + original(self, q, k)[1:]
        return supported

    p = host.prefix
    dispatch_attr = "vanished_pick_manager" if missing == "function" else "pick_manager"
    gen_attr = "Gen.vanished" if missing == "method" else "Gen.supported"
    util_module = f"{p}.vanished_util" if missing == "module" else f"{p}.util"
    return [
        patching.Patch("route", sym("dispatch", (f"{p}.dispatch",), dispatch_attr, "function",
                                    ("sparse_attention_config",)),
                       route,
                       rebinds=(sym("pkg_binding", (f"{p}.pkg",), "pick_manager", "binding"),
                                sym("util_binding", (util_module,), "pick_manager", "binding"))),
        patching.Patch("widen", sym("gen_supported", (f"{p}.fmha",), gen_attr, "method",
                                    ("self", "q", "k")), widen),
    ]
