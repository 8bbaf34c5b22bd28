"""The learning loop measured: ``hsx serve --draft D --learn`` against the same
draft served static, on traffic the draft never saw (SmolLM2-135M-Instruct, CPU,
3 speculative tokens, greedy).

1. ``static``: the draft both arms start from: EAGLE-3 trained offline on chat
   (:mod:`bench.acceptance`'s corpus, data, export and training, at
   :data:`STATIC` scale, in ``WORK/static``), or ``--static DIR`` (e.g. ``make
   acceptance``'s offline draft); ``untrained``: speculators' ``--dry-run`` draft
   of the same export.
2. The stream: ``FULL.stream`` requests for code (:mod:`bench.loop_prompts`),
   a shift the chat-trained draft never saw, sent in windows of ``FULL.window``
   requests at concurrency :data:`CONCURRENCY`, temperature 0: the same prompts
   in the same order to each arm (after :data:`WARM_UP` chat requests), a
   window's requests all answered before the next window starts.
3. Arms, each one ``hsx serve --draft ... --output`` (the dataset on an embedded
   broker) with the same flags:

   - ``static``: the static draft, no learning;
   - ``loop``: the static draft with ``--learn`` (checkpoint every
     :data:`CHECKPOINT_EVERY` steps): trains on the stream as it is served, the
     gate promotes, the server swaps;
   - ``untrained``: the untrained draft with ``--learn``: how many requests the
     loop needs to reach the static draft (window by window, on the same prompts).

   Per window: acceptance length and acceptance by position from vLLM's own
   counters (``vllm:spec_decode_*`` on the server's ``/metrics``, read at the
   window's ends), output tokens/s, the draft versions that answered; per arm:
   failed requests, swaps, gate decisions, trainer steps. The trainer shares the
   server's two cores here (a pod of its own in production), where it trains
   about one sample for five the server answers: between two windows the loop
   waits until it has trained on what was served and the gate has judged its
   latest checkpoint (:func:`catch_up`; ``catch_up_s``, outside the window's
   tokens/s), as a trainer on hardware of its own would keep up.
4. ``capture``: capture while speculating ÷ speculating alone: vLLM's own server
   with the static draft and hsx serve's flags minus its connector, and ``hsx
   serve --draft --output``, up together; bursts of code requests at c = 1 and 8
   in alternating order, :data:`CAPTURE_ROUNDS` rounds, output tokens/s ratios
   per round and their median.

The windows' acceptance lengths are drawn in ``docs/learning.md`` (a Mermaid
chart between the ``bench.loop`` markers) and tabled in ``docs/benchmarks.md``.

    python -m bench.loop [--quick] [--static DIR] [--arms [ARM ...]] [--no-capture] [--stream N] [--work DIR]
                         [--out FILE]

Run on its own (no ``--out``), its figures are merged into ``bench/results.json``
and ``docs/benchmarks.md`` rendered again. Each arm's figures are kept in
``WORK/figures``, so the arms can run one at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import loop_prompts
from bench.acceptance import QUICK, ROOT, Scale, Work, ensure, model_dir, train_arm, untrained_draft
from bench.section import emit, parser
from bench.sink_scale import publish
from hsx.local.broker import free_port
from hsx.local.scrape import metric
from hsx.local.spawn import HsxService, cpu_engine_env
from hsx.serving.command import SERVER, add_arguments, server_argv, server_env
from hsx.serving.plan import plan_from_args
from hsx.trainer.gate import decisions, outcome_counts


@dataclass(frozen=True)
class Sizes:
    static: Scale
    stream: int
    window: int
    max_tokens: int
    capture_bursts: tuple[tuple[int, int], ...]
    """(concurrency, requests) of each capture burst."""
    capture_rounds: int


STATIC = Scale(train_prompts=480, eval_prompts=24, max_tokens=128, epochs=2, curve=(2,))
FULL = Sizes(static=STATIC, stream=960, window=120, max_tokens=96, capture_bursts=((1, 6), (8, 24)),
             capture_rounds=3)
QUICK_SIZES = Sizes(static=QUICK, stream=32, window=16, max_tokens=32, capture_bursts=((1, 2), (8, 8)),
                    capture_rounds=1)
CONCURRENCY = 8
WARM_UP = 8
"""Chat requests (the static draft's evaluation prompts) each server answers
before the stream, untimed: a new server's first requests pay its warm-up."""
CHECKPOINT_EVERY = 5
CAUGHT_UP = 0.9
"""The share of served requests the loop's trainer trains on: the rest is held out for the gate."""
CAUGHT_UP_SLACK = 32
"""Samples a trainer that caught up may still owe: those waiting to fill a packed batch."""
ARMS = ("static", "loop", "untrained")
MODEL_LEN = "2048"
CHART_MARKERS = ("<!-- bench.loop chart: begin -->", "<!-- bench.loop chart: end -->")


# -- the traffic ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    """vLLM's speculative-decoding counters at one moment: drafts (verify steps), accepted tokens, by position."""

    drafts: float
    accepted: float
    per_position: tuple[float, ...]

    @classmethod
    def read(cls, url: str) -> Counters:
        samples = [s for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
                   for s in family.samples]

        def total(name: str) -> float:
            return sum(s.value for s in samples if s.name == name)

        positions = sorted((int(s.labels["position"]), s.value) for s in samples
                           if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        return cls(total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_accepted_tokens_total"),
                   tuple(v for _, v in positions))


def _ask(url: str, model: str, row: dict[str, Any], max_tokens: int) -> dict[str, Any] | None:
    """One greedy chat request: its response, or None when it failed."""
    try:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=900, json={
            "model": model, "messages": row["messages"], "max_tokens": max_tokens, "temperature": 0})
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def send(url: str, model: str, rows: list[dict[str, Any]], max_tokens: int, concurrency: int
         ) -> tuple[list[dict[str, Any] | None], float]:
    """``rows`` at ``concurrency``, all answered: the responses in order and the wall time."""
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        responses = list(pool.map(lambda row: _ask(url, model, row, max_tokens), rows))
    return responses, time.monotonic() - started


def output_tokens(responses: list[dict[str, Any] | None]) -> int:
    return sum(r["usage"]["completion_tokens"] for r in responses if r is not None)


def window_figures(responses: list[dict[str, Any] | None], seconds: float, before: Counters, after: Counters
                   ) -> dict[str, Any]:
    drafts = after.drafts - before.drafts
    versions = sorted({(r.get("kv_transfer_params") or {}).get("draft_version") for r in responses if r is not None},
                      key=lambda v: -1 if v is None else v)
    return {"acceptance_length": round(1 + (after.accepted - before.accepted) / drafts, 3) if drafts else None,
            "per_position": [round((a - b) / drafts, 3) for a, b in zip(after.per_position, before.per_position)]
            if drafts else [],
            "output_tokens_per_s": round(output_tokens(responses) / seconds, 2),
            "failed": sum(r is None for r in responses), "draft_versions": versions}


# -- the servers ----------------------------------------------------------------------------------


def hsx_serve(name: str, draft: Path, work: Path, learn: bool, health: int = 0) -> HsxService:
    """``hsx serve --draft`` as a user runs it, its dataset (and loop) under ``work``."""
    port = free_port()
    args = ["serve", "--model", str(model_dir()), "--draft", str(draft), "--max-model-len", MODEL_LEN,
            "--port", str(port), "--health-port", str(health or free_port()), "--output", str(work / "dataset")]
    if learn:
        args += ["--learn", "--save-path", str(work / "loop"), "--checkpoint-every", str(CHECKPOINT_EVERY)]
    service = HsxService(name, args, work, env=cpu_engine_env(), health=False, ready_path="/health")
    service.port = port
    return service


def speculating_alone(draft: Path, work: Path) -> HsxService:
    """vLLM's own server with the flags and environment ``hsx serve --draft``
    gives it, less its connector and the per-request counts the connector reads.
    The CPU defaults stay in this process's environment, so an ``hsx serve``
    started after it takes the same ones."""
    cli = argparse.ArgumentParser()
    add_arguments(cli)
    plan = plan_from_args(cli.parse_args(["--model", str(model_dir()), "--draft", str(draft),
                                          "--max-model-len", MODEL_LEN, "--shared-storage-path", str(work / "unused")]))
    argv = server_argv(plan, {})
    for flag in ("--kv-transfer-config", "--per-request-spec-decode-metrics", "--port", "--host"):
        at = argv.index(flag)
        del argv[at:at + 2]
    return HsxService("speculating", argv, work, env=server_env(plan), module=SERVER, port_flag="--port",
                      ready_path="/health")


def url_of(service: HsxService) -> str:
    return f"http://127.0.0.1:{service.port}"


# -- the arms -------------------------------------------------------------------------------------


def run_arm(name: str, draft: Path, learn: bool, stream: list[dict[str, Any]], warm_up: list[dict[str, Any]],
            sizes: Sizes, work: Path) -> dict[str, Any]:
    """One arm over the whole stream (after ``warm_up``): its windows and totals."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = str(model_dir())
    windows: list[dict[str, Any]] = []
    started = time.monotonic()
    health = free_port()
    with hsx_serve(name, draft, work, learn, health) as serve:
        serve.wait_ready(timeout=900)
        url = url_of(serve)
        send(url, model, warm_up, sizes.max_tokens, CONCURRENCY)
        for start in range(0, len(stream), sizes.window):
            before = Counters.read(url)
            responses, seconds = send(url, model, stream[start:start + sizes.window], sizes.max_tokens, CONCURRENCY)
            windows.append(window_figures(responses, seconds, before, Counters.read(url)))
            if learn:
                windows[-1]["catch_up_s"] = catch_up(health, len(warm_up) + start + len(responses),
                                                     work / "loop" / "drafts")
            print(f"[bench.loop] {name} requests {start + len(responses)}/{len(stream)}: {windows[-1]}", flush=True)
        serve.signal(signal.SIGTERM)
        status = serve.wait(900)
        log = serve.logs()
    if status != 0:
        raise SystemExit(f"error: {name}'s hsx serve exited with {status}:\n{log[-3000:]}")
    figures: dict[str, Any] = {"windows": windows, "seconds": round(time.monotonic() - started, 1),
                               "failed": sum(w["failed"] for w in windows),
                               "versions": sorted({v for w in windows for v in w["draft_versions"] if v is not None})}
    if learn:
        figures["gate"] = outcome_counts(decisions(work / "loop" / "drafts"))
        rolled = re.search(r"drafts rolled back\s+(\d+)", log)
        figures["rollbacks"] = int(rolled.group(1)) if rolled else None
        steps = [int(n) for path in sorted((work / "dataset" / "logs").glob("trainer*.log"))
                 for n in re.findall(r"step (\d+):", path.read_text(errors="replace"))]
        figures["trainer_steps"] = max(steps, default=0)
    return figures


def catch_up(health: int, served: int, drafts: Path, timeout: float = 900) -> float:
    """Wait until the trainer has trained on what was served (:data:`CAUGHT_UP`,
    less :data:`CAUGHT_UP_SLACK`) and the gate has judged its latest checkpoint:
    a trainer on hardware of its own keeps up with its server, this one shares
    the server's two cores. The seconds waited (not in the window's tokens/s)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        trained, step = metric(health, "hsx_serve_trainer_samples"), metric(health, "hsx_serve_trainer_step")
        if trained >= CAUGHT_UP * served - CAUGHT_UP_SLACK and len(decisions(drafts)) >= step // CHECKPOINT_EVERY:
            break
        time.sleep(2)
    return round(time.monotonic() - started, 1)


def requests_to_reach(arm: list[dict[str, Any]], target: list[dict[str, Any]], window: int) -> int | None:
    """Requests the arm served until a window's acceptance length first reached
    the target's in the same window (the same prompts); None if none did."""
    for i, (mine, theirs) in enumerate(zip(arm, target)):
        if mine["acceptance_length"] is not None and theirs["acceptance_length"] is not None \
                and mine["acceptance_length"] >= theirs["acceptance_length"]:
            return (i + 1) * window
    return None


def capture_ratio(draft: Path, stream: list[dict[str, Any]], warm_up: list[dict[str, Any]], sizes: Sizes,
                  work: Path) -> dict[str, Any]:
    """Stage 4: output tokens/s, hsx serve ÷ vLLM alone, per burst size, paired per round."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = str(model_dir())
    ratios: dict[int, list[float]] = {c: [] for c, _ in sizes.capture_bursts}
    for side in ("alone", "capturing"):
        (work / side).mkdir()
    with ExitStack() as stack:
        alone = stack.enter_context(speculating_alone(draft, work / "alone"))
        capturing = stack.enter_context(hsx_serve("capturing", draft, work / "capturing", learn=False))
        for service in (alone, capturing):
            service.wait_ready(timeout=900)
            send(url_of(service), model, warm_up, sizes.max_tokens, CONCURRENCY)
        rows = iter(stream)
        for r in range(sizes.capture_rounds):
            for concurrency, count in sizes.capture_bursts:
                burst = [next(rows) for _ in range(count)]
                rates: dict[str, float] = {}
                for service in ((alone, capturing) if r % 2 == 0 else (capturing, alone)):
                    responses, seconds = send(url_of(service), model, burst, sizes.max_tokens, concurrency)
                    rates[service.name] = output_tokens(responses) / seconds
                ratios[concurrency].append(round(rates["capturing"] / rates["speculating"], 3))
                print(f"[bench.loop] capture round {r} c={concurrency}: {ratios[concurrency][-1]}", flush=True)
    return {f"loop_capture_c{c}_vs_speculating": round(statistics.median(v), 3) for c, v in ratios.items()} | {
        f"loop_capture_c{c}_vs_speculating_rounds": v for c, v in ratios.items()}


# -- the report -----------------------------------------------------------------------------------


def chart(results: dict[str, Any]) -> str:
    """A Mermaid line chart of each arm's acceptance length per window."""
    arms = [a for a in ARMS if f"loop_{a}_windows" in results]
    window = results["loop_window"]
    count = max(len(results[f"loop_{a}_windows"]) for a in arms)
    values = [[w["acceptance_length"] or 1.0 for w in results[f"loop_{a}_windows"]] for a in arms]
    top = max(max(v) for v in values)
    lines = ["```mermaid", "xychart-beta",
             f'    title "Acceptance length per window of {window} requests (' + ", ".join(
                 f"line {i + 1}: {a}" for i, a in enumerate(arms)) + ')"',
             "    x-axis \"requests served\" [" + ", ".join(str((i + 1) * window) for i in range(count)) + "]",
             f'    y-axis "acceptance length" 1 --> {max(2.0, round(top + 0.1, 1))}']
    lines += [f"    line [{', '.join(f'{v:.2f}' for v in series)}]" for series in values]
    return "\n".join(lines + ["```"])


def draw(results: dict[str, Any], page: Path) -> None:
    """Replace the chart between :data:`CHART_MARKERS` in ``page``."""
    text = page.read_text()
    begin, end = CHART_MARKERS
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(f"{head}{begin}\n{chart(results)}\n{end}{tail}")


def summarize(arms: dict[str, dict[str, Any]], window: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, arm in arms.items():
        last = arm["windows"][-1]
        figures |= {f"loop_{name}_windows": arm["windows"], f"loop_{name}_failed": arm["failed"],
                    f"loop_{name}_versions": arm["versions"], f"loop_{name}_last_acceptance_length":
                    last["acceptance_length"], f"loop_{name}_last_per_position": last["per_position"],
                    f"loop_{name}_mean_output_tokens_per_s": round(statistics.fmean(
                        w["output_tokens_per_s"] for w in arm["windows"]), 2)}
        for key in ("gate", "rollbacks", "trainer_steps", "seconds"):
            if key in arm:
                figures[f"loop_{name}_{key}"] = arm[key]
        if any("catch_up_s" in w for w in arm["windows"]):
            figures[f"loop_{name}_catch_up_s"] = round(sum(w.get("catch_up_s", 0) for w in arm["windows"]), 1)
    if "static" in arms and "loop" in arms:
        static, loop = figures["loop_static_last_acceptance_length"], figures["loop_loop_last_acceptance_length"]
        if static and loop:
            figures["loop_last_vs_static"] = round(loop / static, 3)
            figures["loop_last_minus_static"] = round(loop - static, 3)
        figures |= after_swaps(arms["loop"]["windows"], arms["static"]["windows"])
    if "static" in arms and "untrained" in arms:
        reached = requests_to_reach(arms["untrained"]["windows"], arms["static"]["windows"], window)
        served = len(arms["untrained"]["windows"]) * window
        figures["loop_untrained_requests_to_static"] = reached if reached is not None else f"not within {served}"
    return figures


def after_swaps(loop: list[dict[str, Any]], static: list[dict[str, Any]]) -> dict[str, Any]:
    """The windows a promoted draft served, the loop's mean acceptance length
    over them ÷ the static draft's on the same prompts."""
    swapped = [i for i, w in enumerate(loop) if any(v for v in w["draft_versions"] if v)]
    if not swapped or any(loop[i]["acceptance_length"] is None or static[i]["acceptance_length"] is None
                          for i in swapped):
        return {}
    mine = statistics.fmean(loop[i]["acceptance_length"] for i in swapped)
    theirs = statistics.fmean(static[i]["acceptance_length"] for i in swapped)
    return {"loop_swapped_windows": len(swapped), "loop_swapped_vs_static": round(mine / theirs, 3),
            "loop_swapped_minus_static": round(mine - theirs, 3)}


def main(args: Namespace) -> dict[str, Any]:
    sizes = QUICK_SIZES if args.quick else FULL
    if args.stream is not None:
        sizes = replace(sizes, stream=args.stream, window=max(1, args.stream // 8))
    root = (args.work or ROOT / "out" / ("loop-quick" if args.quick else "loop")).resolve()
    static_work = Work(root / "static", sizes.static)
    for stage in ("corpus", "data", "export"):
        ensure(static_work, stage)
    results: dict[str, Any] = {"loop_model": "smollm2-135m-instruct", "loop_stream": sizes.stream,
                               "loop_window": sizes.window, "loop_concurrency": CONCURRENCY,
                               "loop_max_tokens": sizes.max_tokens, "loop_checkpoint_every": CHECKPOINT_EVERY}
    if args.static is not None:
        static = args.static.resolve()
        results["loop_static_draft"] = "given (--static)"
    else:
        trained = train_arm(static_work, "offline")
        static = static_work.draft("offline") / str(sizes.static.epochs - 1)
        results |= {key.replace("acceptance_offline_", "loop_static_chat_"): value for key, value in trained.items()}
        results["loop_static_draft"] = (f"{sizes.static.train_prompts} chats, answers of {sizes.static.max_tokens} "
                                        f"tokens, {sizes.static.epochs} epochs")
    stream_info = loop_prompts.build(root / "stream.jsonl", sizes.stream)
    results |= {"loop_stream_sha256": stream_info["sha256"], "loop_stream_python": stream_info["python"]}
    stream = [json.loads(line) for line in (root / "stream.jsonl").read_text().splitlines()]
    warm_up = [json.loads(line) for line in (static_work.corpus / "eval.jsonl").read_text().splitlines()][:WARM_UP]
    drafts = {"static": (static, False), "loop": (static, True)}
    if "untrained" in args.arms:
        drafts["untrained"] = (untrained_draft(static_work), True)
    for name in (a for a in ARMS if a in args.arms):
        figures = run_arm(name, *drafts[name], stream, warm_up, sizes, root / "arms" / name)
        arm_file(root, name).parent.mkdir(parents=True, exist_ok=True)
        arm_file(root, name).write_text(json.dumps({"stream_sha256": stream_info["sha256"], **figures}) + "\n")
    results |= summarize(done_arms(root, stream_info["sha256"]), sizes.window)
    if not args.no_capture:
        results |= capture_ratio(static, stream, warm_up, sizes, root / "capture")
    if not args.quick:
        draw(results, ROOT / "docs" / "learning.md")
    return results


def arm_file(root: Path, name: str) -> Path:
    return root / "figures" / f"{name}.json"


def done_arms(root: Path, stream_sha256: str) -> dict[str, dict[str, Any]]:
    """Every arm measured on this stream, in this run or an earlier one (arms
    run one at a time: ``--arms untrained`` after ``--arms static loop``)."""
    arms = {}
    for name in ARMS:
        if arm_file(root, name).exists():
            figures = json.loads(arm_file(root, name).read_text())
            if figures.pop("stream_sha256") == stream_sha256:
                arms[name] = figures
    return arms


if __name__ == "__main__":
    cli = parser(__doc__)
    cli.set_defaults(out=None)
    cli.add_argument("--static", type=Path, metavar="DIR", help="the draft both arms start from (default: train one "
                     "on chat, in WORK/static)")
    cli.add_argument("--arms", nargs="*", choices=ARMS, default=list(ARMS),
                     help="the arms to run (default: all; none: only capture ÷ speculating alone)")
    cli.add_argument("--no-capture", action="store_true", help="skip capture ÷ speculating alone")
    cli.add_argument("--stream", type=int, metavar="N",
                     help=f"requests in the stream, in 8 windows (default {FULL.stream}; the library has about 1,070 "
                          "functions and methods to ask for)")
    cli.add_argument("--work", type=Path, help="where the stages keep what they make (default out/loop)")
    parsed = cli.parse_args()
    measured = main(parsed)
    emit(measured, parsed.out)
    if parsed.out is None and not parsed.quick:  # run on its own: merged into the published results and page
        publish(ROOT / "bench" / "results.json", ROOT / "docs" / "benchmarks.md", measured)
