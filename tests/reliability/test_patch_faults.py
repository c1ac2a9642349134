"""The patch engine under faults: the host ends fully patched or untouched, and the report says which.

Faults injected: a host symbol (function, method, module) that disappears, a rebind namespace
holding a different object, a wrapper factory that raises, a step that raises halfway, a
setattr the host refuses, an undo that raises during rollback, activation twice, activation
racing in threads (one engine and two engines), and a child process started with
multiprocessing spawn.
"""
from __future__ import annotations

import multiprocessing
import threading

import pytest

from m3_eagle_plugin.host.trtllm import contract, patching
from tests._threads import race

from ._counts import bump
from ._fakehost import make_fake_host, host_patches


@pytest.fixture
def host():
    fake = make_fake_host()
    yield fake
    fake.remove()


def _assert_untouched_with_reason(engine, host, exc: BaseException, *needles: str) -> None:
    assert host.untouched(), "a failed apply left the host partly patched"
    report = engine.report()
    assert report["applied"] is False and report["bindings"] == []
    assert report["error"], "the report does not say why nothing was applied"
    for needle in needles:
        assert needle in str(exc) and needle in report["error"], f"{needle!r} missing from the error"


def test_apply_then_revert_round_trips(host):
    engine = patching.PatchEngine()
    report = engine.apply(host_patches(host, patching, contract))
    assert host.fully_patched() and report["applied"] is True
    assert host.util.pick_manager("minimax_m3") == "plugin-manager"
    assert host.pkg.pick_manager("llama") == "host-manager-for-llama", "other models must see the host's answer"
    assert host.fmha.Gen().supported(1, 2) == ("plugin", 1, 2)
    engine.revert()
    assert host.untouched() and engine.report()["applied"] is False


@pytest.mark.parametrize("missing,needle", [("function", "vanished_pick_manager"),
                                            ("method", "vanished"),
                                            ("module", "vanished_util")])
def test_missing_host_symbol_patches_nothing(host, missing, needle):
    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(host_patches(host, patching, contract, missing=missing))
    _assert_untouched_with_reason(engine, host, info.value, needle)


def test_symbol_disappearing_between_two_activations(host):
    """First activation fine, host reloaded without the symbol: the second one patches nothing."""
    engine = patching.PatchEngine()
    engine.apply(host_patches(host, patching, contract))
    engine.revert()
    del host.fmha.Gen.supported
    host.fmha.Gen.other = lambda self: None
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(host_patches(host, patching, contract))
    assert host.dispatch.pick_manager is host._pick and host.util.pick_manager is host._pick
    assert "supported" in str(info.value) and engine.report()["applied"] is False


def test_rebind_namespace_holding_another_object_patches_nothing(host):
    host.util.pick_manager = lambda sparse_attention_config: "someone else's"
    foreign = host.util.pick_manager
    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(host_patches(host, patching, contract))
    assert host.dispatch.pick_manager is host._pick and host.util.pick_manager is foreign
    assert "pick_manager" in str(info.value) and engine.report()["applied"] is False


def test_wrapper_factory_raising_patches_nothing(host):
    patches = host_patches(host, patching, contract)

    def broken(original):
        raise RuntimeError("factory exploded")

    patches[1] = patching.Patch(patches[1].id, patches[1].target, broken)
    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(patches)
    _assert_untouched_with_reason(engine, host, info.value, "factory exploded")


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_step_raising_halfway_reverts_everything(host, fail_at):
    """Patches bound, then steps: the step at `fail_at` raises; every binding and step is undone."""
    undone: list[int] = []

    def step(i):
        def run():
            if i == fail_at:
                raise RuntimeError(f"step {i} exploded")
            return lambda: undone.append(i)
        run.__name__ = f"step{i}"
        return run

    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(host_patches(host, patching, contract), steps=[step(i) for i in range(3)])
    _assert_untouched_with_reason(engine, host, info.value, f"step {fail_at} exploded")
    assert sorted(undone) == list(range(fail_at)), "the steps that ran were not all undone"


def test_host_refusing_a_setattr_halfway_reverts_everything(host):
    """The second patch's owner refuses assignment after the first patch was bound."""

    class Frozen(type):
        def __setattr__(cls, name, value):
            raise AttributeError(f"{cls.__name__} is read-only")

    host.fmha.Gen = Frozen("Gen", (), {"supported": host._supported})
    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError) as info:
        engine.apply(host_patches(host, patching, contract))
    assert host.dispatch.pick_manager is host._pick and host.pkg.pick_manager is host._pick
    assert host.util.pick_manager is host._pick
    assert "read-only" in str(info.value) and engine.report()["applied"] is False


def test_undo_raising_during_rollback_still_restores_the_rest(host):
    """A step fails, and an earlier step's undo raises too: the bindings must still be restored."""

    def good():
        def undo():
            raise RuntimeError("undo exploded")
        return undo

    def bad():
        raise RuntimeError("step exploded")

    engine = patching.PatchEngine()
    bump("faults.injected")
    with pytest.raises(Exception) as info:
        engine.apply(host_patches(host, patching, contract), steps=[good, bad])
    assert isinstance(info.value, patching.HostPatchError), f"raw {type(info.value).__name__} escaped"
    assert host.untouched(), "a raising undo left the host half-patched"
    assert "step exploded" in engine.report()["error"] and "undo exploded" in engine.report()["error"]


def test_activation_twice_is_idempotent(host):
    engine = patching.PatchEngine()
    first = engine.apply(host_patches(host, patching, contract))
    second = engine.apply(host_patches(host, patching, contract))
    assert first == second and host.fully_patched()
    engine.revert()
    assert host.untouched()


def test_second_engine_refuses_to_wrap_a_wrapper(host):
    """Two activations that do not share an engine (e.g. two plugin copies): never double-wrapped."""
    a, b = patching.PatchEngine(), patching.PatchEngine()
    a.apply(host_patches(host, patching, contract))
    bump("faults.injected")
    with pytest.raises(patching.HostPatchError, match="already wrapped"):
        b.apply(host_patches(host, patching, contract))
    assert host.fully_patched() and b.report()["applied"] is False and "already wrapped" in b.report()["error"]
    b.revert()
    assert host.fully_patched(), "reverting the refused engine undid the other engine's patches"
    a.revert()
    assert host.untouched()


def test_one_engine_racing_in_threads_patches_once(host):
    engine = patching.PatchEngine()
    reports, errors = race(lambda: engine.apply(host_patches(host, patching, contract)), 8)
    bump("faults.injected", 8)
    assert not errors and len(reports) == 8 and all(r == reports[0] for r in reports)
    assert host.fully_patched()
    engine.revert()
    assert host.untouched()


def test_two_engines_racing_in_threads_patch_once(host):
    """Two engines apply concurrently: exactly one may report the host as patched by it."""
    import time

    planning = threading.Event()  # set once engine A has planned every patch but the last
    engines = [patching.PatchEngine(), patching.PatchEngine()]

    def slow_last(patches):
        out = list(patches)
        last = out[-1]

        def factory(original, make=last.factory):
            planning.set()
            time.sleep(0.3)  # engine B applies everything in this window
            return make(original)

        out[-1] = patching.Patch(last.id, last.target, factory, last.rebinds)
        return out

    def engine_a():
        engines[0].apply(slow_last(host_patches(host, patching, contract)))

    def engine_b():
        planning.wait(5)
        engines[1].apply(host_patches(host, patching, contract))

    errors = []

    def guarded(fn):
        try:
            fn()
        except patching.HostPatchError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in (engine_a, engine_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bump("faults.injected")
    assert host.fully_patched(), "host not cleanly patched"
    winners = [i for i in range(2) if engines[i].report()["applied"]]
    assert len(winners) == 1, "both engines believe they patched the host; one engine's wrappers were replaced"
    assert len(errors) == 1 and "already wrapped" in str(errors[0]), errors
    loser = engines[1 - winners[0]].report()
    assert loser["applied"] is False and loser["error"], "the refused engine's report does not say why"
    engines[winners[0]].revert()
    assert host.untouched(), "reverting the winner left a wrapper behind"


# ---- a spawned child process: it starts untouched and decides for itself ----

def _child_main(prefix: str, missing, queue) -> None:
    """Runs in a fresh interpreter: rebuild the host there, apply, report what the child saw."""
    fake = make_fake_host(prefix)
    state = {"untouched_at_start": fake.untouched()}
    engine = patching.PatchEngine()
    try:
        engine.apply(host_patches(fake, patching, contract, missing=missing))
    except patching.HostPatchError:
        pass
    state.update(untouched=fake.untouched(), fully_patched=fake.fully_patched(), report=engine.report())
    queue.put(state)


@pytest.mark.parametrize("missing", [None, "method"])
def test_spawned_child_ends_fully_patched_or_untouched(host, missing):
    engine = patching.PatchEngine()
    engine.apply(host_patches(host, patching, contract))  # the parent is patched ...
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_main, args=(host.prefix, missing, queue))
    child.start()
    state = queue.get(timeout=60)
    child.join(timeout=60)
    bump("faults.injected", int(missing is not None))
    assert child.exitcode == 0
    assert state["untouched_at_start"], "a spawned child inherited patched host objects"
    if missing is None:
        assert state["fully_patched"] and state["report"]["applied"] is True
    else:
        assert state["untouched"] and state["report"]["applied"] is False
        assert "vanished" in state["report"]["error"]
    assert host.fully_patched(), "the child's outcome changed the parent"
    engine.revert()
