"""The measured ours-vs-FlashInfer table: the shipped file, the override, malformed files, the
nearest-row rule, the cached choice, and tables written from bench rows."""
from __future__ import annotations

import json

import pytest

from m3_eagle_plugin.msa.kernels import kernel_table as kt


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("M3_EAGLE_KERNEL_TABLE", raising=False)
    kt.clear_caches()
    yield
    kt.clear_caches()


def _row(kernel, batch, context, qo_len, ours, fi, **extra):
    return {"kernel": kernel, "batch": batch, "context": context, "qo_len": qo_len, "ours_us": ours,
            "flashinfer_us": fi, **extra}


def _table(rows, device="GPU X"):
    return kt.parse_table({"device": device, "date": "2026-12-01", "command": "m3-eagle bench", "rows": rows}, "t")


# --- the shipped table ------------------------------------------------------------------------------

def test_shipped_table_holds_the_h200_run():
    table = kt.load_table()
    assert table.shipped and table.source.endswith("peer_table_h200.json")
    assert (table.device, table.date, table.flashinfer) == ("NVIDIA H200", "2026-11-30", "0.7.4")
    assert "1x8192,1x32768,1x131072,16x8192,16x32768,16x131072,64x8192,64x32768,64x131072" in table.command
    got = {(r.kernel, r.batch, r.context, r.qo_len): (r.ours_us, r.flashinfer_us) for r in table.rows}
    # values as measured on the H200 (README "Performance"), copied from the run's output
    assert got[("index_select", 64, 32768, 4)] == (124.47, 130.75)
    assert got[("index_select", 1, 8192, 1)] == (3.77, 4.96)
    assert got[("sparse_attn", 16, 32768, 1)] == (7.86, 9.26)
    assert got[("sparse_step", 1, 8192, 4)] == (8.43, 12.85)
    assert got[("sparse_step", 16, 32768, 4)] == (50.17, 51.82)
    assert got[("sparse_step", 1, 131072, 4)] == (21.08, 21.8)
    # the dense rows from the later run against the plan-once prefill wrapper (twenty-third session)
    assert got[("dense_attn", 64, 32768, 4)] == (288.54, 326.04)
    assert got[("dense_attn", 1, 8192, 4)] == (9.71, 9.52)
    assert got[("dense_attn", 64, 8192, 1)] == (69.52, 73.21)
    assert got[("dense_attn_peer", 8, 4096, 4)] == (27.77, 31.41)
    assert len(table.rows) == 12 + 37  # index_select and sparse_attn at 3 configs, the rest at 9
    nvp = next(r for r in table.rows if (r.kernel, r.batch, r.qo_len) == ("index_select", 16, 4))
    assert "num_valid_pages" in nvp.note  # the top-k form the router runs


def test_shipped_table_verdicts_on_an_h200():
    def pick(kernel, batch, context, q_len):
        return kt.choose(kernel, batch=batch, context=context, q_len=q_len, device_name="NVIDIA H200",
                         eligible=(True, "")).backend
    assert pick("sparse_attention", 64, 32768, 4) == "flashinfer"     # 30.99 < 32.13
    assert pick("sparse_attention", 16, 32768, 1) == "triton"         # 9.26 > 7.86
    assert pick("sparse_attention", 1, 8192, 4) == "triton"           # 7.96 > 6.25
    assert pick("select_blocks_paged", 64, 32768, 4) == "triton"      # 130.75 > 124.47
    assert pick("select_blocks_paged", 16, 32768, 4) == "triton"      # 36.98 > 36.15
    assert pick("select_blocks_paged", 1, 8192, 4) == "triton"        # 4.80 > 3.98
    assert pick("sparse_attention", 16, 32768, 2) == "triton"         # no q_len 2 row
    # the layer's whole step (`sparse_step` rows)
    assert pick("sparse_layer_attention", 16, 32768, 4) == "triton"   # 51.82 > 50.17
    assert pick("sparse_layer_attention", 16, 32768, 1) == "triton"   # 45.67 > 44.79
    assert pick("sparse_layer_attention", 64, 32768, 4) == "triton"   # 162.72 > 157.06
    assert pick("sparse_layer_attention", 1, 131072, 4) == "triton"   # 21.80 > 21.08
    # dense layers: FlashInfer's prefill wrapper only where its row is faster (three shapes in this run)
    assert pick("dense_attention", 64, 131072, 1) == "flashinfer"     # 963.16 < 1007.09
    assert pick("dense_attention", 16, 131072, 4) == "flashinfer"     # 304.59 < 309.38
    assert pick("dense_attention", 1, 8192, 4) == "flashinfer"        # 9.52 < 9.71
    assert pick("dense_attention", 64, 32768, 1) == "triton"          # 252.66 > 250.59
    assert pick("dense_attention", 64, 32768, 4) == "triton"          # 326.04 > 288.54
    assert pick("dense_attention", 16, 131072, 1) == "triton"         # 251.17 > 249.45


# --- override and malformed files ----------------------------------------------------------------------

def test_env_override_replaces_the_shipped_table(tmp_path, monkeypatch):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"device": "GPU X", "date": "2027-01-02", "command": "m3-eagle bench --configs 2x64",
                                "rows": [_row("sparse_attn", 2, 64, 1, 3.0, None)]}))
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    table = kt.load_table()
    assert not table.shipped and table.source == str(path) and table.device == "GPU X"
    assert table.describe()["source"] == f"M3_EAGLE_KERNEL_TABLE={path}"
    assert [(r.kernel, r.flashinfer_us) for r in table.rows] == [("sparse_attn", None)]


GOOD = {"device": "GPU X", "date": "d", "command": "c", "rows": [_row("sparse_attn", 1, 64, 1, 2.0, 1.0)]}


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps([1, 2]), "expected a JSON object, got list"),
    (json.dumps({**GOOD, "device": ""}), "'device' must be a non-empty string"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "date"}), "'date' must be a non-empty string, got None"),
    (json.dumps({**GOOD, "rows": {"a": 1}}), "'rows' must be a list, got dict"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 0, 64, 1, 2.0, 1.0)]}),
     "rows[0].batch must be a positive integer, got 0"),
    (json.dumps({**GOOD, "rows": [GOOD["rows"][0], _row("attention", 1, 64, 1, 2.0, 1.0)]}),
     "rows[1].kernel must be one of"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, "fast", 1.0)]}),
     "rows[0].ours_us must be a positive number, got 'fast'"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 2.0, -1.0)]}),
     "rows[0].flashinfer_us must be a positive number or null, got -1.0"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 2.0, 1.0, speedup=2)]}),
     "rows[0] has unknown field(s) ['speedup']"),
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
    (b"[" * 100000, "not valid JSON (RecursionError"),
    ("", "the file is empty"),
    (" \n\t\n", "the file is empty"),
    (json.dumps({**GOOD, "devices": "GPU X"}), "unknown field(s) ['devices']"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 10 ** 400, 1.0)]}),  # float() overflows
     "rows[0].ours_us must be a positive number, got 1000"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 2.0, -(10 ** 400))]}),
     "rows[0].flashinfer_us must be a positive number or null, got -1000"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, float("nan"), 1.0)]}),  # json writes NaN
     "rows[0].ours_us must be a positive number, got nan"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 2.0, float("inf"))]}),
     "rows[0].flashinfer_us must be a positive number or null, got inf"),
    (json.dumps({**GOOD, "command": ""}), "'command' must be a non-empty string, got ''"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "command"}), "'command' must be a non-empty string, got None"),
    (json.dumps({**GOOD, "device": " \t"}), "'device' must be a non-empty string"),
    (json.dumps({**GOOD, "flashinfer": 0.74}), "'flashinfer' must be a string, got 0.74"),
    (json.dumps({**GOOD, "notes": ["a"]}), "'notes' must be a string, got ['a']"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 0, 2.0, 1.0)]}),
     "rows[0].qo_len must be a positive integer, got 0"),
    (json.dumps({**GOOD, "rows": [_row("sparse_attn", 1, 64, 1, 2.0, 1.0, note=3)]}),
     "rows[0].note must be a string, got 3"),
])
def test_malformed_override_names_the_file_and_the_problem(tmp_path, monkeypatch, content, problem):
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    with pytest.raises(kt.KernelTableError) as info:
        kt.load_table()
    assert str(path) in str(info.value) and problem in str(info.value), str(info.value)


@pytest.mark.parametrize("second, what", [
    (_row("sparse_attn", 16, 32768, 4, 20.0, 30.0), "different times"),  # the choice would hang on row order
    (_row("sparse_attn", 16, 32768, 4, 20.0, 10.0), "identical"),         # doctor would list it twice
])
def test_a_shape_measured_twice_is_refused_naming_both_rows(tmp_path, monkeypatch, second, what):
    path = tmp_path / "twice.json"
    rows = [_row("sparse_attn", 16, 32768, 4, 20.0, 10.0), _row("sparse_attn", 16, 32768, 1, 9.0, None), second]
    text = json.dumps({"device": "GPU X", "date": "d", "command": "c", "rows": rows}, indent=1)
    path.write_text(text)
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    with pytest.raises(kt.KernelTableError) as info:
        kt.load_table()
    message = str(info.value)
    assert message.startswith(f"kernel table {path}: rows[2] measures sparse_attn B16/32K q4 again (rows[0])"), message
    assert what in message, message
    # the same rule where no file is read (a table written from bench rows)
    with pytest.raises(kt.KernelTableError, match=r"kernel table t: rows\[2\] measures sparse_attn B16/32K q4 again "
                                                  r"\(rows\[0\]\)"):
        _table(rows)


def test_the_same_shape_for_another_kernel_or_q_len_is_not_a_repeat():
    rows = [_row("sparse_attn", 16, 32768, 4, 20.0, 10.0), _row("sparse_attn", 16, 32768, 1, 9.0, None),
            _row("index_select", 16, 32768, 4, 40.0, 30.0), _row("sparse_attn", 16, 8192, 4, 9.0, None)]
    assert len(_table(rows).rows) == 4


@pytest.mark.parametrize("text, problem", [
    ('{"device": "GPU X", "device": "GPU Y", "date": "d", "command": "c", "rows": []}',
     "kernel table {path}: field(s) ['device'] given more than once"),
    ('{"device": "GPU X", "date": "d", "command": "c", "rows": [\n'
     ' {"kernel": "sparse_attn", "batch": 1, "context": 64, "qo_len": 1, "ours_us": 2.0, "ours_us": 9.0}]}',
     "kernel table {path}: rows[0] has field(s) ['ours_us'] given more than once"),
])
def test_a_repeated_json_key_is_refused(tmp_path, monkeypatch, text, problem):
    """JSON decoders keep the last of a repeated key: the file would say two things, one silently."""
    path = tmp_path / "keys.json"
    path.write_text(text)
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    with pytest.raises(kt.KernelTableError) as info:
        kt.load_table()
    assert problem.format(path=path) in str(info.value), str(info.value)


def test_check_override_loads_the_named_table_once(tmp_path, monkeypatch):
    assert kt.check_override() is None  # unset: the shipped table, nothing to check
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(GOOD))
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(path))
    table = kt.check_override()
    assert table.source == str(path) and kt.load_table() is table
    path.write_text("{broken")  # read once per path: the checked table is the one the choices use
    assert kt.check_override() is table
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(tmp_path / "gone.json"))
    with pytest.raises(kt.KernelTableError, match="gone.json: cannot read"):
        kt.check_override()


def test_missing_override_file(tmp_path, monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", str(tmp_path / "nowhere.json"))
    with pytest.raises(kt.KernelTableError, match="nowhere.json: cannot read"):
        kt.load_table()


# --- nearest row and the choice --------------------------------------------------------------------------

ROWS = [_row("sparse_attn", 16, 32768, 4, 20.0, 10.0),   # FlashInfer faster at B16
        _row("sparse_attn", 64, 32768, 4, 40.0, 50.0),   # ours faster at B64
        _row("sparse_attn", 64, 8192, 4, 30.0, 20.0),    # FlashInfer faster at B64 / 8K
        _row("sparse_attn", 16, 32768, 1, 9.0, None),    # q1: FlashInfer not measured
        _row("index_select", 16, 32768, 4, 40.0, 30.0)]


@pytest.mark.parametrize("batch, context, q_len, expect", [
    (16, 32768, 4, (16, 32768)),    # exact
    (8, 4096, 4, (16, 32768)),      # batch decides first (log2 distance 1 vs 3)
    (128, 32768, 4, (64, 32768)),
    (64, 16384, 4, (64, 8192)),     # tie in context (1 each way): the smaller measured context
    (32, 32768, 4, (16, 32768)),    # tie in batch: the smaller measured batch
    (64, 4096, 4, (64, 8192)),
    (16, 32768, 1, (16, 32768)),
])
def test_nearest_row(batch, context, q_len, expect):
    row = _table(ROWS).nearest("sparse_attn", batch, context, q_len)
    assert (row.batch, row.context, row.qo_len) == expect + (q_len,)


@pytest.mark.parametrize("batch, context, expect", [
    (20, 8192, (16, 8192)),      # 20/16 == 25/20: a tie in batch, the smaller measured batch
    (2, 20000, (2, 16000)),      # 20000/16000 == 25000/20000: a tie in context, the smaller context
])
def test_nearest_row_ties_off_powers_of_two(batch, context, expect):
    """Ties decided exactly: float log2 rounds |log2(20/16)| above |log2(20/25)|."""
    rows = [_row("sparse_attn", 16, 8192, 4, 10.0, 5.0), _row("sparse_attn", 25, 8192, 4, 10.0, 50.0),
            _row("sparse_attn", 2, 16000, 4, 10.0, 5.0), _row("sparse_attn", 2, 25000, 4, 10.0, 50.0)]
    row = _table(rows).nearest("sparse_attn", batch, context, 4)
    assert (row.batch, row.context) == expect
    assert _choose("sparse_attention", batch, context, 4, rows=rows).backend == "flashinfer"  # the smaller row's


def test_nearest_row_needs_the_same_kernel_and_q_len():
    table = _table(ROWS)
    assert table.nearest("sparse_attn", 16, 32768, 2) is None
    assert table.nearest("dense_attn", 16, 32768, 4) is None


def _choose(kernel, batch, context, q_len, device="GPU X", eligible=(True, "ok"), rows=ROWS):
    return kt.choose(kernel, batch=batch, context=context, q_len=q_len, device_name=device, eligible=eligible,
                     table=_table(rows))


def test_choice_follows_the_nearest_row():
    assert _choose("sparse_attention", 8, 32768, 4).backend == "flashinfer"
    slower = _choose("sparse_attention", 64, 32768, 4)
    assert slower.backend == "triton" and "ours 40 us <= FlashInfer 50 us" in slower.reason
    assert _choose("sparse_attention", 64, 8192, 4).backend == "flashinfer"
    assert _choose("select_blocks_paged", 16, 32768, 4).backend == "flashinfer"


@pytest.mark.parametrize("kwargs, reason", [
    ({"eligible": (False, "K and V are not interleaved")}, "FlashInfer not eligible: K and V are not interleaved"),
    ({"device": "GPU Y"}, "table measured on GPU X, this device is GPU Y"),
    ({"q_len": 2}, "no sparse_attn row with q_len 2"),
    ({"q_len": 1}, "has no FlashInfer time"),
])
def test_choice_is_ours_otherwise_with_the_reason(kwargs, reason):
    args = {"batch": 16, "context": 32768, "q_len": 4, **kwargs}
    choice = _choose("sparse_attention", args.pop("batch"), args.pop("context"), args.pop("q_len"), **args)
    assert choice.backend == "triton" and reason in choice.reason, choice.reason


def test_choice_is_cached_per_shape():
    table = _table(ROWS)
    first = kt.choose("sparse_attention", batch=8, context=4096, q_len=4, device_name="GPU X",
                      eligible=(True, ""), table=table)
    hits = kt._decide.cache_info().hits
    again = kt.choose("sparse_attention", batch=8, context=4096, q_len=4, device_name="GPU X",
                      eligible=(True, ""), table=table)
    assert again is first and kt._decide.cache_info().hits == hits + 1


# --- written from bench rows ---------------------------------------------------------------------------

def test_table_from_bench_rows():
    rows = [
        {"kernel": "index_select", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 20.0, "flashinfer_us": 18.0,
         "flashinfer_topk_us": 5.0, "flashinfer_nvp_us": 6.0},
        {"kernel": "index_select", "batch": 4, "context": 8192, "qo_len": 1, "graph_us": 19.0, "flashinfer_us": 17.0},
        {"kernel": "sparse_attn", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 7.0,
         "flashinfer_error": "msa_sparse_decode_attention: RuntimeError: boom"},
        {"kernel": "kv_lens_update", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 2.0},
        {"kernel": "dense_attn_peer", "batch": 8, "context": 4096, "qo_len": 4, "graph_us": 35.0,
         "flashinfer_us": 41.0, "flashinfer_timing": "eager"},
    ]
    data = kt.table_from_bench_rows(rows, device="GPU Z", date="2027-02-03", command="m3-eagle bench x",
                                    flashinfer="0.7.5")
    assert (data["device"], data["date"], data["command"], data["flashinfer"]) == (
        "GPU Z", "2027-02-03", "m3-eagle bench x", "0.7.5")
    got = {(r["kernel"], r["qo_len"]): r for r in data["rows"]}
    assert set(got) == {("index_select", 4), ("index_select", 1), ("sparse_attn", 4), ("dense_attn_peer", 4)}
    assert got[("index_select", 4)]["ours_us"] == 20.0
    assert got[("index_select", 4)]["flashinfer_us"] == 19.0          # 18 - 5 + 6: score + the nvp top-k
    assert got[("index_select", 1)]["flashinfer_us"] == 17.0 and "default top-k" in got[("index_select", 1)]["note"]
    assert got[("sparse_attn", 4)]["flashinfer_us"] is None and "boom" in got[("sparse_attn", 4)]["note"]
    assert "eager" in got[("dense_attn_peer", 4)]["note"]
    table = kt.parse_table(json.loads(json.dumps(data)), "round trip")
    assert len(table.rows) == 4


def test_only_index_selection_rows_take_the_num_valid_pages_top_k_time():
    """The top-k substitution is index selection's (`_bench_flashinfer_us`): another kernel's FlashInfer
    time is kept as measured, with no top-k note, whatever extra fields its bench row carries."""
    row = {"kernel": "sparse_attn", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 7.0, "flashinfer_us": 9.0,
           "flashinfer_topk_us": 5.0, "flashinfer_nvp_us": 6.0}
    (entry,) = kt.table_from_bench_rows([row], device="GPU Z", date="d", command="c")["rows"]
    assert entry["flashinfer_us"] == 9.0 and "note" not in entry


@pytest.mark.parametrize("fields", [dict(flashinfer_us=0.0), dict(flashinfer_us=float("nan")),
                                    dict(flashinfer_us=5.0, flashinfer_topk_us=6.0, flashinfer_nvp_us=0.5)])
def test_a_flashinfer_time_that_is_not_positive_is_written_as_not_measured(fields):
    """The format takes a positive FlashInfer time or null: a bench row whose time (as measured, or
    after the top-k substitution: 5 - 6 + 0.5 < 0) is no positive number is written as null, ours
    still measured, not a table the writer itself refuses."""
    row = {"kernel": "index_select", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 7.0, **fields}
    (entry,) = kt.table_from_bench_rows([row], device="GPU Z", date="d", command="c")["rows"]
    assert entry["ours_us"] == 7.0 and entry["flashinfer_us"] is None


def test_a_num_valid_pages_time_without_the_default_top_k_time_keeps_the_measured_time():
    """The substitution needs both top-k times (`fi - topk + nvp`); with only the num_valid_pages
    one, FlashInfer's time stays as measured, noted as the default top-k form."""
    row = {"kernel": "index_select", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 7.0,
           "flashinfer_us": 9.0, "flashinfer_nvp_us": 6.0}
    (entry,) = kt.table_from_bench_rows([row], device="GPU Z", date="d", command="c")["rows"]
    assert entry["flashinfer_us"] == 9.0 and "default top-k" in entry["note"]


def test_a_rows_verdict_calls_a_tie_ours_as_the_choice_does():
    tie, faster, slower = (kt.TableRow("sparse_attn", 16, 32768, 4, 10.0, fi) for fi in (10.0, 9.5, 12.0))
    assert tie.verdict() == "B16/32K q4 -> ours (ours 10 / FlashInfer 10 us)"
    assert faster.verdict() == "B16/32K q4 -> flashinfer (ours 10 / FlashInfer 9.5 us)"
    assert slower.verdict() == "B16/32K q4 -> ours (ours 10 / FlashInfer 12 us)"


def test_device_names_match_whatever_their_case_and_blanks():
    assert _choose("sparse_attention", 16, 32768, 4, device=" gpu x ").backend == "flashinfer"
    assert _table(ROWS, device=" GPU X\n").describe()["device"] == "GPU X"  # shown by doctor without the blanks


def test_an_empty_context_is_read_as_one_token():
    """A step with a zero-width block table and no staged length has context 0: the nearest row is then
    the one nearest a context of 1 (the smallest measured context), not a division by zero."""
    choice = _choose("sparse_attention", 64, 0, 4)
    assert (choice.row.batch, choice.row.context) == (64, 8192) and choice.backend == "flashinfer"


def test_a_blank_override_means_the_shipped_table(monkeypatch):
    monkeypatch.setenv("M3_EAGLE_KERNEL_TABLE", "  ")
    table = kt.load_table()
    assert table.shipped and table.source == str(kt.SHIPPED_PATH)
    assert kt.check_override() is None


def test_bench_rows_are_written_to_the_hundredth_and_validated():
    """The table keeps times to 0.01 us (as the shipped file), and a table written from bench rows is
    validated like a file: a shape measured twice is refused there, not when the table is read."""
    row = {"kernel": "sparse_attn", "batch": 4, "context": 8192, "qo_len": 4, "graph_us": 12.345678,
           "flashinfer_us": 9.87654}
    data = kt.table_from_bench_rows([row], device="GPU Z", date="d", command="c")
    assert (data["rows"][0]["ours_us"], data["rows"][0]["flashinfer_us"]) == (12.35, 9.88)
    with pytest.raises(kt.KernelTableError, match=r"kernel table \(bench rows\): rows\[1\] measures sparse_attn"):
        kt.table_from_bench_rows([row, {**row, "graph_us": 11.0}], device="GPU Z", date="d", command="c")


@pytest.mark.parametrize("kernel, fields, routed, why", [
    # the bench's fallback where the decode form refused the shape (`flashinfer_peer._attention`)
    ("sparse_attn", {"flashinfer_api": "msa_sparse_attention"}, False, "timed msa_sparse_attention, not "
                                                                        "msa_sparse_decode_attention"),
    ("sparse_step", {"flashinfer_api": "msa_proxy_score(paged, causal) + msa_topk_select(force_end_blocks=1) + "
                                       "msa_sparse_attention"}, False, "not msa_sparse_decode_attention"),
    ("sparse_attn", {"flashinfer_api": "msa_sparse_decode_attention"}, True, None),
    ("sparse_step", {"flashinfer_api": "msa_proxy_score(paged, causal) + msa_topk_select(force_end_blocks=1) + "
                                       "msa_sparse_decode_attention"}, True, None),
    # the num_valid_pages top-k the router runs died in the probe's child process
    ("index_select", {"flashinfer_topk_us": 5.0, "flashinfer_nvp_error": "child process died in this case "
                      "(exit code -6: illegal memory access)"}, False, "num_valid_pages top-k (the form the router "
                                                                       "runs) failed: child process died"),
])
def test_a_flashinfer_time_of_another_form_than_the_routed_one_is_not_written(kernel, fields, routed, why):
    """The table decides which form the router runs (`flashinfer_msa`: the decode attention, the
    num_valid_pages top-k): a FlashInfer time the bench took of another form, or none where that form
    failed, routed the call to a form never measured there (or one that crashed)."""
    row = {"kernel": kernel, "batch": 16, "context": 32768, "qo_len": 4, "graph_us": 20.0, "flashinfer_us": 12.0,
           **fields}
    data = kt.table_from_bench_rows([row], device="GPU X", date="d", command="c")
    (entry,) = data["rows"]
    dispatcher = {"sparse_attn": "sparse_attention", "sparse_step": "sparse_layer_attention",
                  "index_select": "select_blocks_paged"}[kernel]
    choice = kt.choose(dispatcher, batch=16, context=32768, q_len=4, device_name="GPU X", eligible=(True, ""),
                       table=kt.parse_table(data, "written"))
    assert (choice.backend == "flashinfer") is routed, choice.reason
    assert entry["flashinfer_us"] == (12.0 if routed else None)
    assert (entry.get("note") is None) if why is None else (why in entry["note"]), entry


def test_a_whole_step_is_not_written_where_the_routed_top_k_failed_at_its_shape():
    """FlashInfer's whole step runs the num_valid_pages top-k (`backend.sparse_layer_attention`): where
    the bench's probe of that top-k failed at a shape, the step's FlashInfer time there (taken with the
    default top-k) is not written; at another shape it is."""
    step = {"kernel": "sparse_step", "batch": 16, "context": 32768, "qo_len": 4, "graph_us": 20.0,
            "flashinfer_us": 12.0}
    index = {"kernel": "index_select", "batch": 16, "context": 32768, "qo_len": 4, "graph_us": 40.0,
             "flashinfer_us": 30.0, "flashinfer_topk_us": 5.0, "flashinfer_nvp_error": "illegal memory access"}
    rows = [step, {**step, "qo_len": 1}, index, {**index, "qo_len": 1, "flashinfer_nvp_us": 4.0,
                                                  "flashinfer_nvp_error": None}]
    data = kt.table_from_bench_rows(rows, device="GPU X", date="d", command="c")
    table = kt.parse_table(data, "written")

    def pick(q_len):
        return kt.choose("sparse_layer_attention", batch=16, context=32768, q_len=q_len, device_name="GPU X",
                         eligible=(True, ""), table=table).backend
    assert (pick(4), pick(1)) == ("triton", "flashinfer")
    got = {(r["kernel"], r["qo_len"]): r for r in data["rows"]}
    assert got[("sparse_step", 4)]["flashinfer_us"] is None
    assert "num_valid_pages top-k (the form the router runs) failed: illegal memory access" in got[("sparse_step", 4)][
        "note"]
    assert got[("sparse_step", 1)]["flashinfer_us"] == 12.0 and got[("index_select", 1)]["flashinfer_us"] == 29.0
