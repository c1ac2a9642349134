"""`m3-eagle run`: documented defaults, the forced-acceptance note, prompt-lookup drafting and the
exit status of a setup that does not fit in memory (2), checked against hand-written values."""
from __future__ import annotations

import json

import pytest

from m3_eagle_plugin.cli import main


def run_cli(capsys, *argv):
    rc = main(["run", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_draft_length_defaults_to_3(tiny_pair, capsys):
    """--help: "draft tokens per verify step (default 3)"."""
    target, draft = tiny_pair
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--prompt-ids", "1,2",
                         "--max-new-tokens", "2", "--json")
    assert rc == 0 and json.loads(out)["draft_len"] == 3


@pytest.mark.parametrize("given, shown", [("2", "2"), ("2.0", "2"), ("0", "0")])
def test_the_forced_acceptance_note_shows_a_whole_count_as_an_integer(tiny_pair, capsys, given, shown):
    """'2' keeps the integer behaviour (a whole number of drafts); 0 is forced acceptance too."""
    target, draft = tiny_pair
    rc, out, _ = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--draft-len", "2",
                         "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--force-accepted", given)
    assert rc == 0
    assert out.splitlines()[0] == (f"forced acceptance: up to {shown} drafts per verify step (those proposed) are accepted regardless "
                                   "(benchmark mode; outputs are NOT the target's)")


def test_an_empty_item_between_ids_does_not_cut_the_prompt_short():
    import argparse

    from m3_eagle_plugin.host.reference.cli import add_arguments, read_prompts

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    prompts, errors = read_prompts(parser.parse_args(["--model", "x", "--prompt-ids", "1,,2", "--prompt-ids", ",3"]))
    assert prompts[0] in ([1, 2], None) and prompts[1] in ([3], None)  # never [1] or []: silently truncated
    assert (prompts[0] is None) == (errors[0] is not None)


def test_a_draft_head_named_by_its_architecture_alone_is_refused_as_the_model(tmp_path, capsys):
    """EAGLE3 heads name themselves in `architectures` (e.g. Eagle3LlamaForCausalLM) without always
    carrying an eagle_config."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["Eagle3LlamaForCausalLM"], "hidden_size": 64}))
    rc, out, err = run_cli(capsys, "--model", str(head), "--prompt-ids", "1,2")
    assert (rc, out) == (2, "")
    assert err == (f"m3-eagle run: --model {head}: config.json describes an Eagle3 draft head, not a MiniMax-M3 "
                   "target (pass it as --draft, the target as --model)\n")


def test_prompt_lookup_drafts_without_a_draft_head(tiny_pair, capsys):
    """--proposer prompt-lookup drafts from n-grams of the prompt: no Eagle3 head needed."""
    target, _ = tiny_pair
    rc, out, _ = run_cli(capsys, "--model", str(target), "--proposer", "prompt-lookup", "--draft-len", "2",
                         "--prompt-ids", "5,6,7,5,6,7,5,6,7,5,6", "--max-new-tokens", "6", "--json")
    report = json.loads(out)
    assert rc == 0 and report["draft_source"] != "none" and report["draft_tokens"] > 0


def test_prompt_lookup_with_a_draft_head_is_refused_before_loading(tiny_pair, capsys, monkeypatch):
    """The head was loaded and its draft layer's KV allocated, then never run: the proposer drafts."""
    from m3_eagle_plugin.host.reference import build

    monkeypatch.setattr(build, "build_engine", lambda *a, **k: pytest.fail("built an engine"))
    target, draft = tiny_pair
    rc, out, err = run_cli(capsys, "--model", str(target), "--draft", str(draft), "--proposer", "prompt-lookup",
                           "--prompt-ids", "1,2")
    assert (rc, out) == (2, "")
    assert err == (f"m3-eagle run: --proposer prompt-lookup drafts from the prompt, so --draft {draft} would never "
                   "run: pass one of them\n")


def test_an_allocation_failure_while_building_is_exit_2_naming_the_options(tiny_pair, capsys, monkeypatch):
    from m3_eagle_plugin.host.reference import build

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes")

    monkeypatch.setattr(build, "build_engine", no_memory)
    rc, out, err = run_cli(capsys, "--model", str(tiny_pair[0]), "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert (rc, out) == (2, "") and err.count("\n") == 1
    assert err.startswith("m3-eagle run: not enough memory for these settings (DefaultCPUAllocator: can't allocate")
    assert err.endswith("lower --max-batch-size, --max-tokens-per-step or --kv-blocks\n")
    monkeypatch.setattr(build, "build_engine", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # not an allocation failure: not hidden as one
        main(["run", "--model", str(tiny_pair[0]), "--prompt-ids", "1,2", "--max-new-tokens", "2"])


def test_every_default_the_help_states_is_the_parsers():
    """`m3-eagle run --help` states defaults in words ("(default 32)", "default cpu", "0 = off
    (default)"); each must be what an omitted option gives."""
    import argparse
    import re

    from m3_eagle_plugin.host.reference.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    stated = {}
    for action in parser._actions:
        text = action.help or ""
        match = re.search(r"default (\S+?)[;) ]|default (\S+)$|(\S+) = \S+ \(default\)", text)
        if match:
            stated[action.option_strings[0]] = next(g for g in match.groups() if g is not None)
    assert len(stated) >= 10, stated
    defaults = vars(parser.parse_args(["--model", "x"]))
    for option, word in stated.items():
        value = defaults[option.lstrip("-").replace("-", "_")]
        assert word == str(value) or float(word) == value, (option, word, value)


@pytest.mark.parametrize("option", ["--model", "--draft", "--prompts"])
def test_an_empty_path_is_refused_by_its_option_not_read_as_the_current_directory(tiny_pair, capsys, monkeypatch,
                                                                                  option):
    """`--draft "$DRAFT"` with DRAFT unset, run from inside an Eagle3 head's directory: the head there was
    loaded without a word (Path("") is "."); an empty --prompts read "." ("Is a directory")."""
    target, draft = tiny_pair
    monkeypatch.chdir(draft if option == "--draft" else target)
    argv = {"--model": ["--model", ""], "--draft": ["--model", str(target), "--draft", ""],
            "--prompts": ["--model", str(target), "--prompts", ""]}[option]
    with pytest.raises(SystemExit) as exit_:
        run_cli(capsys, *argv, "--max-new-tokens", "2", "--json")
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    assert err.endswith(f"m3-eagle run: error: argument {option}: an empty path (give a path, or leave the option "
                        "out)\n")
