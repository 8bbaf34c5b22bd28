"""The benchmarks page's section on drafts trained on hsx data
(:mod:`bench.acceptance`): every arm's acceptance in vLLM on held-out prompts,
each type's learning curve, and each stage's wall time."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from bench.report_blocks import Block, Bullets, Cells, Results, Table, When, fmt

ARMS = (
    ("offline", "(a) offline: `hsx export` + speculators' `train`"),
    ("online", "(b) online: `hsx train-draft` while `hsx run` extracts, one pass"),
    ("reference", "(c) reference: HF transformers' hidden states, same rows"),
    ("shifted", "(d) control: hsx's hidden states one position late"),
    ("untrained", "(e) untrained: speculators' `--dry-run` draft"),
    ("offline_float32", "(a) again, verifier and draft in float32"),
    ("dflash", "(f) DFlash: (a)'s export, `--speculator-type dflash`"),
    ("dflash_reference", "(f) DFlash on (c)'s HF hidden states"),
    ("dflash_shifted", "(f) DFlash on (d)'s shifted control"),
    ("dflash_seed1", "(f) DFlash on (a)'s export again, seed 1 (training noise)"),
    ("dflash_float32", "(f) again, verifier and draft in float32"),
    ("peagle", "(g) P-EAGLE: (a)'s export, `--speculator-type peagle`"),
    ("peagle_reference", "(g) P-EAGLE on (c)'s HF hidden states"),
    ("peagle_shifted", "(g) P-EAGLE on (d)'s shifted control"),
    ("peagle_seed1", "(g) P-EAGLE on (a)'s export again, seed 1 (training noise)"),
    ("peagle_float32", "(g) again, verifier and draft in float32"),
)
DRAFT_TYPES = (("offline", "EAGLE-3"), ("dflash", "DFlash"), ("peagle", "P-EAGLE"))
"""Each draft type's arm on hsx's export (EAGLE-3's is (a)), and its name."""


@dataclass(frozen=True)
class Pair:
    """Two arms' acceptance lengths side by side, with the noise of their
    difference: two standard errors of it from the evaluation's drafts
    (:func:`_noise`) and, where measured, how far two trainings of the same
    type on the same data land apart (seeds 0 and 1)."""

    first: float
    second: float
    sampling: float
    seeds: float | None = None

    @property
    def difference(self) -> float:
        return self.first - self.second

    @property
    def noise(self) -> float:
        return max(self.sampling, self.seeds or 0.0)

    def __str__(self) -> str:
        seeds = "" if self.seeds is None else f", seeds {self.seeds:.3f} apart"
        return (f"{self.first:.3f} ÷ {self.second:.3f} = {self.first / self.second:.3f} "
                f"({self.difference:+.3f}; noise ±{self.sampling:.3f}{seeds})")


TARGETS = (
    ("mean acceptance length, (a)", "≥ 2.0", lambda r: _get(r, "offline", "acceptance_length"),
     lambda v: v >= 2.0),
    ("per position, (a)", "above [0.30, 0.07, 0.01]", lambda r: _get(r, "offline", "per_position"),
     lambda v: all(x > bar for x, bar in zip(v, (0.30, 0.07, 0.01)))),
    ("(b) online − (a) after one epoch (the same samples)", "within 0.1", lambda r: _gap(r, "online", "offline_epoch1"),
     lambda v: abs(v) <= 0.1),
    ("(a) − (c) reference, after as many epochs", "within 0.05", lambda r: _gap(r, _peer(r, "reference"), "reference"),
     lambda v: abs(v) <= 0.05),
    ("(a) − (d) shifted control, after as many epochs", "at least 0.5",
     lambda r: _gap(r, _peer(r, "shifted"), "shifted"), lambda v: v >= 0.5),
    *(row for arm, name in DRAFT_TYPES[1:] for row in (
        (f"{name} on hsx ÷ on HF's hidden states, after as many epochs", "within noise",
         lambda r, arm=arm: _beside_reference(r, arm), lambda v: abs(v.difference) <= v.noise),
        (f"{name} shifted control ÷ on hsx, after as many epochs", "≤ 1.1, below beyond noise",
         lambda r, arm=arm: _pair(r, f"{arm}_shifted", _peer(r, f"{arm}_shifted", arm)),
         lambda v: v.first <= 1.1 and -v.difference > v.noise))),
    ("greedy outputs with each type's draft = without it, in float32", "identical, every type",
     lambda r: _identical_in_float32(r), lambda v: len(v) == len(DRAFT_TYPES) and all(v.values())),
    ("best acceptance length, any type, on hsx data", "≥ 2.5",
     lambda r: max((x for arm, _ in DRAFT_TYPES if (x := _get(r, arm, "acceptance_length")) is not None), default=None),
     lambda v: v >= 2.5),
)


def _get(r: Results, arm: str, figure: str) -> Any:
    return r.get(f"acceptance_{arm}_{figure}")


def _peer(r: Results, arm: str, base: str = "offline") -> str:
    """``base``'s checkpoint after as many epochs as ``arm`` trained (``--epochs``)."""
    epochs = _get(r, arm, "epochs")
    return base if epochs in (None, _get(r, base, "epochs")) else f"{base}_epoch{epochs}"


def _noise(r: Results, arm: str) -> float | None:
    """The standard error of an arm's acceptance length, its drafts taken as
    independent: a draft's accepted count X is at least k with the rate vLLM
    counts at position k (p_k), so E[X] = sum p_k and E[X^2] = sum (2k - 1) p_k."""
    rates, drafts = _get(r, arm, "per_position"), _get(r, arm, "drafts")
    if not rates or not drafts:
        return None
    mean = sum(rates)
    variance = sum((2 * k - 1) * p for k, p in enumerate(rates, start=1)) - mean ** 2
    return math.sqrt(max(variance, 0.0) / drafts)


def _pair(r: Results, a: str, b: str) -> Pair | None:
    """``a`` beside ``b``; the noise is two standard errors of the difference."""
    x, y = _get(r, a, "acceptance_length"), _get(r, b, "acceptance_length")
    noise_a, noise_b = _noise(r, a), _noise(r, b)
    if x is None or not y or noise_a is None or noise_b is None:
        return None
    return Pair(x, y, 2 * math.hypot(noise_a, noise_b))


class Identical(dict[str, bool]):
    """Each type's float32 arm measured so far: whether its greedy outputs were all identical."""

    def __str__(self) -> str:
        return ", ".join(f"{name} {'yes' if same else 'no'}" for name, same in self.items())


def _identical_in_float32(r: Results) -> Identical | None:
    measured = Identical({name: same for arm, name in DRAFT_TYPES
                          if (same := _get(r, f"{arm}_float32", "outputs_identical")) is not None})
    return measured or None


def _beside_reference(r: Results, arm: str) -> Pair | None:
    """Type ``arm`` on hsx's data beside the same on HF's hidden states, after as
    many epochs, the noise including its two seeds' gap where ``ARM_seed1`` ran
    as many epochs."""
    reference = f"{arm}_reference"
    peer = _peer(r, reference, arm)
    pair = _pair(r, peer, reference)
    seeds = _gap(r, peer, f"{arm}_seed1") if _get(r, f"{arm}_seed1", "epochs") == _get(r, reference, "epochs") else None
    return pair if pair is None or seeds is None else replace(pair, seeds=abs(seeds))


def _gap(r: Results, a: str, b: str) -> float | None:
    x, y = _get(r, a, "acceptance_length"), _get(r, b, "acceptance_length")
    return None if x is None or y is None else round(x - y, 3)


def _cell(value: Any) -> str:
    """A figure, or a list of them (per position) with its run of trailing
    zeros (DFlash's later positions) counted instead of written out."""
    if not isinstance(value, list):
        return fmt(value)
    cells = [f"{x:.3f}" for x in value]
    shown = len(cells)
    while shown and cells[shown - 1] == "0.000":
        shown -= 1
    zeros = len(cells) - shown
    if zeros < 4:  # an EAGLE-3 row of three stays written out
        return " / ".join(cells)
    return " / ".join([*cells[:shown], f"0.000 (×{zeros})"])


def _arm_rows(r: Results) -> Iterator[Cells]:
    for arm, what in ARMS:
        if _get(r, arm, "acceptance_length") is None:
            yield (what, "not run yet", "", "", "", "", "", "", "")
            continue
        identical = _get(r, arm, "outputs_identical")
        yield (what, fmt(_get(r, arm, "epochs")), fmt(_get(r, arm, "num_speculative_tokens") or 3),
               _cell(_get(r, arm, "acceptance_length")),
               _cell(_get(r, arm, "per_position")),
               f"{fmt(_get(r, arm, 'accepted_tokens'))} / {fmt(_get(r, arm, 'draft_tokens'))}",
               f"{fmt(_get(r, arm, 'tokens_per_s_with_draft'))} / {fmt(_get(r, arm, 'tokens_per_s_without_draft'))}",
               "yes" if identical else f"**no**: {len(_get(r, arm, 'differing_prompts') or [])} prompts",
               fmt(_get(r, arm, "train_s")))


def _target_rows(r: Results) -> Iterator[Cells]:
    for figure, target, value_of, met in TARGETS:
        value = value_of(r)
        yield (figure, _cell(value), target, "–" if value is None else ("yes" if met(value) else "**no**"))


def _curve_rows(r: Results) -> Iterator[Cells]:
    for arm, name in DRAFT_TYPES:
        for point in r.get(f"acceptance_{arm}_curve") or []:
            yield (name, f"{point['tokens_fraction']:.0%}", _cell(point["acceptance_length"]),
                   _cell(point["per_position"]))


ACCEPTANCE: tuple[Block, ...] = (When("acceptance_train_prompts", (
    "## Drafts trained on hsx data, measured in vLLM",
    "Drafts for SmolLM2-135M-Instruct (EAGLE-3; DFlash and P-EAGLE in (f) and (g), each type with speculators' "
    "defaults for it) trained by speculators (0.9) on {acceptance_samples} chats whose "
    "answers the verifier regenerated (`hsx run --generate {acceptance_generate!s}`: "
    "{acceptance_train_prompts} prompts from the documentation of {acceptance_train_sources} installed packages, "
    "{acceptance_supervised_tokens} answer tokens), then measured by `hsx eval-draft` (vLLM's own speculative-"
    "decoding counters; greedy, up to 128 tokens; EAGLE-3 at 3 speculative tokens, DFlash and P-EAGLE at their "
    "checkpoints' 15 and 8) on {acceptance_eval_prompts} held-out chats "
    "from another source (CPython's help topics). Every arm trains with the same flags: the command `hsx export` "
    "prints, with a draft vocabulary of 8,192, 2,048-token batches, 4 epochs, seed 0 "
    "(`bench.acceptance.TRAIN_FLAGS`). (c) and (d) may stop after fewer epochs of the same schedule "
    "(`--epochs`) and are then set beside (a)'s checkpoint after as many; (b) reads the stream once, beside (a) "
    "after one epoch.",
    Table(("arm", "epochs", "draft tokens a step", "acceptance length", "per position", "accepted / drafted",
           "tokens/s with / without",
           "greedy outputs identical", "training s"), _arm_rows),
    Table(("figure", "value", "target", "met"), _target_rows),
    When("acceptance_offline_curve", (
        "Learning curves of (a), (f) and (g): acceptance after part of their training tokens (their epoch "
        "checkpoints).",
        Table(("type", "training tokens", "acceptance length", "per position"), _curve_rows),
    )),
    Bullets((
        "speculators' own validation of (a) (its held-out 10 % of the training rows, same domain): full "
        "accuracy per draft position {acceptance_offline_val_full_acc!s}",
        "speculators' own validation after (c)'s and (d)'s last epoch: {acceptance_reference_val_full_acc!s} and "
        "{acceptance_shifted_val_full_acc!s}. The shifted control scores highest of all drafts: its loss is "
        "against the verifier's next-token distribution taken from the same shifted hidden states, so with every "
        "position a step late the draft learns to repeat the token it is given. In vLLM it is useless (acceptance "
        "length {acceptance_shifted_acceptance_length}): only acceptance measured in the engine sees such a data "
        "error",
        "generation + capture (`hsx run`): {acceptance_data_s} s; export: {acceptance_export_s} s; "
        "HF reference hidden states: {acceptance_reference_hf_s} s",
        "evaluation, per draft (120 prompts with and without it): {acceptance_offline_eval_s} s. Tokens/s are "
        "of two CPU cores, where the draft's own forward passes cost more than the verifier steps they save, and "
        "an evaluation may have overlapped another stage's work: read them within a row only",
        "greedy outputs: in bfloat16, 3 to 8 of the 120 prompts differ with a draft, another set for each draft, 3 "
        "with the untrained one (which proposes nothing the verifier accepts); (a)'s 3, evaluated alone, are "
        "identical in bfloat16 and in float32, and in float32 all 120 are (the float32 row): the verifier's bfloat16 "
        "results depend on the batch it runs in, not on the draft",
        "the corpus: train {acceptance_train_sha256!s}, eval {acceptance_eval_sha256!s} (sha256 of the files)",
    )),
    "```bash\n"
    ".venv/bin/python -m bench.acceptance --only offline   # one arm (and the stages it needs); resumes\n"
    ".venv/bin/python -m bench --only acceptance           # what is left, then merged into this page\n"
    "```",
)),)
