"""The `m3-eagle` dispatcher with no sub-command, and make-tiny's default seed."""
from __future__ import annotations

import re

from m3_eagle_plugin import cli


def test_no_sub_command_prints_the_help_naming_every_command_and_exits_0(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: m3-eagle")
    for name in ("doctor", "make-tiny", "run", "bench"):  # README: m3-eagle doctor | make-tiny | run | bench
        assert re.search(rf"^ +{re.escape(name)}( |$)", out, re.M), name


def test_make_tiny_without_a_seed_is_seed_0(tmp_path, capsys):
    """make_tiny(out_dir, seed=0): the command's default is the API's."""
    assert cli.main(["make-tiny", str(tmp_path / "default"), "--train-steps", "0"]) == 0
    assert cli.main(["make-tiny", str(tmp_path / "zero"), "--seed", "0", "--train-steps", "0"]) == 0
    for part in ("target", "draft"):
        assert (tmp_path / "default" / part / "model.safetensors").read_bytes() == \
            (tmp_path / "zero" / part / "model.safetensors").read_bytes()
    assert "(draft head random)" in capsys.readouterr().out
