"""`m3-eagle bench` on CPU: the reference-only smoke table, JSON output, argument parsing."""
from __future__ import annotations

import argparse
import json

import pytest

from m3_eagle_plugin.bench import cli
from m3_eagle_plugin.bench.end_to_end import register_end_to_end, run_end_to_end
from m3_eagle_plugin.bench.table import format_table
from m3_eagle_plugin.cli import main as m3_main


def test_parse_configs():
    assert cli.parse_configs("16x32K, 1x8192") == [(16, 32768), (1, 8192)]
    with pytest.raises(argparse.ArgumentTypeError, match="BATCHxCONTEXT"):
        cli.parse_configs("16by32")
    with pytest.raises(argparse.ArgumentTypeError, match="config '16x32768' repeats 16x32768"):
        cli.parse_configs("16x32K,16x32768")  # the kernel table keeps one row a shape


def test_cpu_smoke_writes_json_and_prints_table_last(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--qo-lens", "4,1", "--json", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["section", "kernel"] and lines[-1].split()[0] == "reference_smoke"
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["kernel"], r["qo_len"]) for r in rows} == {
        (k, q) for k in ("index_select", "sparse_attn", "dense_attn") for q in (4, 1)}
    # tiny geometry: block 16, 4 q heads, index dim 32, head dim 32, topk 4, fp32; 2 requests x 64 tokens
    by = {(r["kernel"], r["qo_len"]): r for r in rows}
    # index queries (8 tokens) + index-K + the int32 selection written
    assert by[("index_select", 4)]["bytes"] == 8 * 32 * 4 + 128 * 32 * 4 + 8 * 4 * 4
    # q read + K/V + output written (2 tokens)
    assert by[("dense_attn", 1)]["bytes"] == 2 * 4 * 32 * 4 + 128 * 2 * 32 * 4 + 2 * 4 * 32 * 4
    assert all(r["torch_us"] > 0 for r in rows)


def test_bare_json_prints_one_object_on_stdout_and_the_table_on_stderr(tmp_path, capsys, monkeypatch):
    """DESIGN.md's command-line rule: `--json` prints one JSON object on stdout. The same rows as
    `--json PATH` writes (timings aside)."""
    monkeypatch.chdir(tmp_path)  # where a file named "-" would land
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--qo-lens", "1", "--json"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # the whole of stdout is one object
    assert "reference_smoke" in captured.err.splitlines()[-1]
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--qo-lens", "1", "--json", str(out)]) == 0
    keys = lambda rows: [(r["kernel"], r["qo_len"], r["bytes"]) for r in rows]  # noqa: E731
    assert keys(document["rows"]) == keys(json.loads(out.read_text())["rows"]) and len(document["rows"]) == 3
    assert not (tmp_path / "-").exists()


def test_cpu_smoke_bytes_count_q_the_output_and_a_partial_last_page_by_its_tokens(tmp_path):
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x40", "--qo-lens", "1", "--json", str(out)]) == 0
    by = {r["kernel"]: r["bytes"] for r in json.loads(out.read_text())["rows"]}
    # 2 requests x 40 tokens (pages of 16: the third holds 8), one query token each
    q_and_out = 2 * (2 * 4 * 32 * 4)
    kv = 80 * 2 * 32 * 4  # 80 valid tokens, K and V, not 6 whole pages
    assert by["dense_attn"] == q_and_out + kv
    assert by["sparse_attn"] == q_and_out + kv + 2 * 4 * 4  # topk 4 >= 3 blocks: all selected; + the selection
    assert by["index_select"] == 2 * 32 * 4 + 80 * 32 * 4 + 2 * 4 * 4


def test_the_smoke_sparse_row_reads_topk_blocks_of_16_tokens(tmp_path):
    """At 2x256 the tiny geometry (block 16, topk 4) has 16 blocks a request: a q_len 1 token's sparse
    row reads its 4 selected whole blocks (64 tokens), not the whole context."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--configs", "2x256", "--qo-lens", "1", "--kernels", "sparse_attn"]
    assert m3_main([*argv, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    q_and_out = 2 * (2 * 4 * 32 * 4)
    kv = 2 * (4 * 16) * 2 * 32 * 4  # 2 requests x 4 blocks x 16 tokens, K and V, head dim 32, fp32
    assert row["bytes"] == q_and_out + kv + 2 * 4 * 4  # + the int32 selection [1, 2, 4]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_bare_json_needs_no_writable_working_directory(monkeypatch, capsys):
    """A bare `--json` is stdout, not a file named "-": it runs where no file can be created."""
    monkeypatch.chdir("/proc")  # takes no new file, even as root
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 3


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_write_table_dash_is_a_file_checked_before_the_run(monkeypatch, capsys):
    """Only `--json` takes "-" for stdout; `--write-table -` names a file "-", which skipped the
    writability check and failed in an unwritable directory after the whole GPU run."""
    from m3_eagle_plugin.msa import kernels

    measured = []
    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "_gpu_rows", lambda args, device, log: measured.append(1) or (
        [{"section": "kernels", "kernel": "sparse_attn", "batch": 16, "context": 32768, "qo_len": 4,
          "graph_us": 18.0}], {"device_name": "Fake GPU"}))
    monkeypatch.chdir("/proc")  # takes no new file, even as root
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4", "--write-table", "-"]) == 2
    assert "m3-eagle bench: --write-table -: cannot create a file in /proc" in capsys.readouterr().err
    assert measured == []


@pytest.mark.parametrize("argv, match", [
    (["--device", "gpu"], "--device: expected cuda, cuda:N or cpu, got 'gpu'"),
    (["--qo-lens", "x"], "--qo-lens: expected a comma list of positive integers"),
    (["--qo-lens", "0"], "--qo-lens: expected a comma list of positive integers"),
    (["--qo-lens", "4,-2"], "--qo-lens: expected a comma list of positive integers"),
    (["--qo-lens", "4,1,4"], "--qo-lens 4,1,4: a q_len given twice"),
    (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: /nonexistent/dir is not a writable"),
    (["--write-table", "/nonexistent/t.json"], "--write-table /nonexistent/t.json: /nonexistent is not"),
    (["--e2e", "--e2e-batches", "x"], "--e2e-batches: expected a comma list of integers"),
    (["--e2e", "--e2e-tokens", "2"], "--e2e-tokens 2: must be >= 4"),
    (["--e2e", "--e2e-hidden", "0"], "--e2e-hidden 0: must be >= 1"),
    (["--e2e", "--e2e-repeats", "0"], "--e2e-repeats 0: must be >= 1"),
    (["--e2e", "--e2e-context", "0"], "--e2e-context 0: must be >= 1"),
    (["--e2e", "--e2e-context", "-3"], "--e2e-context -3: must be >= 1"),
    (["--e2e", "--e2e-batches", "1,0"], "--e2e-batches 1,0: batch sizes must be >= 1"),
    (["--e2e", "--e2e-batches", "1,16,1"], "--e2e-batches 1,16,1: batch 1 given twice"),  # ran batch 1 twice
    (["--kernels", "sparse_attn,bogus"], "--kernels: unknown kernel(s) bogus"),
    (["--kernels", "sparse_attn,dense_attn,sparse_attn"], "--kernels sparse_attn,dense_attn,sparse_attn: "
                                                         "sparse_attn given twice"),
    (["--qo-lens", "4,1", "--configs", "1x2,2x64"], "--configs 1x2: context shorter than --qo-lens 4"),
    (["--e2e-hidden", "64"], "--e2e-hidden: needs --e2e"),
    (["--e2e-hidden", "0"], "--e2e-hidden: needs --e2e"),
    (["--e2e-overlap"], "--e2e-overlap: needs --e2e"),
    (["--e2e-batches", ""], "--e2e-batches: needs --e2e"),
    (["--e2e-tokens", "8", "--e2e-batches", "1"], "--e2e-tokens, --e2e-batches: need --e2e"),
    (["--kernels", ""], '--kernels "": no kernel to measure'),  # printed an empty table, exit 0
    (["--json", "same.json", "--write-table", "./same.json"], "--json and --write-table both name ./same.json"),
    # the e2e section ran whole, then "nothing written"; `kv_lens_update` alone wrote a table of no rows
    (["--kernels", "", "--e2e", "--write-table", "t.json"], "--write-table: --kernels '' measures no kernel the "
                                                             "table holds (index_select, sparse_attn, sparse_step"),
    (["--device", "cpu", "--kernels", "sparse_step,kv_lens_update"],
     "--kernels sparse_step,kv_lens_update: the cpu smoke table (no CUDA/Triton kernels) times only"),
])
def test_bad_options_are_refused_before_anything_is_measured(argv, match, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative output paths land here should a refusal ever be missed
    measured = []
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: measured.append(1) or ([], {}))
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: measured.append(2) or [])
    argv = argv if "--configs" in argv else ["--configs", "2x64", *argv]
    assert m3_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("m3-eagle bench: ") and match in err and measured == []
    # the option typed, not the internal field it sets
    assert not any(field in err for field in ("new_tokens", "prompt_len", "repeats >=", "hidden must", "batches must"))


def test_every_e2e_option_defaults_to_none_or_false():
    """`e2e.options_given` tells a given `--e2e-*` option by a value other than None / False."""
    from m3_eagle_plugin.bench import e2e

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([])
    dests = {a.dest for a in parser._actions if any(s.startswith("--e2e-") for s in a.option_strings)}
    assert dests and all(getattr(args, d) is None or getattr(args, d) is False for d in dests)
    assert e2e.options_given(args) == []
    assert set(e2e.options_given(parser.parse_args(["--e2e-overlap", "--e2e-repeats", "2"]))) == {
        "--e2e-overlap", "--e2e-repeats"}


def test_cuda_without_a_gpu_is_refused_not_replaced_by_the_cpu_smoke(capsys, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    assert m3_main(["bench", "--configs", "2x64", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_end_to_end_hook(monkeypatch):
    import m3_eagle_plugin.bench.end_to_end as e2e

    monkeypatch.setattr(e2e, "_hook", None)
    assert run_end_to_end(argparse.Namespace())[0]["note"] == "not implemented yet"
    register_end_to_end(lambda args: [{"kernel": "e2e", "tokens_per_s": 12.5}])
    assert run_end_to_end(argparse.Namespace()) == [{"section": "end_to_end", "kernel": "e2e", "tokens_per_s": 12.5}]


def test_table_formats_missing_cells_and_floats():
    text = format_table([{"kernel": "a", "graph_us": 1.23456}, {"kernel": "bb", "note": "x"}])
    header, rule, first, second = text.splitlines()
    assert header.split() == ["kernel", "graph_us", "note"] and first.split() == ["a", "1.23"]
    assert second.split() == ["bb", "x"]


def test_write_table_needs_gpu_rows(tmp_path, capsys):
    """Refused before anything runs: on CPU the smoke table ran, then nothing was written (exit 1)."""
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--qo-lens", "1", "--write-table",
                    str(path)]) == 2
    captured = capsys.readouterr()
    assert not path.exists() and captured.out == ""
    assert "m3-eagle bench: --write-table: needs the GPU kernel rows (CUDA and Triton); on cpu" in captured.err


def test_write_table_from_gpu_rows_loads_as_the_override(tmp_path, monkeypatch, capsys):
    from m3_eagle_plugin.msa import kernels
    from m3_eagle_plugin.msa.kernels import kernel_table

    rows = [{"section": "kernels", "kernel": "sparse_attn", "batch": 16, "context": 32768, "qo_len": 4,
             "graph_us": 18.0, "flashinfer_us": 15.0},
            {"section": "kernels", "kernel": "dense_attn", "batch": 16, "context": 32768, "qo_len": 4,
             "graph_us": 80.0, "flashinfer_us": 110.0},
            {"section": "kernels", "kernel": "kv_lens_update", "batch": 16, "context": 32768, "qo_len": 4,
             "graph_us": 2.5}]
    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)  # a GPU faked end to end
    monkeypatch.setattr(cli, "_gpu_rows", lambda args, device, log: (
        rows, {"device_name": "Fake GPU", "flashinfer": "0.7.4-fake"}))
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4",
                    "--write-table", str(path)]) == 0
    assert "written to" in capsys.readouterr().err
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    kernel_table.clear_caches()
    table = kernel_table.load_table()
    kernel_table.clear_caches()
    assert (table.device, table.flashinfer) == ("Fake GPU", "0.7.4-fake")
    assert table.command.startswith("m3-eagle bench --configs 16x32768 --qo-lens 4")
    assert sorted((r.kernel, r.ours_us, r.flashinfer_us) for r in table.rows) == [
        ("dense_attn", 80.0, 110.0), ("sparse_attn", 18.0, 15.0)]


def test_a_repeated_kernel_is_refused_before_the_gpu_rows_not_by_the_written_table(tmp_path, monkeypatch, capsys):
    """The suite measures a kernel once per name listed: `--kernels a,a` gave two rows of one shape,
    which `--write-table` refused (KernelTableError, a traceback) only after the whole GPU run."""
    from m3_eagle_plugin.msa import kernels

    measured = []

    def gpu_rows(args, device, log):  # like run_kernel_suite: one row per listed kernel and shape
        measured.append(1)
        return ([{"section": "kernels", "kernel": k, "batch": 16, "context": 32768, "qo_len": 4, "graph_us": 18.0}
                 for k in cli.kernels_of(args)], {"device_name": "Fake GPU"})

    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)  # a GPU faked end to end
    monkeypatch.setattr(cli, "_gpu_rows", gpu_rows)
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "4", "--kernels",
                    "sparse_attn,sparse_attn", "--write-table", str(path)]) == 2
    assert "--kernels sparse_attn,sparse_attn: sparse_attn given twice" in capsys.readouterr().err
    assert measured == [] and not path.exists()


def test_rounds_must_be_a_positive_integer_and_reach_the_written_command(tmp_path, monkeypatch, capsys):
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            m3_main(["bench", "--device", "cpu", "--rounds", bad])
        assert "expected a positive integer" in capsys.readouterr().err
    from m3_eagle_plugin.msa import kernels
    from m3_eagle_plugin.msa.kernels import kernel_table

    seen = {}
    rows = [{"section": "kernels", "kernel": "sparse_step", "batch": 16, "context": 32768, "qo_len": 1,
             "graph_us": 45.1, "flashinfer_us": 45.8}]
    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)  # a GPU faked end to end
    monkeypatch.setattr(cli, "_gpu_rows", lambda args, device, log: seen.update(rounds=args.rounds) or (
        rows, {"device_name": "Fake GPU", "flashinfer": "0.7.4-fake"}))
    path = tmp_path / "table.json"
    assert m3_main(["bench", "--device", "cuda", "--configs", "16x32K", "--qo-lens", "1", "--rounds", "5",
                    "--write-table", str(path)]) == 0
    assert seen == {"rounds": 5}
    assert json.loads(path.read_text())["command"].endswith("--flashinfer auto --rounds 5")
    kernel_table.clear_caches()


def test_sets_must_be_a_positive_integer(capsys):
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--sets", bad])
        assert "expected a positive integer" in capsys.readouterr().err


def test_cpu_smoke_rows_are_the_kernels_asked_for(tmp_path):
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "2", "--kernels",
                    "dense_attn, index_select", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["kernel"] for r in rows) == ["dense_attn", "index_select"]
    # 2 requests x 32 tokens, 2 query tokens each: index-K 32 fp32 a token, K+V 2 x 32 fp32 a token
    by = {r["kernel"]: r["bytes"] for r in rows}
    q_and_out = 2 * (4 * 4 * 32 * 4)  # 4 tokens x 4 q heads x dim 32, read and written
    assert by == {"index_select": 4 * 32 * 4 + 64 * 32 * 4 + 4 * 4 * 4, "dense_attn": q_and_out + 64 * 2 * 32 * 4}


def test_json_is_standard_even_with_non_finite_figures(tmp_path, monkeypatch):
    """A kernel that returns NaN reports error inf; the file must still be JSON (RFC 8259 has no
    Infinity or NaN), readable by a strict parser."""
    rows = [{"section": "kernels", "kernel": "sparse_attn", "error": float("inf"), "graph_us": 2.5,
             "ours_rounds_us": [1.0, float("nan")]}]
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: (rows, {"note": "x"}))
    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", "--json", str(out)]) == 0

    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    data = json.loads(out.read_text(), parse_constant=refuse)
    (row,) = data["rows"]
    assert row["error"] == "inf" and row["graph_us"] == 2.5 and row["ours_rounds_us"] == [1.0, "nan"]


@pytest.mark.parametrize("option", ["--json", "--write-table"])
def test_an_output_path_that_is_a_directory_is_refused_before_anything_is_measured(option, tmp_path, capsys,
                                                                                     monkeypatch):
    """`open(DIR, "w")` raised IsADirectoryError, a traceback after the whole run; the folder check
    passed because a directory's parent is writable."""
    measured = []
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: measured.append(1) or ([], {}))
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", option, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"m3-eagle bench: {option} {tmp_path}: ") and "directory" in err
    assert measured == [] and list(tmp_path.iterdir()) == []


def test_the_smoke_table_names_the_kernels_it_does_not_time(capsys):
    """On CPU only the reference kernels run; the others were dropped without a word."""
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels",
                    "sparse_step,dense_attn"]) == 0
    captured = capsys.readouterr()
    assert "does not time sparse_step" in captured.err
    assert [line.split()[1] for line in captured.out.splitlines()[2:]] == ["dense_attn"]


def test_the_measured_gpu_is_made_current_before_anything_is_timed(monkeypatch, capsys):
    """CUDA events and graph captures run on the current device: `--device cuda:1` timed cuda:0's
    stream while the kernels ran on cuda:1. The bench makes its device current first (faked here:
    no GPU needed)."""
    from m3_eagle_plugin.msa import kernels

    calls = []
    rows = [{"section": "kernels", "kernel": "kv_lens_update", "batch": 1, "context": 4096, "qo_len": 4,
             "graph_us": 2.5}]
    monkeypatch.setattr(kernels, "triton_available", lambda device: True)
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 2)  # a two-GPU host
    monkeypatch.setattr(cli.torch.cuda, "set_device", lambda device: calls.append(("current", str(device))))
    monkeypatch.setattr(cli, "_gpu_rows", lambda args, device, log: (calls.append(("timed", str(device))), (
        rows, {"device_name": "Fake GPU"}))[1])
    assert m3_main(["bench", "--device", "cuda:1", "--configs", "1x4K", "--qo-lens", "4",
                    "--kernels", "kv_lens_update"]) == 0
    assert calls == [("current", "cuda:1"), ("timed", "cuda:1")]


@pytest.mark.parametrize("argv, match", [
    (["--json", ""], '--json "": an empty path (give a file name, or no value for stdout)'),  # wrote nothing, exit 0
    (["--write-table", ""], '--write-table "": an empty path'),
    (["--device", ""], "--device: expected cuda, cuda:N or cpu, got ''"),  # ran on the default device
])
def test_empty_option_values_are_refused_not_taken_as_absent(argv, match, capsys, monkeypatch):
    measured = []
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: measured.append(1) or ([], {}))
    assert m3_main(["bench", "--configs", "2x64", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"m3-eagle bench: {match}") and err.count("\n") == 1 and measured == []


@pytest.mark.parametrize("configs", ["", ",", " , "])
def test_configs_without_a_shape_are_refused_not_replaced_by_the_defaults(configs, capsys):
    """`--configs ""` ran the default shapes (on a GPU the whole default suite, minutes)."""
    with pytest.raises(SystemExit) as exit_info:
        m3_main(["bench", "--device", "cpu", "--configs", configs])
    assert exit_info.value.code == 2
    assert f"argument --configs: no BATCHxCONTEXT in {configs!r}" in capsys.readouterr().err


def test_a_shape_past_int32_is_refused_by_the_parser():
    """Past 2**63 torch raised an OverflowError traceback while building the inputs."""
    for text in ("1x9999999999999999999999", "9999999999999999999999x2", "1x2147483648"):
        with pytest.raises(argparse.ArgumentTypeError, match="batch and context must be <= 2147483647"):
            cli.parse_configs(text)
    assert cli.parse_configs("1x2147483647") == [(1, 2**31 - 1)]


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried to "
                 "allocate 805306368000 bytes."),
    MemoryError(),
])
def test_a_shape_past_memory_is_one_line_naming_the_configs(monkeypatch, capsys, error):
    """An allocation failure in the kernel section (raised here: whether the host's allocator refuses
    800 GB at once or overcommits it depends on the machine) is one line naming the configs; it
    raised a RuntimeError traceback."""
    def oom(*args):
        raise error

    monkeypatch.setattr(cli, "_cpu_smoke_rows", oom)
    assert m3_main(["bench", "--device", "cpu", "--configs", "1x2147483647", "--qo-lens", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("m3-eagle bench: not enough memory for --configs 1x2147483647 (")
    assert err[-1].endswith("lower a batch or context") and not any("Traceback" in line for line in err)


def test_an_e2e_section_past_memory_is_one_line_and_other_errors_still_raise(monkeypatch, capsys):
    def oom(args):
        raise cli.torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(cli, "run_end_to_end", oom)
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--e2e"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "m3-eagle bench: not enough memory for the --e2e section (CUDA out of memory. Tried to allocate 2.00 GiB); "
        "lower --e2e-hidden, --e2e-context or --e2e-batches")
    monkeypatch.setattr(cli, "run_end_to_end", lambda args: (_ for _ in ()).throw(RuntimeError("a real bug")))
    with pytest.raises(RuntimeError, match="a real bug"):
        m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--e2e"])


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("option", ["--json", "--write-table"])
def test_a_folder_that_refuses_new_files_is_refused_before_anything_is_measured(option, capsys, monkeypatch):
    """/proc passes `os.access(W_OK)` as root but takes no file: `open` raised FileNotFoundError, a
    traceback after the whole run."""
    measured = []
    monkeypatch.setattr(cli, "_cpu_smoke_rows", lambda args: measured.append(1) or ([], {}))
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x64", option, "/proc/m3-eagle-bench.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"m3-eagle bench: {option} /proc/m3-eagle-bench.json: ") and measured == []


@pytest.mark.parametrize("failure, status", [(OSError(28, "No space left on device"), 1), (KeyboardInterrupt(), 130)])
def test_a_json_write_that_fails_midway_leaves_the_earlier_file_whole(failure, status, tmp_path, monkeypatch, capsys):
    """`--json PATH` was written in place: a full disk or Ctrl-C midway left truncated JSON (and a
    traceback). Now it is written beside PATH and renamed over it."""
    out = tmp_path / "bench.json"
    out.write_text('{"earlier": true}\n')

    def dump_then_fail(document, fh, **options):
        fh.write('{"context": ')
        raise failure

    monkeypatch.setattr(cli.json, "dump", dump_then_fail)
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--json", str(out)]) == status
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"earlier": True} and [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"m3-eagle bench: --json {out}: not written (No space left on device)" if status == 1 else
                       "m3-eagle bench: interrupted (Ctrl-C / SIGINT)")


def test_a_written_json_has_the_mode_open_gives_a_new_file(tmp_path):
    import os

    out = tmp_path / "bench.json"
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--json", str(out)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask and [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_a_json_rewritten_over_a_private_file_keeps_its_mode(tmp_path):
    """`open(path, "w")` keeps an existing file's mode; the scratch file renamed over it took the
    umask's 0644, so a results file the user had made private (0600) became world-readable."""
    out = tmp_path / "bench.json"
    out.write_text('{"earlier": true}\n')
    out.chmod(0o600)
    oracle = tmp_path / "oracle.json"  # what `open` does to such a file
    oracle.write_text("{}")
    oracle.chmod(0o600)
    with open(oracle, "w") as fh:
        fh.write("{}")
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--json", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == oracle.stat().st_mode & 0o777 == 0o600
    assert [r["batch"] for r in json.loads(out.read_text())["rows"]] == [2, 2, 2]


def test_a_json_path_that_is_a_symlink_is_written_through_it(tmp_path):
    """The JSON was renamed over the link itself: the file it names kept the earlier rows (and, with
    the link on another file system than its target, the rename failed after the whole run)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    real, link = tmp_path / "real" / "bench.json", tmp_path / "links" / "bench.json"
    real.write_text('{"earlier": true}\n')
    link.symlink_to(real)
    assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--json", str(link)]) == 0
    assert link.is_symlink() and [r["batch"] for r in json.loads(real.read_text())["rows"]] == [2, 2, 2]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bench.json", "bench.json", "links", "real"]


def test_kernels_help_names_every_kernel(capsys):
    """`--kernels` said "comma list of kernels" without naming one."""
    with pytest.raises(SystemExit):
        m3_main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text for name in cli.KERNELS) and "--sets SETS input sets rotated while timing (default 3)" \
        in help_text


def test_a_json_path_that_is_a_fifo_is_written_into_it_not_replaced(tmp_path):
    """`--json PIPE` (a FIFO, `/dev/stdout` on a pipe): the JSON was renamed over the FIFO, which became
    a plain file while its reader got nothing (and `--json /dev/stdout | jq` was refused, its folder
    /proc/PID/fd taking no new file; run as root, `--json /dev/null` replaced the device)."""
    import os
    import stat

    fifo = tmp_path / "bench.pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so the writer's open does not block
    try:
        assert m3_main(["bench", "--device", "cpu", "--configs", "2x32", "--qo-lens", "1", "--kernels",
                        "dense_attn", "--json", str(fifo)]) == 0
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
        received = b""
        while chunk := os.read(reader, 1 << 16):
            received += chunk
    except BlockingIOError:
        received = b""
    finally:
        os.close(reader)
    assert [(r["kernel"], r["batch"], r["context"]) for r in json.loads(received)["rows"]] == [("dense_attn", 2, 32)]
