"""kernel_fuzz's parent side (scheduling, case timeout, verdict) with stand-in workers: a case
that spends its time in Triton's compiler is not a hang, a hang still is, and a run that finished
no case or left one unfinished is not a pass. Its GPU checks run on the H200 only."""
from __future__ import annotations

import argparse
import textwrap
import types

import pytest

from tests.scripts._load import load_script

FAKE = '''
import json, os, sys, time
mode = os.environ["FAKE_FUZZ_WORKER"]
if mode == "die":
    sys.exit(1)
print("@@READY", flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    case = int(line)
    if mode in ("cold", "compile-then-hang"):
        print("@@COMPILING", flush=True)   # as Triton's jit_cache_hook tells it
        time.sleep(1.2)
        print("@@COMPILED 1.2", flush=True)
    if mode in ("hang", "compile-then-hang"):
        time.sleep(600)
    if mode == "no-checks":
        print(f"@@DONE {case}", flush=True)
        continue
    print("@@R " + json.dumps({"case": case, "kernel": "dense_attention", "status": "pass", "err": 0.0,
                              "msg": ""}), flush=True)
    print(f"@@DONE {case}", flush=True)
'''


@pytest.fixture
def run_parent(tmp_path, monkeypatch):
    fuzz = load_script("kernel_fuzz")
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(FAKE))

    def run(mode, *, seconds, grace, case_timeout):
        monkeypatch.setattr(fuzz, "SCRIPT", str(worker))   # the parent starts `python SCRIPT --worker ...`
        monkeypatch.setenv("FAKE_FUZZ_WORKER", mode)
        args = argparse.Namespace(seed=1, device="cpu", mem_fraction=0.0, tiny=True, only=None, workers=1,
                                  seconds=seconds, grace=grace, case_timeout=case_timeout, start=0, max_cases=1,
                                  verbose=False)
        return fuzz.parent_main(args)
    return run


def test_a_case_compiling_past_the_timeout_is_not_a_hang(run_parent, capsys):
    # 1.2 s in the compiler against a 0.5 s case timeout (a cold cache's 100 s against 150 s on the H200)
    assert run_parent("cold", seconds=10, grace=5, case_timeout=0.5) == 0
    out = capsys.readouterr().out
    assert "_timeout" not in out and "1 cases" in out and "0 with failures" in out


def test_a_hang_after_compiling_still_times_out_naming_the_compile(run_parent, capsys):
    assert run_parent("compile-then-hang", seconds=10, grace=5, case_timeout=0.5) == 1
    out = capsys.readouterr().out
    assert "FAIL kernel=_timeout case=0" in out
    assert "1.2s of it compiling 1 kernels" in out


def test_a_case_unfinished_at_the_hard_stop_is_not_a_pass(run_parent, capsys):
    assert run_parent("hang", seconds=0.3, grace=0.7, case_timeout=100) == 1
    out = capsys.readouterr().out
    assert "0 with failures" in out and "1 unfinished" in out
    assert "case 0 running" in out and "0.0s of it compiling 0 kernels" in out


def test_workers_that_never_start_are_not_a_pass(run_parent, capsys):
    assert run_parent("die", seconds=1, grace=1, case_timeout=100) == 1
    assert "no case finished" in capsys.readouterr().out


def test_the_compile_hooks_time_each_compile_and_answer_none(monkeypatch):
    fuzz = load_script("kernel_fuzz")
    told, clock = [], iter([100.0, 103.5])
    monkeypatch.setattr(fuzz, "time", types.SimpleNamespace(time=lambda: next(clock)))
    fuzz.COMPILED["tell"] = told.append
    assert fuzz._compile_starts(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False,
                                already_compiled=False) is None   # anything true skips the compile
    fuzz._compile_ends(key="k", repr="r", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    assert told == ["@@COMPILING", "@@COMPILED 3.500"]
    assert (fuzz.COMPILED["secs"], fuzz.COMPILED["kernels"]) == (3.5, 1)


def test_a_cuda_worker_installs_the_compile_hooks(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    fuzz = load_script("kernel_fuzz")
    fuzz._setup_runtime("cuda")   # imports only: no CUDA call
    assert knobs.runtime.jit_cache_hook is fuzz._compile_starts
    assert knobs.runtime.jit_post_compile_hook is fuzz._compile_ends


def test_a_check_naming_nothing_is_refused_and_a_run_that_checked_nothing_is_not_a_pass(run_parent, monkeypatch,
                                                                                        capsys):
    import sys

    fuzz = load_script("kernel_fuzz")
    ran = []
    monkeypatch.setattr(fuzz, "parent_main", lambda args: ran.append(args) or 0)
    monkeypatch.setattr(sys, "argv", ["kernel_fuzz.py", "--device", "cpu", "--only", "dense_atention"])
    with pytest.raises(SystemExit) as exc:
        fuzz.main()
    assert exc.value.code == 2 and not ran and "--only dense_atention names no check" in capsys.readouterr().err
    # an --only whose checks never run here (graph: on CPU): every case finishes with no result
    assert run_parent("no-checks", seconds=10, grace=5, case_timeout=100) == 1
    assert "no check reached a verdict" in capsys.readouterr().out


def test_a_result_where_the_reference_refuses_is_a_failure_not_a_refusal(monkeypatch):
    import torch

    import m3_eagle_plugin.msa as msa
    import m3_eagle_plugin.msa.kernels as K
    from m3_eagle_plugin.msa.kernels import backend

    fuzz = load_script("kernel_fuzz")
    monkeypatch.setattr(backend, "triton_available", backend.triton_available)   # _setup_runtime("cpu") sets it
    for name in fuzz.ENV_SWITCHES:
        monkeypatch.setenv(name, "restored")   # run_case sets the case's switches
    threads = torch.get_num_threads()
    fuzz._setup_runtime("cpu")
    torch.set_num_threads(threads)
    p = fuzz.gen_case(33, 5, True, False)
    assert (p["topk"], p["local"], p["init"]) == (1, 2, 1)   # forced blocks past top-k: both sides must refuse

    def accepts(iq, ik, meta, *, topk, local_blocks, init_blocks, max_qo_len=None):   # a dispatcher that does not
        local = min(local_blocks, topk)
        return msa.select_blocks_paged(iq, ik, meta, topk=topk, local_blocks=local,
                                       init_blocks=max(0, min(init_blocks, topk - local)))
    monkeypatch.setattr(K, "select_blocks_paged", accepts)
    results = []
    fuzz.run_case(p, torch.device("cpu"), results.append, only=["select_blocks_paged"])
    assert [(r["kernel"], r["status"]) for r in results] == [("select_blocks_paged", "fail"), ("_case", "done")]
    assert "the torch reference refuses (MsaInputError: local_blocks + init_blocks" in results[0]["msg"]


def test_one_case_whose_checks_never_run_here_is_not_a_pass(tmp_path):
    """`--case N` in-process: as a whole run, exit 0 needs a check that reached a verdict (graph: needs
    CUDA, so on CPU the case finished having checked nothing)."""
    import os
    import subprocess
    import sys

    from tests.scripts._load import SCRIPTS

    src = SCRIPTS.parent / "src"
    env = dict(os.environ, M3_EAGLE_PLUGIN="off", PYTHONPATH=os.pathsep.join([str(src), str(SCRIPTS.parent)]))
    proc = subprocess.run([sys.executable, str(SCRIPTS / "kernel_fuzz.py"), "--device", "cpu", "--tiny", "--case", "0",
                           "--only", "graph"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no check reached a verdict" in proc.stdout


def test_one_case_with_a_passing_check_is_a_pass(monkeypatch):
    import torch

    fuzz = load_script("kernel_fuzz")
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # single_case sets it on CPU: restored after the test
    monkeypatch.setattr(fuzz, "_setup_runtime", lambda device: None)
    monkeypatch.setattr(fuzz, "torch", torch, raising=False)   # _setup_runtime's global
    monkeypatch.setattr(fuzz, "run_case", lambda p, dev, emit, only=None: emit(
        {"kernel": "dense_attention", "status": "pass", "err": 0.0, "msg": ""}))
    args = argparse.Namespace(seed=33, case=0, tiny=True, device="cpu", only=None, full=False)
    assert fuzz.single_case(args) == 0
