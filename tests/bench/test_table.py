"""bench.table: cells and columns written out by hand."""
from __future__ import annotations

from m3_eagle_plugin.bench.table import format_table


def cell(value, column="graph_us"):
    """The one cell of a one-row, one-column section."""
    lines = format_table([{column: value}]).splitlines()
    return lines[2].strip()


def test_float_cells_two_decimals_between_one_hundredth_and_a_hundred_thousand():
    assert cell(12.5) == "12.50"
    assert cell(0.01) == "0.01"
    assert cell(99999.0) == "99999.00"
    assert cell(100000.0) == "1e+05"  # 1e5 itself switches to 3 significant digits
    assert cell(123456.0) == "1.23e+05"
    assert cell(0.005) == "0.005"
    assert cell(0.0) == "0" and cell(-0.0) == "0"
    assert cell(float("nan")) == "nan" and cell(float("inf")) == "inf"
    assert cell(7) == "7" and cell("x") == "x"


def test_a_long_error_is_cut_to_its_limit_with_an_ellipsis():
    text = "e" * 100
    got = cell(text, "flashinfer_error")
    assert got == "e" * 57 + "..." and len(got) == 60
    assert cell("e" * 60, "flashinfer_error") == "e" * 60  # at the limit: kept whole
    assert cell(text, "note") == text  # no limit on other columns


def test_columns_are_right_aligned_under_a_dashed_rule():
    table = format_table([{"kernel": "abcdefgh", "section": "s"}, {"section": "s", "batch": 16}])
    assert table.splitlines() == [
        "section    kernel  batch",
        "-------  --------  -----",
        "      s  abcdefgh       ",
        "      s               16",
    ]


def test_one_table_per_section_in_first_seen_order():
    table = format_table([{"section": "b", "batch": 1}, {"section": "a", "context": 2}, {"section": "b", "batch": 3}])
    blocks = table.split("\n\n")
    assert [b.splitlines()[0].split() for b in blocks] == [["section", "batch"], ["section", "context"]]
    assert [line.split() for line in blocks[0].splitlines()[2:]] == [["b", "1"], ["b", "3"]]


def test_a_cell_of_several_lines_stays_on_its_rows_line():
    """A probe child's death carries its stderr tail (`flashinfer_peer.parse_probe_output`): the cell
    is written on one line, so each row stays one line under the header and the rule."""
    from m3_eagle_plugin.bench.flashinfer_peer import parse_probe_output

    case = (16, 32768, 4)
    fields = parse_probe_output('{"case": [16, 32768, 4], "started": true}\n', "exit code 1: x\nRuntimeError: y",
                                [case])[case]
    rows = [{"kernel": "index_select", "batch": b, **fields} for b in (16, 64)]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[2].split()[:2] == ["index_select", "16"] and lines[3].split()[:2] == ["index_select", "64"]
    assert lines[2].endswith("(exit code 1: x RuntimeEr...")  # cut to the column's 60 characters


def test_json_only_detail_stays_out_of_the_table():
    """`bytes`, `flashinfer_api`, `flashinfer_note` and `flashinfer_nvp_timing` are JSON detail (the
    module's contract): not columns of the printed table, while an unknown key still is one."""
    row = {"kernel": "sparse_attn", "bytes": 123456, "flashinfer_api": "msa_ops.x", "flashinfer_note": "n",
           "flashinfer_nvp_timing": "graph", "zeta": 1}
    assert format_table([row]).splitlines()[0].split() == ["kernel", "zeta"]


def test_an_unmeasured_acceptance_length_is_a_dash_and_a_missing_one_blank():
    """None in `mean_acceptance_length` is "nothing measured" (JSON null), written "-" as the
    reference host's text report writes it; a row without the key leaves the cell blank."""
    lines = format_table([{"batch": 1, "mean_acceptance_length": None}, {"batch": 2, "mean_acceptance_length": 3.5},
                          {"batch": 4}]).splitlines()
    assert lines[0].split() == ["batch", "mean_acceptance_length"]
    assert [line.split() for line in lines[2:]] == [["1", "-"], ["2", "3.50"], ["4"]]
    assert cell(None, "note") == ""  # other columns: None stays blank
