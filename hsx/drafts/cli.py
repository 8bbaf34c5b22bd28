"""``hsx eval-draft``: a draft's acceptance on a prompt file, in vLLM's
speculative decoding (:mod:`hsx.drafts.acceptance`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import orjson

from hsx.drafts.acceptance import EvalSettings, evaluate, prepare_prompts
from hsx.extractor.cli import DTYPES, engine_arg, model_and_layers
from hsx.producer.cli import add_input_arguments, input_from_args
from hsx.producer.publisher import InvalidPolicy
from hsx.runtime.checks import integer, writable_file
from hsx.runtime.draft_checkpoint import check_verifier, read_draft
from hsx.runtime.errors import ExitCode, UsageError

log = logging.getLogger(__name__)
_DEFAULTS = EvalSettings(model="", draft="")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--model", required=True, help="the verifier: a local model directory")
    parser.add_argument("--draft", required=True,
                        help="a draft checkpoint directory (`speculators train` or `hsx train-draft`): EAGLE-3, "
                             "DFlash or P-EAGLE, served with the method vLLM reads from its config.json")
    parser.add_argument("--num-speculative-tokens", type=integer(1, 16), metavar="K",
                        help="tokens the draft proposes per step (default: what its checkpoint says, e.g. 3 for "
                             "EAGLE-3, 15 for DFlash's 16-token blocks)")
    parser.add_argument("--max-tokens", type=integer(1), default=_DEFAULTS.max_tokens, metavar="N",
                        help="greedy answer length per prompt (default %(default)s; rows' own generation is ignored)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the report here as JSON")
    engine = parser.add_argument_group("vLLM")
    engine.add_argument("--dtype", default=_DEFAULTS.dtype, choices=DTYPES, help="model dtype (default %(default)s)")
    engine.add_argument("--max-model-len", type=integer(2),
                        help="longest prompt + answer (default 4096, or the model's context where shorter)")
    engine.add_argument("--max-num-seqs", type=integer(1), help="vLLM batch size limit")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation")
    engine.add_argument("--engine-arg", type=engine_arg, action="append", default=[], metavar="KEY=VALUE",
                        help="any other vLLM engine argument (VALUE parsed as JSON when it can be)")
    parser.set_defaults(layers=None)  # model_and_layers reads it; the draft's checkpoint names its layers


def run(args: argparse.Namespace) -> int:
    # Everything that can be known before an engine starts is checked first, in one line each.
    if args.generate is not None or args.turns is not None:
        raise UsageError("--generate/--turns do not apply: eval-draft decodes every prompt greedily "
                         "(--max-tokens sets the length)")
    if args.on_invalid is InvalidPolicy.DLQ:
        raise UsageError("--on-invalid dlq needs Kafka: eval-draft takes skip or fail")
    verifier, _ = model_and_layers(args)
    check_verifier("--draft", read_draft("--draft", args.draft), verifier)
    if args.json is not None:
        writable_file("--json", args.json)
    prompt_input = input_from_args(args)
    try:
        prompts, invalid = prepare_prompts(prompt_input.lines, prompt_input.mapping, args.model, args.max_model_len,
                                           args.max_tokens)
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from exc
    for reason in invalid:
        log.warning("skipped: %s", reason)
    if invalid and args.on_invalid is InvalidPolicy.FAIL:
        log.error("%d invalid rows (--on-invalid fail), the first: %s", len(invalid), invalid[0])
        return ExitCode.FAILED
    if not prompts:
        raise UsageError(f"{args.file}: no valid prompt to evaluate ({len(invalid)} invalid rows)")
    settings = EvalSettings(model=args.model, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                            max_tokens=args.max_tokens, dtype=args.dtype, max_model_len=args.max_model_len,
                            max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                            engine_args=dict(args.engine_arg))
    report = evaluate(settings, prompts, invalid_rows=len(invalid))
    print(report.describe())
    if not report.outputs_identical:
        log.warning("greedy outputs changed with the draft on %d prompts: speculative decoding must not change "
                    "them (a vLLM or backend defect)", len(report.differing_prompts))
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2))
        print(f"report: {args.json}", file=sys.stderr)
    return 0
