"""`m3-eagle bench`: documented defaults, edge values of the option checks and exit statuses
(2: option/setup errors, 1: a failure after the run), checked against hand-written values."""
from __future__ import annotations

import argparse
import json
import os

import pytest

from m3_eagle_plugin.bench import cli, e2e
from m3_eagle_plugin.cli import main as m3_main


def _fake_gpu(monkeypatch, seen=None):
    from m3_eagle_plugin.msa import kernels

    rows = [{"section": "kernels", "kernel": "sparse_attn", "batch": 16, "context": 32768, "qo_len": 4,
             "graph_us": 18.0, "flashinfer_us": 15.0}]
    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)  # a GPU faked end to end

    def gpu_rows(args, device, log):
        if seen is not None:
            seen.append(cli.configs_of(args, gpu=True))
        return rows, {"device_name": "Fake GPU", "flashinfer": "0.7.4-fake"}

    monkeypatch.setattr(cli, "_gpu_rows", gpu_rows)


@pytest.mark.parametrize("text", ["0x64", "2x0", "0x0"])
def test_a_zero_batch_or_context_is_refused_by_the_parser(text):
    with pytest.raises(argparse.ArgumentTypeError, match="batch and context must be >= 1"):
        cli.parse_configs(text)


def test_the_defaults_the_help_names():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    # help: --qo-lens "(default 4,1)", --sets "(default 3)", --rounds "(default 1)", --flashinfer "auto, the default"
    assert (args.qo_lens, args.sets, args.rounds, args.flashinfer) == ("4,1", 3, 1, "auto")
    assert args.json is None and parser.parse_args(["--json"]).json == "-"  # bare --json: stdout


def test_without_qo_lens_the_smoke_table_times_4_and_1(tmp_path):
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--kernels", "dense_attn", "--json",
                    str(out)]) == 0
    assert sorted(r["qo_len"] for r in json.loads(out.read_text())["rows"]) == [1, 4]


def test_a_context_exactly_the_longest_q_len_is_accepted(tmp_path):
    """Every context must hold the longest q_len's tokens: 4 tokens hold a q_len of 4."""
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x4", "--qo-lens", "4", "--kernels", "dense_attn",
                    "--json", str(out)]) == 0
    assert [(r["batch"], r["context"], r["qo_len"]) for r in json.loads(out.read_text())["rows"]] == [(2, 4, 4)]


def test_a_read_only_output_file_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys):
    """Root passes os.access on any file, so the read-only case is simulated for that one file."""
    out = tmp_path / "bench.json"
    out.write_text("{}\n")
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False if (str(path) == str(out) and mode == os.W_OK)
                        else real_access(path, mode))
    measured = []
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: measured.append(1) or ([], {}))
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--json", str(out)]) == 2
    assert capsys.readouterr().err == f"m3-eagle bench: --json {out}: the file is not writable\n"
    assert measured == []


def test_the_written_command_is_the_run_with_its_defaults_spelled_out(tmp_path, monkeypatch, capsys):
    """No --configs on a GPU: the help's GPU default shapes; the table's command spells out the default
    dtypes and FlashInfer policy, and no --rounds when it is the default 1."""
    seen = []
    _fake_gpu(monkeypatch, seen)
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--qo-lens", "4", "--kernels", "sparse_attn",
                    "--write-table", str(path)]) == 0
    assert seen == [[(1, 8192), (16, 32768), (64, 32768), (64, 131072)]]
    assert json.loads(path.read_text())["command"] == (
        "m3-eagle bench --configs 1x8192,16x32768,64x32768,64x131072 --qo-lens 4 --kernels sparse_attn "
        "--kv-dtype fp8 --dense-kv-dtype bf16 --flashinfer auto")


def test_the_written_command_runs_again_with_blanks_in_the_lists(tmp_path, monkeypatch, capsys):
    """`--qo-lens "4, 1" --kernels "sparse_attn, dense_attn"` went into the table's command verbatim,
    unquoted: run again, the shell split it and argparse refused the stray "1"."""
    _fake_gpu(monkeypatch)
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", " 4, 1", "--kernels",
                    "sparse_attn, dense_attn", "--write-table", str(path)]) == 0
    command = json.loads(path.read_text())["command"]
    assert " --qo-lens 4,1 --kernels sparse_attn,dense_attn --kv-dtype " in command
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    again = parser.parse_args(command.split()[2:])
    assert (cli.qo_lens_of(again), cli.kernels_of(again)) == ([4, 1], ["sparse_attn", "dense_attn"])


def test_a_failed_json_write_fails_the_run_even_when_the_table_is_written(tmp_path, monkeypatch, capsys):
    _fake_gpu(monkeypatch)
    out, table = tmp_path / "bench.json", tmp_path / "table.json"
    real_replace = os.replace

    def replace(src, dst):
        if str(dst) == str(out):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", replace)
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4", "--kernels", "sparse_attn",
                    "--json", str(out), "--write-table", str(table)]) == 1
    assert table.exists() and not out.exists()
    assert f"m3-eagle bench: --json {out}: not written (No space left on device)" in capsys.readouterr().err


def test_a_run_without_a_decode_window_is_an_option_error(monkeypatch, capsys):
    def no_window(args):
        raise e2e.NoDecodeWindowError("too short to time")

    monkeypatch.setattr(cli, "run_end_to_end", no_window)
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--e2e"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "m3-eagle bench: --e2e: too short to time"


def test_an_empty_kernel_list_with_e2e_runs_the_end_to_end_section_alone(monkeypatch, capsys):
    """README: `m3-eagle bench --kernels "" --e2e ...` runs the end-to-end section only."""
    row = {"section": "e2e", "kernel": "decode", "batch": 1}
    calls = []
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: calls.append(1) or [dict(row)])
    assert m3_main(["bench", "--device", "cpu", "--kernels", "", "--e2e", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert calls == [1] and document["rows"] == [row]
    assert document["context"]["note"] == "no CUDA/Triton"  # no smoke table ran: not "smoke only"


def test_an_empty_kernel_list_on_a_gpu_never_enters_the_kernel_suite(monkeypatch, capsys):
    """`--kernels "" --e2e` on a GPU: the end-to-end section alone; the suite (which builds every
    config's input sets, gigabytes at the default shapes) is not entered."""
    from m3_eagle_plugin.bench import timing
    from m3_eagle_plugin.msa import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "get_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(timing, "copy_ceiling_gbps", lambda device: 4000.0)
    monkeypatch.setattr(kernels, "backend_report", lambda device: {"mode": "auto"})
    suite = []
    monkeypatch.setattr(cli, "run_kernel_suite", lambda *args, **kwargs: suite.append(1) or [])
    row = {"section": "e2e", "kernel": "decode", "batch": 1}
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: [dict(row)])
    assert m3_main(["bench", "--device", "cuda", "--kernels", "", "--e2e", "--flashinfer", "off", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert suite == [] and document["rows"] == [row] and document["context"]["device_name"] == "Fake GPU"


def test_a_cuda_index_past_the_visible_devices_is_an_option_error(monkeypatch, capsys):
    """`--device cuda:3` on a one-GPU host passed the checks; `torch.cuda.set_device` then raised
    "invalid device ordinal", a traceback, instead of one line naming the option."""
    seen = []
    _fake_gpu(monkeypatch, seen)
    chosen = []
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli.torch.cuda, "set_device", chosen.append)
    argv = ["bench", "--configs", "16x32K", "--qo-lens", "4", "--kernels", "sparse_attn"]
    assert m3_main([*argv, "--device", "cuda:3"]) == 2
    assert capsys.readouterr().err == "m3-eagle bench: --device cuda:3: no such CUDA device (1 visible: cuda:0)\n"
    assert seen == [] and chosen == []
    assert m3_main([*argv, "--device", "cuda:0"]) == 0 and chosen == [cli.torch.device("cuda:0")]


@pytest.mark.parametrize("name, value, match", [
    ("M3_EAGLE_KERNELS", "bogus", "M3_EAGLE_KERNELS must be auto, triton, torch or flashinfer, got 'bogus'"),
    ("M3_EAGLE_KERNELS", "triton", "M3_EAGLE_KERNELS=triton but Triton kernels cannot run on cpu"),
    ("M3_EAGLE_PDL", "2", "M3_EAGLE_PDL='2': expected one of 0, 1, all"),
    ("M3_EAGLE_KERNEL_TABLE", "/nonexistent/table.json", "/nonexistent/table.json"),
])
def test_a_kernel_setting_the_e2e_engine_cannot_run_is_an_option_error(name, value, match, monkeypatch, capsys):
    """The end-to-end engine calls the kernel dispatchers, which refuse these settings: the run died
    with a traceback in its first engine step (exit 1) instead of refusing them up front, as
    `m3-eagle run` does."""
    from m3_eagle_plugin.msa.kernels import kernel_table

    kernel_table.clear_caches()
    monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: calls.append(1) or [])
    assert m3_main(["bench", "--device", "cpu", "--kernels", "", "--e2e"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("m3-eagle bench: ") and match in err and err.count("\n") == 1 and calls == []
    kernel_table.clear_caches()


def test_a_malformed_kernel_switch_is_refused_before_the_gpu_kernel_suite(monkeypatch, capsys):
    """On a GPU the suite's `backend_report` (after the copy ceiling's 4 GB copy) raised the switch's
    KernelInputError as a traceback; the CPU smoke table reads no switch."""
    seen = []
    _fake_gpu(monkeypatch, seen)
    monkeypatch.setenv("M3_EAGLE_HANDOFF", "off")
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4"]) == 2
    assert capsys.readouterr().err == "m3-eagle bench: M3_EAGLE_HANDOFF='off': expected one of 0, 1\n"
    assert seen == []
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels", "dense_attn"]) == 0


@pytest.mark.parametrize("failure, status, last", [
    (e2e.NoDecodeWindowError("too short to time"), 2, "m3-eagle bench: --e2e: too short to time"),
    (MemoryError(), 2, "m3-eagle bench: not enough memory for the --e2e section (MemoryError); lower --e2e-hidden, "
                       "--e2e-context or --e2e-batches"),
])
def test_a_failed_e2e_section_keeps_the_kernel_rows_already_measured(failure, status, last, tmp_path, monkeypatch,
                                                                      capsys):
    """The kernel section runs first (on a GPU, minutes to hours); an end-to-end failure after it
    returned before any output: no table, and `--json PATH` was never written."""
    def fail(args):
        raise failure

    monkeypatch.setattr(cli, "run_end_to_end", fail)
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels", "dense_attn",
                    "--e2e", "--json", str(out)]) == status
    captured = capsys.readouterr()
    assert [(r["kernel"], r["batch"], r["context"]) for r in json.loads(out.read_text())["rows"]] == [
        ("dense_attn", 2, 32)]
    assert captured.out.splitlines()[-1].split()[:2] == ["reference_smoke", "dense_attn"]
    assert captured.err.splitlines()[-1] == last


@pytest.mark.parametrize("json_to", ["path", "stdout"])
def test_a_kernel_section_out_of_memory_part_way_keeps_the_rows_finished_before_it(json_to, tmp_path, monkeypatch,
                                                                                   capsys):
    """A large shape running out of memory used to lose every row measured before it (no table, no
    JSON); they are printed and written, `--write-table` is not (a partial table), exit 2."""
    import torch

    from m3_eagle_plugin.bench import timing
    from m3_eagle_plugin.msa import kernels

    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "get_device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(timing, "copy_ceiling_gbps", lambda device: 4000.0)
    monkeypatch.setattr(kernels, "backend_report", lambda device: {"mode": "auto"})
    finished = {"kernel": "sparse_step", "batch": 16, "context": 32768, "qo_len": 4, "graph_us": 50.0}

    def suite(configs, *args, **kwargs):
        assert configs == [(16, 32768), (64, 131072)]
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        error.kernel_rows = [finished]
        raise error

    monkeypatch.setattr(cli, "run_kernel_suite", suite)
    out, table = tmp_path / "bench.json", tmp_path / "table.json"
    argv = ["bench", "--device", "cuda", "--configs", "16x32K,64x128K", "--qo-lens", "4", "--kernels", "sparse_step",
            "--flashinfer", "off", "--write-table", str(table), "--json", *([str(out)] if json_to == "path" else [])]
    assert m3_main(argv) == 2
    captured = capsys.readouterr()
    document = json.loads(out.read_text() if json_to == "path" else captured.out)
    assert document["rows"] == [{"section": "kernels", **finished}]
    assert document["context"]["device_name"] == "Fake GPU" and not table.exists()
    assert captured.err.splitlines()[-1] == ("m3-eagle bench: not enough memory for --configs 16x32768,64x131072 "
                                             "(CUDA out of memory. Tried to allocate 9.00 GiB); lower a batch or context")


def test_a_cuda_index_equal_to_the_device_count_is_past_the_last_one(monkeypatch, capsys):
    """Two visible GPUs are cuda:0 and cuda:1: cuda:2 is refused, naming the range."""
    seen = []
    _fake_gpu(monkeypatch, seen)
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli.torch.cuda, "set_device", lambda device: None)
    argv = ["bench", "--configs", "16x32K", "--qo-lens", "4", "--kernels", "sparse_attn"]
    assert m3_main([*argv, "--device", "cuda:2"]) == 2
    assert capsys.readouterr().err == "m3-eagle bench: --device cuda:2: no such CUDA device (2 visible: cuda:0..cuda:1)\n"
    assert seen == []
    assert m3_main([*argv, "--device", "cuda:1"]) == 0 and len(seen) == 1


def test_json_on_stdout_and_a_table_file_named_dash_do_not_collide(tmp_path, monkeypatch, capsys):
    """`--json -` is stdout, not a file: `--write-table -` (a file named "-") is not the same path."""
    _fake_gpu(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4", "--kernels", "sparse_attn",
                    "--json", "-", "--write-table", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [r["kernel"] for r in document["rows"]] == ["sparse_attn"]
    assert (tmp_path / "-").is_file() and json.loads((tmp_path / "-").read_text())["rows"]


def _failing_kernel_section(monkeypatch, finished_rows):
    """The kernel section raising out of memory after `finished_rows` (carried as the CLI's partial section)."""
    def section(args, device, log):
        error = MemoryError()
        if finished_rows is not None:
            error.partial_section = (finished_rows, {"device_name": "cpu"})
        raise error

    monkeypatch.setattr(cli, "_kernel_section", section)


def test_a_failed_kernel_section_skips_the_e2e_section(tmp_path, monkeypatch, capsys):
    """After the kernel section failed, the end-to-end section is not started: its rows would join a
    report whose kernel rows are partial, and the run ends with the kernel error (exit 2)."""
    row = {"section": "kernels", "kernel": "dense_attn", "batch": 2, "context": 32, "qo_len": 1}
    _failing_kernel_section(monkeypatch, [row])
    calls = []
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: calls.append(1) or [])
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels", "dense_attn",
                    "--e2e", "--json", str(out)]) == 2
    assert calls == []
    assert json.loads(out.read_text())["rows"] == [row]
    assert "not enough memory for --configs" in capsys.readouterr().err


def test_a_kernel_section_failing_before_any_row_writes_nothing(tmp_path, monkeypatch, capsys):
    """No row finished: no empty table on stdout and no `--json` file, only the error line (exit 2)."""
    _failing_kernel_section(monkeypatch, None)
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels", "dense_attn",
                    "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert not out.exists() and captured.out == ""
    assert captured.err.splitlines() == ["m3-eagle bench: not enough memory for --configs 2x32 (MemoryError); "
                                         "lower a batch or context"]


def test_the_written_command_keeps_the_input_sets_the_times_were_taken_over(tmp_path, monkeypatch, capsys):
    """`--sets 1` times one input set again and again (a small shape's inputs stay in the L2 cache); the
    table's command left it out, so running it again measured over the default 3 sets."""
    _fake_gpu(monkeypatch)
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4", "--kernels", "sparse_attn",
                    "--sets", "1", "--write-table", str(path)]) == 0
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    again = parser.parse_args(json.loads(path.read_text())["command"].split()[2:])
    assert (again.sets, again.rounds, cli.configs_of(again, gpu=True)) == (1, 1, [(16, 32768)])


def test_a_context_one_token_short_of_the_longest_q_len_is_refused(capsys):
    """3 tokens cannot hold a q_len of 4 (1 <= q_len <= kv_len): an option error before anything is
    measured, not build_step_meta's traceback from inside the smoke table."""
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x3", "--qo-lens", "1,4", "--kernels",
                    "dense_attn"]) == 2
    assert "m3-eagle bench: --configs 2x3: context shorter than --qo-lens 4" in capsys.readouterr().err


def test_standard_json_covers_tuples_too():
    """A tuple is written as a JSON array: a non-finite float inside one must become its string as
    in a list, else `json.dump` writes `Infinity`, which strict readers refuse."""
    import json

    from m3_eagle_plugin.bench.table import json_safe

    document = json_safe({"a": (1.0, float("inf")), "b": [(float("nan"),)]}, str)  # what `bench --json` writes
    assert json.loads(json.dumps(document, allow_nan=False)) == {"a": [1.0, "inf"], "b": [["nan"]]}


def test_a_pipe_in_a_folder_that_takes_no_new_file_is_accepted(tmp_path, monkeypatch):
    """A pipe is written in place (`_write_json`), so only it must be writable, not its folder
    (`/dev/stdout` for a user who cannot create files in /proc/PID/fd or /dev): here a FIFO whose
    folder `os.access` calls read-only, as it does for such a user."""
    import os

    from m3_eagle_plugin.bench import cli

    fifo = tmp_path / "bench.pipe"
    os.mkfifo(fifo)
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False if os.path.realpath(path) == str(
        tmp_path.resolve()) else real_access(path, mode))
    cli._check_output_path("--json", str(fifo))
    with pytest.raises(ValueError, match="is not a writable directory"):  # a plain file there is refused
        cli._check_output_path("--json", str(tmp_path / "bench.json"))


def test_the_smoke_sparse_row_counts_the_bytes_of_the_selection_it_times(monkeypatch, tmp_path):
    """The smoke table's sparse_attn row times the torch reference on one selection and counts its
    byte floor on it (byte_floor: "the selection given"): the two must be the same selection (the
    shared input selection's union is another size at 2x512, q_len 4)."""
    import json

    import torch

    from m3_eagle_plugin.bench import torch_reference as ref
    from m3_eagle_plugin.bench.inputs import Geometry
    from m3_eagle_plugin.bench.kernel_suite import byte_floor

    timed = []
    real = ref.sparse_attention
    monkeypatch.setattr(ref, "sparse_attention", lambda q, k, v, meta, selection, **kw: (
        timed.append((q, meta, selection)), real(q, k, v, meta, selection, **kw))[1])
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x512", "--qo-lens", "4", "--kernels", "sparse_attn",
                    "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    geo = Geometry(q_heads=4, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)  # test_cli's
    q, meta, selection = timed[0]
    assert all(s is selection for _, _, s in timed)
    assert row["bytes"] == byte_floor("sparse_attn", meta, geo, q=q, index_q=q, kv_dtype=torch.float32,
                                      index_dtype=torch.float32, selection=selection)[0]
