"""`m3-eagle run` through the top-level CLI on the tiny checkpoints."""
from __future__ import annotations

import json

import pytest

from m3_eagle_plugin.cli import main


def run_cli(capsys, *argv):
    rc = main(["run", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_json_output_has_the_documented_fields_and_isolates_bad_prompts(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n[5, 300]\nnot json\n[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]\n")
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--draft-len", "2",
                         "--prompts", str(prompts), "--max-new-tokens", "3", "--json")
    assert rc == 0
    report = json.loads(out)
    for key in ("outputs", "acceptance_rate", "mean_acceptance_length", "draft_tokens", "accepted_tokens",
                "tokens_per_s"):
        assert key in report
    assert [len(o) for o in report["outputs"]] == [3, 0, 0, 3]
    assert "300" in report["errors"][1] and "not JSON" in report["errors"][2]
    assert report["errors"][0] is None and report["errors"][3] is None
    assert report["kv_blocks_free_after"] == report["kv_blocks"]


def test_without_prompts_the_default_prompt_runs_and_is_announced(tiny_pair, capsys):
    """DESIGN.md shows the prompt options as optional: `m3-eagle run --model DIR --json` runs the
    default prompt (what the README's first command passes), saying so on stderr only."""
    target, draft = tiny_pair
    rc, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--max-new-tokens", "5", "--json")
    assert rc == 0 and "no --prompt-ids or --prompts" in err
    rc2, given, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--max-new-tokens", "5",
                            "--prompt-ids", "1,2,3,4", "--json")
    assert rc2 == 0 and json.loads(out)["outputs"] == json.loads(given)["outputs"]
    assert len(json.loads(out)["outputs"]) == 1 and len(json.loads(out)["outputs"][0]) == 5


def test_text_output_announces_forced_acceptance(tiny_pair, capsys):
    target, draft = tiny_pair
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--draft-len", "2",
                         "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--force-accepted", "2")
    assert rc == 0
    assert "forced acceptance: up to 2 drafts" in out and "NOT the target's" in out
    assert "acceptance_rate=1.000" in out


def test_fractional_forced_acceptance_is_a_mean_per_verify_step(tiny_pair, capsys):
    target, draft = tiny_pair
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--draft-len", "3",
                         "--prompt-ids", "1,2,3", "--max-new-tokens", "15", "--force-accepted", "2.5", "--json")
    report = json.loads(out)
    assert rc == 0 and report["forced_acceptance"] == 2.5
    # accepted 2, 3, 2, 3 per verify step: 1 + 3 + 4 + 3 + 4 = 15 tokens in 4 verify steps
    assert (report["verify_steps"], report["accepted_tokens"]) == (4, 10)
    assert report["mean_acceptance_length"] == 3.5
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--model", str(target), "--prompt-ids", "1", "--force-accepted", "two"])
    assert exit_info.value.code == 2 and "--force-accepted: expected a number" in capsys.readouterr().err


def test_cuda_graphs_on_cpu_is_refused_clearly(tiny_pair, capsys):
    rc, _, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1,2", "--cuda-graphs")
    assert rc == 2 and "--cuda-graphs needs --device cuda" in err


def test_all_requests_failing_exits_1(tiny_pair, capsys):
    rc, out, _ = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1,x", "--json")
    assert rc == 1
    assert "comma-separated integers" in json.loads(out)["errors"][0]


@pytest.mark.parametrize("ids", ["1_0", "\u0663", "1,2_3", "0x10"])
def test_ids_int_alone_would_read_are_refused_as_a_prompts_file_refuses_them(tiny_pair, capsys, ids):
    """int() reads '1_0' as 10 and Arabic-Indic three as 3; the same id in a --prompts file is refused."""
    rc, out, _ = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", ids, "--json")
    assert rc == 1 and "comma-separated integers" in json.loads(out)["errors"][0]
    rc, _, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1", "--eos-ids", ids)
    assert rc == 2 and "comma-separated integers" in err


def test_progress_bar_draws_only_on_a_terminal():
    import io

    from m3_eagle_plugin.host.reference.cli import ProgressBar

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = ProgressBar(stream, width=4)
        bar(1, 2)
        bar.close()
    assert tty.getvalue() == "\r[##..] 1/2 requests\n"
    assert pipe.getvalue() == ""


def test_a_draft_the_target_cache_cannot_host_is_refused_before_any_weight_is_read(tiny_pair, tmp_path, capsys,
                                                                                 monkeypatch):
    """README guarantee: a draft that does not fit its target fails before any weight is read (here a
    draft with fewer KV heads than the target, whose K/V page the target's pages cannot host)."""
    from safetensors.torch import load_file, save_file

    from m3_eagle_plugin.models.safetensors_source import SafetensorsSource

    target, draft = tiny_pair
    config = json.loads((draft / "config.json").read_text())
    kv_heads = config["num_key_value_heads"]
    assert kv_heads > 1
    config["num_key_value_heads"] = 1
    bad = tmp_path / "draft_kv1"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(draft / "model.safetensors"))
    for name in ("k_proj", "v_proj"):  # consistent with the config, so only the cache geometry refuses it
        weight = tensors[f"midlayer.self_attn.{name}.weight"]
        tensors[f"midlayer.self_attn.{name}.weight"] = weight[: weight.shape[0] // kv_heads].contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    reads = []
    real_get_many = SafetensorsSource.get_many
    monkeypatch.setattr(SafetensorsSource, "get_many",
                        lambda self, names: reads.append(len(names)) or real_get_many(self, names))
    rc, out, err = run_cli(capsys, "--model", str(target), "--draft", str(bad), "--prompt-ids", "1,2",
                           "--max-new-tokens", "2")
    assert rc == 2 and "cannot be hosted" in err and reads == []
    assert f"num_key_value_heads: the draft head's 1 differs from the target's {kv_heads}" in err
    rc, _, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2",
                         "--max-new-tokens", "2")
    assert rc == 0 and reads  # the loader is the one the check watched


def test_a_bad_kernel_setting_is_a_setup_error(tiny_pair, capsys, monkeypatch):
    target, _ = tiny_pair
    monkeypatch.setenv("M3_EAGLE_KERNELS", "bogus")
    rc, _, err = run_cli(capsys, "--model", str(target), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert rc == 2 and err.startswith("m3-eagle run: M3_EAGLE_KERNELS must be") and "Traceback" not in err
    monkeypatch.setenv("M3_EAGLE_KERNELS", "flashinfer")
    rc, _, err = run_cli(capsys, "--model", str(target), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert rc == 2 and "M3_EAGLE_KERNELS=flashinfer" in err and "cpu" in err


def test_a_file_where_a_checkpoint_directory_belongs_is_named(tiny_pair, capsys):
    target, draft = tiny_pair
    for argv, option in ((["--model", str(target / "config.json")], "--model"),
                         (["--model", str(target), "--draft", str(draft / "model.safetensors")], "--draft")):
        rc, _, err = run_cli(capsys, *argv, "--prompt-ids", "1,2", "--max-new-tokens", "2")
        assert rc == 2 and err.startswith(f"m3-eagle run: {option} ") and "not a checkpoint directory" in err


def test_a_force_accepted_below_the_schedules_resolution_is_a_setup_error(tiny_pair, capsys):
    target, draft = tiny_pair
    rc, _, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2,3",
                         "--max-new-tokens", "4", "--force-accepted", "0.0000001")
    assert rc == 2 and err.startswith("m3-eagle run: --force-accepted: ") and "resolution" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def _args(*argv):
    import argparse

    from m3_eagle_plugin.host.reference.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "x", *argv])


def test_spaces_inside_a_token_id_are_refused_naming_the_item(tiny_pair, capsys):
    """'1 2 3' is not the id 123: spaces around an id are fine, inside one they are an error."""
    from m3_eagle_plugin.host.reference.cli import read_prompts

    prompts, errors = read_prompts(_args("--prompt-ids", " 1, 2 ,3 ", "--prompt-ids", "1 2 3", "--prompt-ids", "4,5 6"))
    assert prompts[0] == [1, 2, 3] and errors[0] is None
    assert prompts[1] is None and "--prompt-ids #1" in errors[1] and "'1 2 3'" in errors[1]
    assert prompts[2] is None and "got '5 6'" in errors[2]
    rc, _, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                         "--eos-ids", "4 5")
    assert rc == 2 and err.startswith("m3-eagle run: --eos-ids: ") and "got '4 5'" in err and err.count("\n") == 1


def test_prompts_file_errors_name_the_files_line_counting_blank_lines(tmp_path):
    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2, 3]\n\n\n{not json}\n   \n7\n[4]\n")  # bad prompts on lines 4 and 6
    prompts, errors = read_prompts(_args("--prompts", str(path)))
    assert prompts == [[1, 2, 3], None, 7, [4]]
    assert errors[0] is None and errors[3] is None
    assert errors[1].startswith(f"{path}:4: not JSON") and errors[2] == f"{path}:6: expected a JSON list of token ids"


def test_prompts_file_lines_are_counted_as_grep_n_counts_them(tmp_path):
    """A text prompt written by json.dumps(..., ensure_ascii=False) keeps U+2028 raw, and a form feed or
    NEL may sit in a line: str.splitlines split the line there, so a 4-line file gave 5 prompts and the
    bad line 3 (grep -n's number) was named as line 4. "\r\n" and a lone "\r" still end a line."""
    import re

    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    text = '[1, 2]\r\n"first\u2028second\x85third"\n[3,\x0c 4]\r[1, x]\n\n[5]\n'
    path.write_bytes(text.encode("utf-8"))
    bad_line = next(n for n, line in enumerate(re.split(r"\r\n|\r|\n", text), start=1) if "x]" in line)
    assert bad_line == 4
    prompts, errors = read_prompts(_args("--prompts", str(path)))
    assert prompts == [[1, 2], "first\u2028second\x85third", None, None, [5]]
    assert errors[0] is None and errors[4] is None
    assert errors[1] == f"{path}:2: expected a JSON list of token ids"
    assert errors[2].startswith(f"{path}:3: not JSON") and errors[3].startswith(f"{path}:{bad_line}: not JSON")


def test_a_batch_of_prompts_on_one_line_is_named_as_such(tmp_path):
    """One line holding every prompt ([[1, 2], [3]]) failed per request as "token ids must be ints";
    an empty list and a list of ids stay prompts (they fail, or run, as any other)."""
    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("[[1, 2, 3], [4, 5]]\n[]\n[6, [7]]\n")
    prompts, errors = read_prompts(_args("--prompts", str(path)))
    assert prompts == [[[1, 2, 3], [4, 5]], [], [6, [7]]]
    assert errors[0] == (f"{path}:1: a list of lists; the file takes one prompt (a JSON list of token ids) "
                         "per line")
    assert errors[1] is None and errors[2] is None


def test_step_buffers_past_free_memory_are_refused_naming_the_options(tiny_pair, capsys, monkeypatch):
    """The step metadata holds 10 int32 per token of --max-tokens-per-step (3 staged twice, 4 derived):
    a million tokens is 40 MB, past a free memory of 16 MiB; the tiny cache and the default sizes fit."""
    from m3_eagle_plugin.host.reference import build

    target, draft = tiny_pair
    monkeypatch.setattr(build, "_free_bytes", lambda device: 16 * 2**20)
    argv = ("--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, *argv, "--max-tokens-per-step", "1000000")
    assert rc == 2 and err.startswith("m3-eagle run: the step buffers") and err.count("\n") == 1
    assert "lower --max-batch-size or --max-tokens-per-step" in err
    # a million requests: at least 5 int32 per request staged twice (lengths, offsets), 40 MB
    rc, _, err = run_cli(capsys, *argv, "--max-batch-size", "1000000")
    assert rc == 2 and err.startswith("m3-eagle run: the step buffers for --max-batch-size 1000000")


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_a_prompts_file_without_a_prompt_is_a_setup_error_naming_it(tiny_pair, tmp_path, capsys, text):
    """It loaded the model, printed a zero stats line and exited 1 without a word about the cause."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    rc, out, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompts", str(path), "--max-new-tokens", "2")
    assert rc == 2 and out == ""
    assert err == f"m3-eagle run: --prompts {path}: no prompts (expected one JSON list of token ids per line)\n"


def test_an_unreadable_prompts_file_is_named_with_its_option(tiny_pair, tmp_path, capsys):
    """"[Errno 2] No such file or directory: 'x'" named no option, and a non-UTF-8 file's
    "'utf-8' codec can't decode byte 0xff ..." named neither the option nor the file."""
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"[1, 2]\n\xff\xfe\n")
    cases = ((tmp_path / "missing.jsonl", "cannot read it (No such file or directory)"),
             (tmp_path, "cannot read it (Is a directory)"),
             (binary, "not UTF-8 text (invalid start byte at byte 7)"))
    for path, why in cases:
        rc, _, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompts", str(path), "--max-new-tokens", "2")
        assert rc == 2 and err == f"m3-eagle run: --prompts {path}: {why}\n"


def test_swapped_target_and_draft_directories_are_named_as_such(tiny_pair, capsys, monkeypatch):
    """A draft passed as --model failed on "moe_layer_freq: required field is missing", a target as
    --draft on "hidden_size: required field is missing"; neither said the directories were swapped."""
    from m3_eagle_plugin.models.safetensors_source import SafetensorsSource

    target, draft = tiny_pair
    reads = []
    monkeypatch.setattr(SafetensorsSource, "get_many", lambda self, names: reads.append(names))
    rc, _, err = run_cli(capsys, "--model", str(draft), "--draft", str(target), "--prompt-ids", "1,2")
    assert rc == 2 and err == (f"m3-eagle run: --model {draft}: config.json describes an Eagle3 draft head, not a "
                               "MiniMax-M3 target (pass it as --draft, the target as --model)\n")
    rc, _, err = run_cli(capsys, "--model", str(target), "--draft", str(target), "--prompt-ids", "1,2")
    assert rc == 2 and err == (f"m3-eagle run: --draft {target}: config.json describes a MiniMax-M3 target, not an "
                               "Eagle3 draft head (the target goes to --model)\n")
    assert reads == []


@pytest.mark.parametrize("option, value, message", [
    ("--max-batch-size", "0", "--max-batch-size must be >= 1, got 0"),
    ("--max-tokens-per-step", "0", "--max-tokens-per-step must be >= 1, got 0"),
    ("--kv-blocks", "-1", "--kv-blocks must be >= 1, got -1"),
    ("--top-k", "-1", "--top-k must be >= 0, got -1"),
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1, got 0"),  # was one message for two options
    ("--draft-len", "-1", "--draft-len must be >= 0, got -1"),
    ("--temperature", "inf", "--temperature must be a finite number >= 0, got inf"),  # was accepted
    ("--temperature", "nan", "--temperature must be a finite number >= 0, got nan"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--force-accepted", "-1", "--force-accepted must be >= 0, got -1"),  # was named as the engine's field
    ("--force-accepted", "-0.5", "--force-accepted must be >= 0, got -0.5"),
    ("--eos-ids", "3,-2", "--eos-ids must be >= 0, got -2"),
    # 2**63 sampled exactly as seed 0 (the per-request seed is taken mod 2**63); a negative one as 2**63 - 1
    ("--seed", str(2**63), f"--seed must be in [0, 2**63), got {2**63}"),
    ("--seed", "-1", "--seed must be in [0, 2**63), got -1"),
])
def test_out_of_range_numbers_are_refused_naming_the_option(tiny_pair, capsys, option, value, message):
    rc, out, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                           option, value)
    assert (rc, out, err) == (2, "", f"m3-eagle run: {message}\n")


@pytest.mark.parametrize("argv, message", [
    # --draft-len 300 is past the default --max-tokens-per-step 256 (a verify row is 1 + 300 tokens)
    (["--draft-len", "300"], "--max-tokens-per-step (256) must hold one verify row of 1 + --draft-len = 301 tokens"),
    (["--draft-len", "2", "--force-accepted", "3"], "--force-accepted (3) exceeds the draft length (2)"),
    (["--eos-ids", "1,256"], "--eos-ids [256] are outside the vocabulary [0, 256): no generated token could ever "
                             "end a request with them"),
    # it took each verify step's bonus token as the argmax, and sampled only the first tokens, silently
    (["--force-accepted", "2", "--temperature", "0.7"], "--force-accepted (2) is a greedy benchmark mode: each "
     "verify step's bonus token is the target's argmax, so it cannot sample (--temperature 0.7); use --temperature 0"),
])
def test_settings_that_do_not_fit_together_are_named_by_their_options(tiny_pair, capsys, argv, message):
    """The engine checks how the settings fit together and names its fields (max_tokens_per_step,
    draft_len, force_accepted, eos_ids), which the user of the command line never typed."""
    target, draft = tiny_pair
    assert json.loads((target / "config.json").read_text())["text_config"]["vocab_size"] == 256
    rc, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2",
                           "--max-new-tokens", "2", *argv)
    assert (rc, out, err) == (2, "", f"m3-eagle run: {message}\n")


def test_a_prompts_file_with_a_byte_order_mark_reads_its_first_prompt(tmp_path):
    """UTF-8 with a BOM (as Notepad saves it): the first prompt failed as "not JSON (Unexpected UTF-8
    BOM ...)"; a bad byte after the mark is still named at its offset in the file."""
    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_bytes("\ufeff[1, 2, 3]\r\n[4]\r\n".encode("utf-8"))
    assert read_prompts(_args("--prompts", str(path))) == ([[1, 2, 3], [4]], [None, None])
    data = b"\xef\xbb\xbf[1]\n\xff\n"
    path.write_bytes(data)
    offset = data.index(b"\xff")  # 7: the mark's three bytes count
    with pytest.raises(ValueError, match=rf"not UTF-8 text \(invalid start byte at byte {offset}\)"):
        read_prompts(_args("--prompts", str(path)))


@pytest.mark.parametrize("fault, code", [(RuntimeError, None), (KeyboardInterrupt, 130)], ids=["error", "ctrl-c"])
def test_a_run_stopped_part_way_still_prints_the_requests_that_had_finished(tiny_pair, capsys, monkeypatch,
                                                                            fault, code):
    """One request at a time, the progress callback fails once the first has finished: its output (as a
    run without the fault prints it) is on stdout, the second is failed by name, then the error stands."""
    from m3_eagle_plugin.host.reference import cli

    target, draft = tiny_pair
    argv = ["--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2,3", "--prompt-ids", "7,8,9,10",
            "--max-new-tokens", "4", "--max-batch-size", "1", "--json"]
    rc, out, _ = run_cli(capsys, *argv)
    assert rc == 0
    whole = json.loads(out)

    def failing(self, done, total):
        if done >= 1:
            raise fault("stopped on purpose")

    monkeypatch.setattr(cli.ProgressBar, "__call__", failing)
    if code is None:
        with pytest.raises(RuntimeError, match="stopped on purpose"):
            main(["run", *argv])
        captured = capsys.readouterr()
        out, err = captured.out, captured.err
    else:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == code
    report = json.loads(out)
    assert report["outputs"] == [whole["outputs"][0], []]
    assert report["errors"] == [None, "engine stopped before the request finished"]
    assert report["kv_blocks_free_after"] == report["kv_blocks"]
    assert "the outputs above are the requests that had finished" in err


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_a_run_started_with_stdout_closed_ends_as_print_would(tiny_pair, capsys, monkeypatch, json_flag):
    """`m3-eagle run ... >&-`: Python starts with sys.stdout None, where print() writes nothing; the run
    generated everything, then failed writing its report (AttributeError traceback, exit 1)."""
    target, draft = tiny_pair
    monkeypatch.setattr("sys.stdout", None)
    rc = main(["run", "--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2", "--max-new-tokens", "2",
               *json_flag])
    assert rc == 0
    assert capsys.readouterr().err == ""


def test_the_checkpoints_eos_ends_requests_unless_eos_ids_says_otherwise(tiny_pair, tmp_path, capsys):
    """A checkpoint naming an eos_token_id stops where transformers' generate stops (the run went on to
    --max-new-tokens); `--eos-ids ""` turns it off; an eos past the vocabulary names the checkpoint."""
    import shutil

    target, draft = tiny_pair
    argv = ["--draft", str(draft), "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json"]
    rc, out, _ = run_cli(capsys, "--model", str(target), *argv)
    full = json.loads(out)["outputs"][0]
    assert rc == 0 and len(full) == 12
    stop = full[4]
    with_eos = tmp_path / "target"
    shutil.copytree(target, with_eos)
    raw = json.loads((with_eos / "config.json").read_text())
    raw["text_config"]["eos_token_id"] = stop
    (with_eos / "config.json").write_text(json.dumps(raw))
    rc, out, _ = run_cli(capsys, "--model", str(with_eos), *argv)
    assert rc == 0 and json.loads(out)["outputs"][0] == full[:full.index(stop) + 1]
    rc, out, _ = run_cli(capsys, "--model", str(with_eos), *argv, "--eos-ids", "")
    assert rc == 0 and json.loads(out)["outputs"][0] == full
    raw["text_config"]["eos_token_id"] = 10**6
    (with_eos / "config.json").write_text(json.dumps(raw))
    rc, _, err = run_cli(capsys, "--model", str(with_eos), *argv)
    assert rc == 2 and f"--model {with_eos}: its eos_token_id [1000000] is outside the vocabulary" in err


def test_a_prompt_nested_past_the_stack_fails_alone_naming_its_line(tmp_path):
    """json's decoder recurses per level: a RecursionError escaped read_prompts, and `m3-eagle run` ended in a
    traceback with no prompt run, not the one bad prompt failing alone (module docstring)."""
    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2]\n" + "[" * 100_000 + "]" * 100_000 + "\n[3]\n")
    prompts, errors = read_prompts(_args("--prompts", str(path)))
    assert prompts == [[1, 2], None, [3]]
    assert errors == [None, f"{path}:2: not JSON (nested too deeply)", None]


def test_a_prompt_with_an_integer_too_long_to_read_fails_alone_naming_its_line(tmp_path):
    """json refuses an integer literal past sys.get_int_max_str_digits with a bare ValueError, which
    escaped read_prompts (a traceback, no prompt run)."""
    from m3_eagle_plugin.host.reference.cli import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text("[1, 2]\n[" + "9" * 5000 + "]\n[3]\n")
    prompts, errors = read_prompts(_args("--prompts", str(path)))
    assert prompts == [[1, 2], None, [3]]
    assert errors[0] is None and errors[2] is None
    assert errors[1].startswith(f"{path}:2: not read as JSON (Exceeds the limit (4300 digits)")


def test_json_is_the_only_stdout_when_building_the_run_prints(tiny_pair, capsys, monkeypatch):
    """DESIGN: `--json` prints one JSON object on stdout. Building the plugin manager imports third-party
    plugins, and one that imports TensorRT-LLM prints its version line on stdout: it goes to stderr."""
    from m3_eagle_plugin import registry

    real = registry.get_plugin_manager

    def printing_manager(*args, **kwargs):
        print("[TensorRT-LLM] TensorRT-LLM version: 1.3.0rc24")
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "get_plugin_manager", printing_manager)
    target, _ = tiny_pair
    assert main(["run", "--model", str(target), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["outputs"][0]) == 2
    assert "[TensorRT-LLM] TensorRT-LLM version: 1.3.0rc24" in err


def test_draft_embeddings_picks_the_targets_or_the_shipped_embedding_and_lm_head(tiny_pair, tmp_path, capsys):
    """The tiny draft with random embedding and lm_head copies added: by default it drafts exactly as the
    tiny draft without them (the oracle: it shares the target's), with `own` it drafts from the copies
    (random: other acceptance). Greedy outputs are the target's either way."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from m3_eagle_plugin.models.tiny import HIDDEN, VOCAB

    target, draft = tiny_pair
    shipping = tmp_path / "draft"
    shutil.copytree(draft, shipping)
    tensors = load_file(str(shipping / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.randn(VOCAB, HIDDEN, generator=generator)
    save_file(tensors, str(shipping / "model.safetensors"))
    base = ("--model", str(target), "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8,7", "--max-new-tokens", "12",
            "--json")
    reports = {}
    for name, extra in (("oracle", ("--draft", str(draft))), ("default", ("--draft", str(shipping))),
                        ("target", ("--draft", str(shipping), "--draft-embeddings", "target")),
                        ("own", ("--draft", str(shipping), "--draft-embeddings", "own"))):
        rc, out, _ = run_cli(capsys, *base, *extra)
        assert rc == 0, name
        reports[name] = json.loads(out)
    counts = {name: (r["outputs"], r["draft_tokens"], r["accepted_tokens"]) for name, r in reports.items()}
    assert counts["default"] == counts["target"] == counts["oracle"]
    assert reports["own"]["outputs"] == reports["oracle"]["outputs"]
    assert reports["own"]["accepted_tokens"] != reports["oracle"]["accepted_tokens"]


@pytest.mark.parametrize("drafter, blocks", [
    ((), 3),  # nothing drafts: 3 prompt + 5 new + 1 bonus = 9 tokens, 3 blocks of 4
    (("--proposer", "prompt-lookup"), 6),  # + 4 x 3 draft positions ahead: 21 tokens, 6 blocks
    ("draft", 6),
])
def test_the_default_kv_blocks_are_sized_at_the_draft_length_the_engine_runs(tiny_pair, capsys, drafter, blocks):
    """Without a head or proposer the engine runs with no drafts, so --draft-len 3 must not add 12 draft
    positions per request to the cache (it doubled this run's blocks)."""
    from m3_eagle_plugin.models.tiny import BLOCK

    assert BLOCK == 4
    target, draft = tiny_pair
    extra = ("--draft", str(draft)) if drafter == "draft" else drafter
    rc, out, _ = run_cli(capsys, "--model", str(target), *extra, "--draft-len", "3", "--prompt-ids", "1,2,3",
                         "--max-new-tokens", "5", "--eos-ids", "", "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["kv_blocks"] == blocks and len(report["outputs"][0]) == 5


def _with_max_positions(target, out_dir, positions):
    """A copy of the tiny target whose config.json says `max_position_embeddings: positions`."""
    import shutil

    copy = out_dir / "target"
    shutil.copytree(target, copy)
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = positions
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("drafter", [(), ("--draft-len", "3", "--proposer", "prompt-lookup")])
def test_generation_stops_at_the_targets_max_position_embeddings(tiny_pair, tmp_path, capsys, drafter):
    """max_position_embeddings 16: prompts of 10 and 3 tokens get 16 - 10 = 6 and 16 - 3 = 13 of the 20 new
    tokens asked (the unlimited checkpoint's first ones: greedy), stop reason "length"; an 18-token prompt
    fails alone naming its length, the limit and its line. The run generated 20 tokens for each."""
    target, _ = tiny_pair
    limited = _with_max_positions(target, tmp_path, 16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n[1, 2, 3]\n\n" + json.dumps(list(range(1, 19))) + "\n")
    base = ("--prompts", str(prompts), "--max-new-tokens", "20", "--eos-ids", "", "--json", *drafter)
    rc, out, _ = run_cli(capsys, "--model", str(limited), *base)
    assert rc == 0
    report = json.loads(out)
    rc, out, _ = run_cli(capsys, "--model", str(target), *base)  # max_position_embeddings 4096
    unlimited = json.loads(out)
    assert [len(o) for o in unlimited["outputs"]] == [20, 20, 20]
    assert report["outputs"] == [unlimited["outputs"][0][:6], unlimited["outputs"][1][:13], []]
    assert report["stop_reasons"] == ["length", "length", None]
    assert report["errors"] == [None, None, f"{prompts}:4: prompt of 18 tokens leaves no room for a new token in "
                                            "the target's 16 positions (max_position_embeddings)"]


def test_engine_errors_name_a_prompts_files_line_as_its_parse_errors_do(tiny_pair, tmp_path, capsys):
    """A --prompts file's prompt is named FILE:LINE by the engine's checks too, not "request N" (N counting
    prompts from 0, not lines: request 3 was line 5 here); --prompt-ids keep "request N" (#N there)."""
    target, _ = tiny_pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2]\n[]\n\n[1, 300]\nnot json\n[1.5]\n")
    rc, out, _ = run_cli(capsys, "--model", str(target), "--prompts", str(prompts), "--max-new-tokens", "2")
    assert rc == 0
    assert out.splitlines()[1:5] == [f"[1] error: {prompts}:2: empty prompt",
                                     f"[2] error: {prompts}:4: token ids must be ints in [0, 256), got [300]",
                                     f"[3] error: {prompts}:5: not JSON (Expecting value)",
                                     f"[4] error: {prompts}:6: token ids must be ints in [0, 256), got [1.5]"]
    # the scheduler's "request N needs ..." form: 2 + 20 + 1 tokens do not fit 2 blocks of 4
    rc, out, _ = run_cli(capsys, "--model", str(target), "--prompts", str(prompts), "--max-new-tokens", "20",
                         "--kv-blocks", "2", "--json")
    assert rc == 1
    assert json.loads(out)["errors"][0].startswith(f"the prompt at {prompts}:1 needs 6 KV blocks of 4 tokens")
    rc, out, _ = run_cli(capsys, "--model", str(target), "--prompt-ids", "1,2", "--prompt-ids", "300",
                         "--prompt-ids", "1,x", "--max-new-tokens", "2", "--json")
    assert rc == 0
    assert json.loads(out)["errors"] == [None, "request 1: token ids must be ints in [0, 256), got [300]",
                                         "--prompt-ids #2: token ids must be comma-separated integers, got 'x' in "
                                         "'1,x'"]


def test_draft_len_0_with_a_draft_head_is_refused_before_any_weight_is_read(tiny_pair, capsys, monkeypatch):
    """--draft-len 0 loaded the head (its weights, its draft KV layer) and never ran it, with no word, as
    --proposer prompt-lookup with --draft did; without --draft, --draft-len 0 is a target-only run."""
    from m3_eagle_plugin.host.reference import build
    from m3_eagle_plugin.models.safetensors_source import SafetensorsSource

    target, draft = tiny_pair
    with monkeypatch.context() as patch:
        reads = []
        patch.setattr(SafetensorsSource, "get_many", lambda self, names: reads.append(names))
        patch.setattr(build, "build_engine", lambda *a, **k: pytest.fail("built an engine"))
        rc, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--draft-len", "0",
                               "--prompt-ids", "1,2")
        assert (rc, out, reads) == (2, "", [])
        assert err == (f"m3-eagle run: --draft-len 0 drafts nothing, so --draft {draft} would never run: leave out "
                       "--draft (target only) or pass a --draft-len >= 1\n")
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft-len", "0", "--prompt-ids", "1,2",
                         "--max-new-tokens", "3", "--eos-ids", "", "--json")
    report = json.loads(out)
    assert rc == 0 and len(report["outputs"][0]) == 3
    assert (report["draft_len"], report["draft_source"], report["draft_tokens"]) == (0, "none", 0)


def test_the_default_kv_blocks_count_the_new_tokens_the_position_limit_leaves(tiny_pair, tmp_path, capsys):
    """Generation stops at max_position_embeddings (16 here), but the default --kv-blocks was sized for
    --max-new-tokens as typed: 10**8 here, some 10**8 tokens of cache per prompt, refused as past free memory
    for a run that needs a few blocks. By hand, block size 4, --draft-len 3 (headroom 4 x 3 + 1 = 13): the
    3-token prompt gets 13 new tokens, 3 + 13 + 13 = 29 -> 8 blocks; the 10-token one 6, 10 + 6 + 13 = 29 ->
    8 blocks; the 18-token one fails alone, no blocks: 16 blocks. The outputs are those of runs asking
    exactly the room left (13 and 6 tokens)."""
    from m3_eagle_plugin.models.tiny import BLOCK

    assert BLOCK == 4
    target, draft = tiny_pair
    limited = _with_max_positions(target, tmp_path, 16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n" + json.dumps(list(range(1, 19))) + "\n")
    base = ("--model", str(limited), "--draft", str(draft), "--draft-len", "3", "--eos-ids", "", "--json")
    rc, out, err = run_cli(capsys, *base, "--prompts", str(prompts), "--max-new-tokens", str(10**8))
    assert rc == 0, err
    report = json.loads(out)
    per_prompt = [-(-(3 + 13 + 4 * 3 + 1) // 4), -(-(10 + 6 + 4 * 3 + 1) // 4)]
    assert report["kv_blocks"] == sum(per_prompt) == 16
    assert report["errors"][:2] == [None, None] and "leaves no room" in report["errors"][2]
    exact = []
    for ids, room in (("1,2,3", 13), ("1,2,3,4,5,6,7,8,9,10", 6)):
        rc, out, _ = run_cli(capsys, *base, "--prompt-ids", ids, "--max-new-tokens", str(room))
        assert rc == 0
        exact.append(json.loads(out)["outputs"][0])
    assert [len(o) for o in exact] == [13, 6]
    assert report["outputs"] == [*exact, []]
