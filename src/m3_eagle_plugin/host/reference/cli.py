"""`m3-eagle run`: generation with one-model Eagle3 on the reference host.

Prompts are token ids (`--prompt-ids 1,2,3`, repeatable, or `--prompts FILE` with one JSON list of
ids per line; neither: the one prompt `DEFAULT_PROMPT`, said on stderr). A bad prompt fails alone
with its message in the output; the others complete.
`--json` prints one JSON object on stdout; a progress bar goes to stderr when it is a terminal.
Exit status: 0 when at least one request completed (per-request errors are in the output), 1 when
none did, 2 for bad arguments or setup errors.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from m3_eagle_plugin.cli import path_option

__all__ = ["add_arguments", "main", "read_prompts"]

#: The prompt `m3-eagle run` generates from when given neither --prompt-ids nor --prompts.
DEFAULT_PROMPT = (1, 2, 3, 4)

#: The engine's fields that `m3-eagle run` options set, as its own checks name them: those of how the
#: settings fit together (a verify row in the step budget, a forced count against the draft length,
#: eos ids against the vocabulary) run in the engine, where no option is known.
OPTION_OF_FIELD = {"draft_len": "--draft-len", "max_batch_size": "--max-batch-size",
                   "max_tokens_per_step": "--max-tokens-per-step", "force_accepted": "--force-accepted",
                   "eos_ids": "--eos-ids", "temperature": "--temperature"}
_FIELD = re.compile(r"\b(" + "|".join(OPTION_OF_FIELD) + r")\b")

FORCED_NOTE = ("forced acceptance: up to {n} drafts per verify step (those proposed) are accepted regardless "
               "(benchmark mode; outputs are NOT the target's)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=path_option,
                        help="MiniMax-M3 target checkpoint directory (HF layout)")
    parser.add_argument("--draft", default=None, type=path_option,
                        help="Eagle3 head checkpoint directory (omit: target only)")
    parser.add_argument("--draft-embeddings", choices=["target", "own"], default="target",
                        help="target (default): the head uses the target's embedding, and its lm_head at the full "
                             "vocabulary in target order, even where it ships its own (as MiniMax-M3's head is "
                             "served); own: the ones the --draft checkpoint ships")
    parser.add_argument("--draft-len", type=int, default=3,
                        help="draft tokens per verify step (default 3; 0 = target only, without --draft)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt-ids", action="append", help="comma-separated token ids of one prompt (repeatable; "
                        f"with neither this nor --prompts: {','.join(map(str, DEFAULT_PROMPT))})")
    source.add_argument("--prompts", type=lambda text: Path(path_option(text)),
                        help="JSON-lines file: one list of token ids per line")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt, at most (default 32)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights and KV cache (default float32)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay generation steps from CUDA graphs (GPU only)")
    parser.add_argument("--overlap", action="store_true",
                        help="prepare step N+1 before step N's acceptance is known (device-side correction); "
                             "not with --proposer prompt-lookup or a drafter plugin, whose drafts need step N's "
                             "tokens (the report's overlap= says whether it ran)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1 = off)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**63) (default 0)")
    parser.add_argument("--force-accepted", type=_forced_count, default=None, metavar="N",
                        help="benchmark mode, greedy only: accept N drafts per step regardless of the target "
                             "(fractional N: that mean, e.g. 2.5 alternates 2 and 3)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="requests in one step (default 8)")
    parser.add_argument("--max-tokens-per-step", type=int, default=256,
                        help="token budget of one step (chunked prefill; default 256)")
    parser.add_argument("--eos-ids", default=None,
                        help="comma-separated ids that end a request (kept in the output); default: the "
                             "checkpoint's eos_token_id as transformers' generate reads it (generation_config.json, "
                             "else config.json); \"\" for none")
    parser.add_argument("--kv-blocks", type=int, default=None,
                        help="KV cache blocks (default: all prompts fit at once)")
    parser.add_argument("--proposer", choices=["default", "prompt-lookup"], default="default",
                        help="default: the m3_eagle_propose_drafts plugin hook, else the Eagle3 head; "
                             "prompt-lookup: n-grams of the prompt (without --draft)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _forced_count(text: str) -> int | float:
    """'2' -> 2 (integer behaviour unchanged), '2.5' -> 2.5 (a mean per verify step)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return int(value) if value.is_integer() else value


def _parse_ids(text: str, where: str) -> list[int]:
    """'1, 2,3' -> [1, 2, 3]; spaces around an id are fine, inside one ('1 2') are an error, and so
    are what Python's int() alone would take ('1_0' as 10, non-ASCII digits), as a --prompts file's
    JSON refuses them."""
    ids = []
    for item in (t.strip() for t in text.split(",")):
        if item == "":
            continue
        if not re.fullmatch(r"[+-]?[0-9]+", item):
            raise ValueError(f"{where}: token ids must be comma-separated integers, got {item!r} "
                             f"in {text!r}")
        ids.append(int(item))
    return ids


def read_prompts(args: argparse.Namespace) -> tuple[list[Any], list[str | None]]:
    """Prompts and, per prompt, a parse error (such a prompt is passed on as-is and fails alone). A
    `--prompts` file that cannot be read or holds no prompt is a ValueError naming it."""
    prompts, errors, _ = _read_prompts(args)
    return prompts, errors


def _read_prompts(args: argparse.Namespace) -> tuple[list[Any], list[str | None], list[str | None]]:
    """`read_prompts`, and per prompt where it came from: "FILE:N" for a `--prompts` file's line, else None."""
    prompts: list[Any] = []
    errors: list[str | None] = []
    if args.prompt_ids:
        for n, text in enumerate(args.prompt_ids):
            try:
                prompts.append(_parse_ids(text, f"--prompt-ids #{n}"))
                errors.append(None)
            except ValueError as error:
                prompts.append(None)
                errors.append(str(error))
        return prompts, errors, [None] * len(prompts)
    if args.prompts is None:
        print(f"m3-eagle run: no --prompt-ids or --prompts: generating from the prompt "
              f"{','.join(map(str, DEFAULT_PROMPT))}", file=sys.stderr)
        return [list(DEFAULT_PROMPT)], [None], [None]
    lines: list[str | None] = []
    # FILE:N counts blank lines; split at "\n" only (read_text already made "\r\n" and "\r" one), as editors and
    # grep -n count: splitlines also splits at U+2028, \x85 or \x0c inside a line, shifting every later N
    for n, line in enumerate(_read_prompts_file(args.prompts).split("\n"), start=1):
        if not line.strip():
            continue
        lines.append(f"{args.prompts}:{n}")
        try:
            value = json.loads(line)
            if not isinstance(value, list):
                errors.append(f"{args.prompts}:{n}: expected a JSON list of token ids")
            elif value and all(isinstance(item, list) for item in value):  # a whole batch on one line
                errors.append(f"{args.prompts}:{n}: a list of lists; the file takes one prompt (a JSON list of "
                              "token ids) per line")
            else:
                errors.append(None)
            prompts.append(value)
        except json.JSONDecodeError as error:
            prompts.append(None)
            errors.append(f"{args.prompts}:{n}: not JSON ({error.msg})")
        except RecursionError:  # a list nested past Python's stack
            prompts.append(None)
            errors.append(f"{args.prompts}:{n}: not JSON (nested too deeply)")
        except ValueError as error:  # an integer literal longer than Python converts (sys.get_int_max_str_digits)
            prompts.append(None)
            errors.append(f"{args.prompts}:{n}: not read as JSON ({str(error).split(';')[0]})")
    if not prompts:  # else the model loaded, nothing ran and the run exited 1 without a word
        raise ValueError(f"--prompts {args.prompts}: no prompts (expected one JSON list of token ids per line)")
    return prompts, errors, lines


def _read_prompts_file(path: Path) -> str:
    """The text of `--prompts FILE`; a ValueError naming the option and the file when it cannot be read."""
    try:
        # A byte-order mark (Notepad's UTF-8) is not part of the first prompt; "utf-8-sig" would
        # count a bad byte's offset from after it.
        return path.read_text(encoding="utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompts {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except OSError as error:
        raise ValueError(f"--prompts {path}: cannot read it ({error.strerror or error})") from None


class ProgressBar:
    """A one-line bar on a terminal; silent elsewhere (no extra dependencies)."""

    def __init__(self, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream, self.width = (sys.stderr if stream is None else stream), width
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total == 0:
            return
        filled = self.width * done // total
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} requests")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _report_text(report: dict, out: TextIO) -> None:
    if report.get("forced_acceptance") is not None:
        out.write(FORCED_NOTE.format(n=report["forced_acceptance"]) + "\n")
    for n, (ids, error) in enumerate(zip(report["outputs"], report["errors"])):
        out.write(f"[{n}] error: {error}\n" if error else f"[{n}] {' '.join(map(str, ids))}\n")
    out.write(
        f"draft_len={report['draft_len']} source={report['draft_source']} overlap={report['overlap']} "
        f"acceptance_rate={_measured(report['acceptance_rate'])} "
        f"mean_acceptance_length={_measured(report['mean_acceptance_length'])} "
        f"draft_tokens={report['draft_tokens']} accepted_tokens={report['accepted_tokens']} "
        f"tokens_per_s={report['tokens_per_s']:.1f}\n"
    )
    per_position = report.get("per_position_acceptance") or []
    if per_position:
        out.write("per_position_acceptance=" + ",".join(map(_measured, per_position)) + "\n")


def _measured(value: float | None) -> str:
    """A rate of the report, or "-" where nothing was there to measure (None)."""
    return "-" if value is None else f"{value:.3f}"


def _config_kind(path: Path) -> str | None:
    """"target" (a MiniMax-M3 config), "draft" (an Eagle3 head's) or None (unknown or unreadable: the
    loader then names what is wrong) for the checkpoint directory `path`."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architectures = " ".join(map(str, config.get("architectures") or []))
    if "text_config" in config or "MiniMaxM3" in architectures or str(config.get("model_type", "")).startswith(
            "minimax_m3"):
        return "target"
    if "eagle" in architectures.lower() or "eagle_config" in config:
        return "draft"
    return None


def _check_checkpoint_kind(option: str, path: Path) -> None:
    """--model must not be an Eagle3 head, nor --draft a MiniMax-M3 target (else a missing-field error
    such as "moe_layer_freq: required field is missing" was all the user saw)."""
    kind = _config_kind(path)
    if option == "--model" and kind == "draft":
        raise ValueError(f"--model {path}: config.json describes an Eagle3 draft head, not a MiniMax-M3 target "
                         "(pass it as --draft, the target as --model)")
    if option == "--draft" and kind == "target":
        raise ValueError(f"--draft {path}: config.json describes a MiniMax-M3 target, not an Eagle3 draft head "
                         "(the target goes to --model)")


def _name_options(error: Exception) -> str:
    """A setup error as the command line says it: an engine settings error (it starts with a field's
    name) with each field named by its option; any other error (a file's, which starts with a path)
    as it is."""
    message = str(error)
    if not _FIELD.match(message):
        return message
    return _FIELD.sub(lambda match: OPTION_OF_FIELD[match.group(1)], message)


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts and sampling values in range, each error naming its option (the engine's own checks name
    its fields: "max_batch_size must be >= 1")."""
    minimums = (("--draft-len", args.draft_len, 0), ("--max-new-tokens", args.max_new_tokens, 1),
                ("--max-batch-size", args.max_batch_size, 1), ("--max-tokens-per-step", args.max_tokens_per_step, 1),
                ("--kv-blocks", args.kv_blocks, 1), ("--top-k", args.top_k, 0),
                ("--force-accepted", args.force_accepted, 0))
    for option, value, least in minimums:
        if value is not None and value < least:
            raise ValueError(f"{option} must be >= {least}, got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")


def main(args: argparse.Namespace) -> int:
    """With --json, stdout holds the one JSON object: what else is printed there meanwhile (a third-party
    plugin's import of TensorRT-LLM prints its version line) goes to stderr."""
    out = sys.stdout
    if not args.json or out is None:
        return _main(args, out)
    with contextlib.redirect_stdout(sys.stderr):
        return _main(args, out)


def _main(args: argparse.Namespace, out) -> int:
    import torch

    from m3_eagle_plugin.host.reference.build import DTYPES, blocks_for_prompts, build_engine
    from m3_eagle_plugin.host.reference.engine import EngineConfig
    from m3_eagle_plugin.host.reference.sampler import SamplingParams
    from m3_eagle_plugin.msa.kernels import KernelBackendError, check_backend

    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        for option, path in (("--model", args.model), ("--draft", args.draft)):
            if path is not None and not Path(path).is_dir():
                raise ValueError(f"{option} {path}: not a checkpoint directory (config.json + safetensors)")
            if path is not None:
                _check_checkpoint_kind(option, Path(path))
        if args.proposer == "prompt-lookup" and args.draft is not None:  # the head was loaded, never run
            raise ValueError(f"--proposer prompt-lookup drafts from the prompt, so --draft {args.draft} would "
                             "never run: pass one of them")
        if args.draft_len == 0 and args.draft is not None:  # the same: loaded, its draft KV allocated, never run
            raise ValueError(f"--draft-len 0 drafts nothing, so --draft {args.draft} would never run: leave out "
                             "--draft (target only) or pass a --draft-len >= 1")
        check_backend(torch.device(args.device))  # M3_EAGLE_KERNELS, before any weight is read
        if args.cuda_graphs and args.device != "cuda":
            raise ValueError("--cuda-graphs needs --device cuda (CUDA graphs do not exist on CPU)")
        _check_numbers(args)
        prompts, parse_errors, sources = _read_prompts(args)
        from m3_eagle_plugin.models.config import M3Config, eos_token_ids

        target_config = M3Config.from_file(args.model)
        if args.eos_ids is None:
            eos_ids, vocab = eos_token_ids(args.model), target_config.vocab_size
            if any(token >= vocab for token in eos_ids):  # else named as --eos-ids, which nobody typed
                raise ValueError(f"--model {args.model}: its eos_token_id {list(eos_ids)} is outside the vocabulary "
                                 f"[0, {vocab}): pass --eos-ids (\"\" for none)")
        else:
            eos_ids = tuple(_parse_ids(args.eos_ids, "--eos-ids"))
        if any(token < 0 for token in eos_ids):
            raise ValueError(f"--eos-ids must be >= 0, got {min(eos_ids)}")
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        config = EngineConfig(
            draft_len=args.draft_len, max_batch_size=args.max_batch_size,
            max_tokens_per_step=args.max_tokens_per_step, overlap=args.overlap, cuda_graphs=args.cuda_graphs,
            sampling=sampling, force_accepted=args.force_accepted, eos_ids=eos_ids,
        )
        proposer = None
        if args.proposer == "prompt-lookup":
            from m3_eagle_plugin.host.reference.proposers import PromptLookupProposer

            proposer = PromptLookupProposer()
        from m3_eagle_plugin.host.reference.engine import effective_draft_len, hook_drafts
        from m3_eagle_plugin.registry import get_plugin_manager

        plugin_manager = get_plugin_manager()
        num_blocks = args.kv_blocks
        if num_blocks is None:  # at the draft length the engine runs (0 where nothing drafts) and the new
            # tokens it runs to: at most to the target's max_position_embeddings, whatever --max-new-tokens says
            valid = [p for p, e in zip(prompts, parse_errors) if e is None]
            draft_len = effective_draft_len(config, has_head=args.draft is not None,
                                            hook_drafts=hook_drafts(proposer, plugin_manager))
            num_blocks = blocks_for_prompts(valid, args.max_new_tokens, draft_len, target_config.block_size,
                                            max_positions=target_config.max_position_embeddings)
        engine = build_engine(
            args.model, args.draft, config, num_blocks=num_blocks, device=args.device,
            dtype=DTYPES[args.dtype], plugin_manager=plugin_manager, proposer=proposer,
            draft_embeddings=args.draft_embeddings,
        )
    except (ValueError, TypeError, OSError, KernelBackendError) as error:
        print(f"m3-eagle run: {_name_options(error)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:  # the step buffers or cache the options ask for
        if not isinstance(error, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(error):
            raise
        what = str(error).splitlines()[0] if str(error) else "allocation failed"
        print(f"m3-eagle run: not enough memory for these settings ({what}); lower --max-batch-size, "
              "--max-tokens-per-step or --kv-blocks", file=sys.stderr)
        return 2

    bar = ProgressBar()
    try:
        result = engine.generate([p if e is None else None for p, e in zip(prompts, parse_errors)],
                                 args.max_new_tokens, progress=bar)
    except BaseException as error:  # a failed step or Ctrl-C: what had finished is still printed
        bar.close()
        partial = getattr(error, "partial_result", None)
        if partial is not None and any(partial.outputs):
            _write_report(partial, parse_errors, sources, num_blocks, engine, args, out)
            print("m3-eagle run: stopped before every request finished; the outputs above are the requests that "
                  "had finished", file=sys.stderr)
        raise
    bar.close()
    _write_report(result, parse_errors, sources, num_blocks, engine, args, out)
    return 0 if any(e is None for e in result.errors) else 1


def _write_report(result, parse_errors: list, sources: list, num_blocks: int, engine, args, out) -> None:
    for n, (error, source) in enumerate(zip(parse_errors, sources)):
        if error is not None:
            result.errors[n] = error
        elif result.errors[n] is not None and source is not None:  # the engine's "request N", as the file's line
            result.errors[n] = re.sub(rf"^request {n}(:?)(?= )", lambda match: f"{source}:" if match.group(1)
                                      else f"the prompt at {source}", result.errors[n])
    report = result.as_dict()
    report["kv_blocks"] = int(num_blocks)
    report["kv_blocks_free_after"] = int(engine.cache.num_free_blocks)
    if out is None:  # started with stdout closed (`>&-`): nothing to write to, as for print()
        return
    if args.json:
        json.dump(report, out)
        out.write("\n")
    else:
        _report_text(report, out)
    out.flush()
