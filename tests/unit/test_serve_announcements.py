"""``hsx serve``'s wait for ready events: an acknowledged sample is held only
until the sink announces or dead-letters it, in whichever order its report and its
ready event arrive, so a server that runs for weeks holds what is in flight only;
a dead-lettered sample counts as lost."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from hsx.schemas import ErrorClass, HiddenStatesReady
from hsx.schemas.connector import CompletionReport
from hsx.serve_pipeline import Announcements
from hsx.serve_reports import ReportReceiver


def _ready(sample_id: str) -> HiddenStatesReady:
    return HiddenStatesReady.model_construct(request_id=sample_id)  # the wait reads the id alone


def test_an_announced_sample_is_forgotten_whichever_arrives_first() -> None:
    announcements = Announcements()
    announcements.acknowledged("s-1")
    announcements.record_ready(_ready("s-2"))  # the sink was faster than the report channel
    assert announcements.missing() == {"s-1"}
    announcements.acknowledged("s-2")
    announcements.record_ready(_ready("s-1"))
    assert announcements.missing() == set()
    assert announcements.announced == 2
    assert not announcements._pending and not announcements._early  # nothing kept once settled


def test_a_dead_lettered_sample_is_settled_and_counted_as_lost() -> None:
    announcements = Announcements()
    for n in range(3):
        announcements.acknowledged(f"s-{n}")
    announcements.record_dead_letter("s-0", ErrorClass.CORRUPT_BLOCK)
    announcements.record_dead_letter("other", ErrorClass.CORRUPT_BLOCK)  # never acknowledged: reported already
    announcements.record_ready(_ready("s-1"))
    assert announcements.missing() == {"s-2"}
    assert announcements.dead == {ErrorClass.CORRUPT_BLOCK.value: 1}
    assert announcements.announced == 1


def test_the_receiver_hands_on_acknowledged_samples_only(tmp_path: Path) -> None:
    acknowledged: list[str] = []
    receiver = ReportReceiver(tmp_path, acknowledged.append)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(receiver.address)
    try:
        for sample, ok in (("s-1", True), ("s-2", False), ("s-3", True)):
            report = CompletionReport(request_id=sample, attempt_id="a" * 32, ok=ok, raw_bytes=10, seconds=0.1,
                                      error=None if ok else "broker refused")
            push.send(report.model_dump_json().encode())
        deadline = time.monotonic() + 10
        while receiver.samples.ok + receiver.samples.failed < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        push.close(linger=1000)
        receiver.close()
    assert acknowledged == ["s-1", "s-3"]
    assert (receiver.samples.ok, receiver.samples.failed, receiver.samples.errors) == (2, 1, ["broker refused"])
