"""`m3-eagle bench`: the kernel performance suite (plus the end-to-end hook), a table printed last.

On CUDA with Triton: every kernel checked against the naive torch reference and timed eager and
graph-replayed, against the byte floor at a copy ceiling measured in the same run; where
FlashInfer imports (`--flashinfer auto`), its MSA ops and paged prefill wrapper are timed beside
ours on the same inputs (bench/flashinfer_peer.py); `--write-table PATH` saves those pairs as the
kernel table the backend choice reads (`M3_EAGLE_KERNEL_TABLE`). Elsewhere: a tiny
reference-only smoke table, so the command (and CI) works on any machine.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from m3_eagle_plugin.cli import positive_int

from . import e2e  # also registers the end-to-end runner behind --e2e
from .end_to_end import run_end_to_end
from .inputs import Geometry
from .kernel_suite import KERNELS, StepSet, run_kernel_suite
from .table import format_table, json_safe

DEFAULT_CONFIGS = "1x8192,16x32768,64x32768,64x131072"
SMOKE_CONFIGS = [(2, 256)]  # the CPU smoke table's default
MAX_CONFIG = 2**31 - 1  # the metadata holds positions and lengths as int32
SMOKE_KERNELS = ("index_select", "sparse_attn", "dense_attn")  # what the CPU smoke table times
DTYPES = {"fp8": getattr(torch, "float8_e4m3fn", None), "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp32": torch.float32}


def parse_configs(text: str) -> list[tuple[int, int]]:
    """'16x32768,64x32K' -> [(16, 32768), (64, 32768)]."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            b, c = item.lower().split("x")
            c = int(c[:-1]) * 1024 if c.endswith("k") else int(c)
            out.append((int(b), c))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"bad config {item!r}: expected BATCHxCONTEXT, e.g. 16x32K") from exc
        if out[-1][0] < 1 or out[-1][1] < 1:
            raise argparse.ArgumentTypeError(f"bad config {item!r}: batch and context must be >= 1")
        if max(out[-1]) > MAX_CONFIG:  # past it torch refused the shape with an OverflowError traceback
            raise argparse.ArgumentTypeError(f"bad config {item!r}: batch and context must be <= {MAX_CONFIG} "
                                             "(int32 positions and lengths)")
        if out[-1] in out[:-1]:  # the kernel table keeps one row a shape (`kernel_table`)
            raise argparse.ArgumentTypeError(f"config {item!r} repeats {out[-1][0]}x{out[-1][1]}")
    if not out:  # else the default shapes ran in their place (on a GPU: the whole default suite)
        raise argparse.ArgumentTypeError(f"no BATCHxCONTEXT in {text!r}: expected e.g. 16x32K (omit --configs "
                                         "for the default shapes)")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", type=parse_configs, default=None,
                        help=f"BATCHxCONTEXT list (GPU default {DEFAULT_CONFIGS})")
    parser.add_argument("--qo-lens", default="4,1", help="query tokens per request to time (default 4,1)")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma list of kernels (default all: {', '.join(KERNELS)}; the CPU smoke table times "
                             f"{', '.join(SMOKE_KERNELS)} only)")
    parser.add_argument("--kv-dtype", choices=sorted(DTYPES), default="fp8", help="sparse-layer K/V dtype")
    parser.add_argument("--dense-kv-dtype", choices=sorted(DTYPES), default="bf16", help="dense-layer K/V dtype")
    parser.add_argument("--sets", type=positive_int, default=3, help="input sets rotated while timing (default 3)")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with the torch reference")
    parser.add_argument("--no-reference-timing", action="store_true", help="do not time the torch reference")
    parser.add_argument("--flashinfer", choices=("auto", "off"), default="auto",
                        help="time FlashInfer beside ours on the same inputs when it imports (auto, the default: "
                             "its MSA ops in the sparse rows, its paged prefill wrapper in the dense ones) or never")
    parser.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                        help="time ours and FlashInfer alternately N times per FlashInfer row and report the medians "
                             "(default 1)")
    parser.add_argument("--e2e", action="store_true", help="also run the end-to-end section")
    e2e.add_arguments(parser)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--json", metavar="PATH", nargs="?", const="-", default=None,
                        help="all rows and context as JSON: one object on stdout (the table then goes to "
                             "stderr), or written to PATH")
    parser.add_argument("--write-table", metavar="PATH", default=None,
                        help="write the measured ours-vs-FlashInfer kernel rows as a kernel table (the format of "
                             "M3_EAGLE_KERNEL_TABLE, which the backend choice reads); GPU runs only")


def _gpu_rows(args: argparse.Namespace, device: torch.device, log) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from m3_eagle_plugin.msa.kernels import backend_report

    from .timing import copy_ceiling_gbps

    ceiling = copy_ceiling_gbps(device)
    log(f"copy ceiling (read+write) {ceiling:.0f} GB/s")
    qo_lens = qo_lens_of(args)
    kernels = kernels_of(args)
    context = {"copy_ceiling_gbps": ceiling, "backend": backend_report(device),
               "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if args.flashinfer != "off":
        from .flashinfer_peer import flashinfer_status

        context["flashinfer"] = flashinfer_status()
        log(f"flashinfer: {context['flashinfer']}")
    if not kernels:  # `--kernels ""`: the end-to-end section alone
        return [], context
    try:
        rows = run_kernel_suite(configs_of(args, gpu=True), qo_lens, kernels, Geometry(),
                                kv_dtype=DTYPES[args.kv_dtype], index_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                                device=device, ceiling_gbps=ceiling, num_sets=args.sets,
                                dense_kv_dtype=DTYPES[args.dense_kv_dtype], check=not args.no_check,
                                time_reference=not args.no_reference_timing, flashinfer=args.flashinfer,
                                rounds=args.rounds, log=log)
    except BaseException as error:  # the rows finished before it, for `main` to print and write
        error.partial_section = ([{"section": "kernels", **r} for r in getattr(error, "kernel_rows", [])], context)
        raise
    return [{"section": "kernels", **r} for r in rows], context


def _cpu_smoke_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Reference-only timings on a tiny geometry: proves the suite's plumbing without a GPU."""
    from . import torch_reference as ref
    from .kernel_suite import byte_floor
    from .timing import time_cpu_us

    geo = Geometry(q_heads=4, kv_heads=1, head_dim=32, index_heads=1, index_dim=32, block=16, topk=4)
    rows, wanted = [], kernels_of(args)
    for batch, context in configs_of(args, gpu=False):
        steps = StepSet(batch, context, geo, kv_dtype=torch.float32, index_dtype=torch.float32,
                        q_dtype=torch.float32, device=torch.device("cpu"), num_sets=1)
        for qo_len in qo_lens_of(args):
            st = steps.step(0, qo_len)
            meta, cache = st["meta"], st["cache"]
            sel = ref.select_blocks(st["index_q"], cache.index_k, meta, topk=geo.topk)
            cases = {
                "index_select": lambda: ref.select_blocks(st["index_q"], cache.index_k, meta, topk=geo.topk),
                "sparse_attn": lambda: ref.sparse_attention(st["q"], cache.k, cache.v, meta, sel, scale=0.1),
                "dense_attn": lambda: ref.dense_attention(st["q"], cache.k, cache.v, meta, scale=0.1),
            }
            for name, fn in ((k, v) for k, v in cases.items() if k in wanted):
                nbytes, _ = byte_floor(name, meta, geo, q=st["q"], index_q=st["index_q"], kv_dtype=torch.float32,
                                       index_dtype=torch.float32, selection=sel)
                rows.append({"section": "reference_smoke", "kernel": name, "batch": batch, "context": context,
                             "qo_len": qo_len, "kv_dtype": "float32", "torch_us": time_cpu_us([fn]),
                             "bytes": nbytes})
    # the kernel rows' note; `--kernels ""` has none (the end-to-end rows are the whole run)
    return rows, {"note": "no CUDA/Triton: torch reference smoke only" if rows else "no CUDA/Triton"}


def qo_lens_of(args: argparse.Namespace) -> list[int]:
    try:
        values = [int(x) for x in args.qo_lens.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"--qo-lens: expected a comma list of positive integers, got {args.qo_lens!r}")
    if len(set(values)) < len(values):  # the kernel table keeps one row a shape (`kernel_table`)
        raise ValueError(f"--qo-lens {args.qo_lens}: a q_len given twice")
    return values


def kernels_of(args: argparse.Namespace) -> list[str]:
    """`--kernels` as names (blanks dropped: `""` means the end-to-end section alone); an unknown
    name is refused here, before the copy ceiling is measured, not as a traceback after it."""
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"--kernels: unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    repeated = sorted({k for k in names if names.count(k) > 1})
    if repeated:  # the suite measures a kernel once per listing; the kernel table keeps one row a shape
        raise ValueError(f"--kernels {args.kernels}: {', '.join(repeated)} given twice")
    return names


def measures_kernels(device: torch.device) -> bool:
    """Whether `device` runs the kernel suite (CUDA with Triton); else the CPU smoke table runs."""
    from m3_eagle_plugin.msa.kernels import triton_available

    return device.type == "cuda" and triton_available(device)


def configs_of(args: argparse.Namespace, gpu: bool) -> list[tuple[int, int]]:
    """`--configs`, or the kernel suite's (`gpu`) or the smoke table's default."""
    return args.configs or (parse_configs(DEFAULT_CONFIGS) if gpu else SMOKE_CONFIGS)


def _check_configs(args: argparse.Namespace, device: torch.device) -> None:
    """Every context must hold the longest q_len's tokens (they sit at its last positions)."""
    longest = max(qo_lens_of(args))
    short = [f"{b}x{c}" for b, c in configs_of(args, measures_kernels(device)) if c < longest]
    if short:
        raise ValueError(f"--configs {','.join(short)}: context shorter than --qo-lens {longest}")


def _check_something_runs(args: argparse.Namespace, device: torch.device) -> None:
    """Some row will be measured: without `--e2e`, `--kernels` must name a kernel the device times (the
    CPU smoke table times `SMOKE_KERNELS` only); else the run printed an empty table and exited 0."""
    wanted = kernels_of(args)
    if args.e2e:
        return
    if not wanted:
        raise ValueError('--kernels "": no kernel to measure (an empty list runs the end-to-end section alone: '
                         "add --e2e)")
    if not measures_kernels(device) and not set(wanted) & set(SMOKE_KERNELS):
        raise ValueError(f"--kernels {args.kernels}: the {device.type} smoke table (no CUDA/Triton kernels) times "
                         f"only {', '.join(SMOKE_KERNELS)}")


def _check_kernel_settings(args: argparse.Namespace, device: torch.device) -> None:
    """The kernels' environment settings, where this run reads them (else a traceback mid-run): the
    end-to-end engine goes through the dispatchers (`check_backend`, as `m3-eagle run` checks them:
    switches, backend, kernel table), the GPU suite reads the switches and the backend; the CPU smoke
    table reads none."""
    from m3_eagle_plugin.msa.kernels.backend import KernelBackendError, check_backend, check_switches, requested_backend

    if args.e2e:
        try:
            check_backend(device)
        except KernelBackendError as error:  # a RuntimeError: the backend asked for cannot run here
            raise ValueError(str(error)) from None
    elif measures_kernels(device):
        requested_backend()
        check_switches()


def _check_table_kernels(args: argparse.Namespace) -> None:
    """`--write-table` needs a kernel the table holds in `--kernels`: else the run measured, then wrote a
    table of no rows (`kv_lens_update` alone) and offered it as the override."""
    from m3_eagle_plugin.msa.kernels.kernel_table import TABLE_KERNELS

    held = [k for k in KERNELS if {"dense_peer": "dense_attn_peer"}.get(k, k) in TABLE_KERNELS]
    if not set(kernels_of(args)) & set(held):
        raise ValueError(f"--write-table: --kernels {args.kernels!r} measures no kernel the table holds "
                         f"({', '.join(held)})")


def _check_output_path(option: str, path: str | None) -> None:
    """`path` can be written: its folder is a writable directory that takes a new file (the output is
    written next to it and renamed over it) and the path itself is not a directory or a read-only file
    (else `open` raised a traceback after the whole run). A pipe or a device (`/dev/stdout`, a FIFO) is
    written in place, so only it must be writable."""
    if path is None or (path == "-" and option == "--json"):  # a bare --json: stdout (--write-table's "-" is a file)
        return
    if not path:  # `--json ""` wrote nothing anywhere
        stdout = ", or no value for stdout" if option == "--json" else ""
        raise ValueError(f'{option} "": an empty path (give a file name{stdout})')
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a directory, not a file")
    if _is_stream(target):  # written in place (`_write_json`): its folder takes no file
        if not os.access(target, os.W_OK):
            raise ValueError(f"{option} {path}: the file is not writable")
        return
    folder = target.resolve().parent
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise ValueError(f"{option} {path}: {folder} is not a writable directory")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{option} {path}: the file is not writable")
    try:  # os.access passes folders that refuse new files (/proc, read-only mounts, full quotas)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".probe")
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot create a file in {folder} ({error.strerror})") from None
    os.close(fd)
    os.unlink(probe)


def _write_json(option: str, path: str, document: Any, **dump_options: Any) -> bool:
    """`document` as JSON at `path`, whole or not at all: written to a scratch file beside it and renamed
    over it, so a failure (disk full, an interrupt) leaves no truncated file and an earlier one intact.
    A symbolic link is written through and an existing file keeps its mode, as `open` would: its
    target gets the JSON, the link stays, a private (0600) file stays private.
    A pipe or a device (`/dev/stdout`, a FIFO) is written in place, as `open` would (renamed over, it
    was replaced by a plain file and its reader got nothing).
    False, with one line on stderr naming the option, when it could not be written."""
    target, scratch = Path(path).resolve(), None
    try:
        if _is_stream(Path(path)):
            with open(path, "w") as fh:
                json.dump(document, fh, **dump_options)
                fh.write("\n")
            return True
        fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(document, fh, **dump_options)
            fh.write("\n")
        os.chmod(scratch, _file_mode(target))  # mkstemp's 0600 otherwise
        os.replace(scratch, target)
        scratch = None
    except OSError as error:
        print(f"m3-eagle bench: {option} {path}: not written ({error.strerror or error})", file=sys.stderr)
        return False
    finally:
        if scratch is not None and os.path.exists(scratch):
            os.unlink(scratch)
    return True


def _is_stream(path: Path) -> bool:
    """Whether `path` names (through any link) something that exists and is neither a plain file nor a
    directory: a pipe, a FIFO, a character device."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _file_mode(target: Path) -> int:
    """The mode `open(target, "w")` leaves: an existing file's own, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def checked_device(args: argparse.Namespace) -> torch.device:
    """The device to measure on, every option checked first (a ValueError naming it), so a bad one
    fails before anything is measured rather than after."""
    want = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(want)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cuda, cuda:N or cpu, got {want!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {want}: no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()  # else torch.cuda.set_device raised "invalid device ordinal"
        raise ValueError(f"--device {want}: no such CUDA device ({count} visible: "
                         f"{'cuda:0' if count == 1 else f'cuda:0..cuda:{count - 1}'})")
    qo_lens_of(args)
    _check_something_runs(args, device)
    _check_kernel_settings(args, device)
    _check_configs(args, device)
    for option in ("json", "write_table"):
        _check_output_path(f"--{option.replace('_', '-')}", getattr(args, option, None))
    json_path, table_path = getattr(args, "json", None), getattr(args, "write_table", None)
    if table_path is not None:
        _check_table_kernels(args)
    if json_path not in (None, "-") and table_path and os.path.realpath(json_path) == os.path.realpath(table_path):
        raise ValueError(f"--json and --write-table both name {table_path}: the table would overwrite the rows")
    if table_path is not None and not measures_kernels(device):  # else the smoke table ran, then nothing was written
        raise ValueError(f"--write-table: needs the GPU kernel rows (CUDA and Triton); on {device} the "
                         "bench runs the torch reference smoke table only")
    if args.e2e:
        e2e.shape_from_args(args, device)  # refuses a bad --e2e-* value naming the option
    elif stray := e2e.options_given(args):
        raise ValueError(f"{', '.join(stray)}: {'needs' if len(stray) == 1 else 'need'} --e2e "
                         "(without it the end-to-end section does not run)")
    return device


def main(args: argparse.Namespace) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - progress goes to stderr
    try:
        device = checked_device(args)
    except ValueError as error:
        print(f"m3-eagle bench: {error}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:  # events, graph captures and the e2e engine
        torch.cuda.set_device(device)                          # use the current device
    kernel_error = e2e_error = None
    try:
        rows, context = _kernel_section(args, device, log)
    except (MemoryError, RuntimeError) as error:  # reported after the rows finished before it
        kernel_error = error
        rows, context = getattr(error, "partial_section", ([], {}))
    if args.e2e and kernel_error is None:
        try:
            rows += run_end_to_end(args)
        except (e2e.NoDecodeWindowError, MemoryError, RuntimeError) as error:  # reported after the kernel rows
            e2e_error = error
            rows += getattr(error, "partial_rows", [])  # the batches measured before it
    if rows or (kernel_error is None and e2e_error is None):
        written = _output(args, rows, context, table=kernel_error is None)  # a partial table: not written
    if kernel_error is not None:
        configs = ",".join(f"{b}x{c}" for b, c in configs_of(args, measures_kernels(device)))
        return _out_of_memory(kernel_error, f"--configs {configs}", "lower a batch or context")
    if e2e_error is not None:  # the kernel rows measured before it are printed and written all the same
        return _e2e_failed(e2e_error)
    return 0 if written else 1


def _output(args: argparse.Namespace, rows: list[dict[str, Any]], context: dict[str, Any], *, table: bool) -> bool:
    """Print the rows (and the JSON: stdout or `--json PATH`; with `table`, `--write-table`); False
    when a file could not be written."""
    document = json_safe({"context": context, "rows": rows}, str) if args.json else None
    written = True
    if args.json and args.json != "-":
        written = _write_json("--json", args.json, document, indent=1, default=str)
    if args.write_table and table:
        written = _write_table(args, rows, context) and written
    if args.json == "-":  # stdout holds the one JSON object; the table is for the reader
        print(format_table(rows), file=sys.stderr)
        print(json.dumps(document, default=str))
    else:
        print(format_table(rows))
    return written


def _e2e_failed(error: BaseException) -> int:
    """Exit status 2 and one line for an end-to-end section too short to time or past memory; any
    other error is re-raised."""
    if isinstance(error, e2e.NoDecodeWindowError):  # an option error the run itself found: no traceback
        print(f"m3-eagle bench: --e2e: {error}", file=sys.stderr)
        return 2
    return _out_of_memory(error, "the --e2e section", "lower --e2e-hidden, --e2e-context or --e2e-batches")


def _kernel_section(args: argparse.Namespace, device: torch.device,
                    log) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The kernel suite's rows on CUDA with Triton, else the reference smoke table's."""
    if measures_kernels(device):
        return _gpu_rows(args, device, log)
    if device.type == "cuda":
        log(f"no Triton kernels on {device}: the torch reference smoke table only")
    skipped = [k for k in kernels_of(args) if k not in SMOKE_KERNELS]
    if skipped:
        log(f"the smoke table does not time {', '.join(skipped)} (CUDA with Triton only)")
    return _cpu_smoke_rows(args)


def _out_of_memory(error: BaseException, what: str, advice: str) -> int:
    """Exit status 2 and one line naming the options when `error` is an allocation failure (torch's CPU
    allocator raises a plain RuntimeError, CUDA's an OutOfMemoryError); any other error is re-raised."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(error, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in text:
        raise error
    print(f"m3-eagle bench: not enough memory for {what} ({text}); {advice}", file=sys.stderr)
    return 2


def _write_table(args: argparse.Namespace, rows: list[dict[str, Any]], context: dict[str, Any]) -> bool:
    """`--write-table PATH`: the kernel rows as a kernel table (msa/kernels/kernel_table.py)."""
    import datetime

    from m3_eagle_plugin.msa.kernels.kernel_table import table_from_bench_rows

    kernel_rows = [r for r in rows if r.get("section") == "kernels"]
    if not kernel_rows or "device_name" not in context:
        print("--write-table: no GPU kernel rows were measured (needs CUDA and Triton); nothing written",
              file=sys.stderr)
        return False
    configs = ",".join(f"{b}x{c}" for b, c in configs_of(args, gpu=True))
    qo_lens, kernels = ",".join(map(str, qo_lens_of(args))), ",".join(kernels_of(args))  # as parsed: no blanks
    command = (f"m3-eagle bench --configs {configs} --qo-lens {qo_lens} --kernels {kernels} "
               f"--kv-dtype {args.kv_dtype} --dense-kv-dtype {args.dense_kv_dtype} --flashinfer {args.flashinfer}"
               + (f" --rounds {args.rounds}" if args.rounds > 1 else "")
               + (f" --sets {args.sets}" if args.sets != 3 else ""))  # fewer sets: caches flatter small shapes
    table = table_from_bench_rows(kernel_rows, device=context["device_name"], command=command,
                                  date=datetime.date.today().isoformat(), flashinfer=context.get("flashinfer"))
    if not _write_json("--write-table", args.write_table, table, indent=1):
        return False
    print(f"kernel table ({len(table['rows'])} rows) written to {args.write_table}; use it with "
          f"M3_EAGLE_KERNEL_TABLE={args.write_table}", file=sys.stderr)
    return True
