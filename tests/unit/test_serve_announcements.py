"""``hsx serve``'s accounting of captures: a promise (a response named a file or
a sample) is held until its capture's report, an acknowledged sample until the sink
announces or dead-letters it, whichever of the two events arrives first, so a
server that runs for weeks holds what is in flight only. A promise still held when
the engine is gone is lost, counted and named; a dead-lettered sample is lost.
Readiness says whether Kafka keeps up, lags, or holds requests back."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from hsx.schemas import ErrorClass, HiddenStatesReady
from hsx.schemas.reports import CompletionReport, FileReport, KafkaState, PromiseReport
from hsx.serving.pipeline import Announcements
from hsx.serving.reports import STALL_SECONDS, InFlight, ReportReceiver


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
    assert not announcements._samples._opened and not announcements._samples._closed_first  # nothing kept


def test_a_sample_the_engine_died_before_confirming_is_lost_unless_announced() -> None:
    announcements = Announcements()
    announcements.record_ready(_ready("u-1"))  # acknowledged by Kafka; the engine died before reporting it
    assert announcements.not_announced(["u-1", "u-2"]) == ["u-2"]
    assert announcements.missing() == set()


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


def test_in_flight_holds_an_id_between_its_two_events_only() -> None:
    flight = InFlight()
    assert flight.open("a") is None and flight.held() == {"a"}
    assert flight.close("a", "ok") and flight.held() == set()
    assert not flight.close("b", "failed")  # the report before the promise
    assert flight.open("b") == "failed" and flight.held() == set()
    assert not flight._opened and not flight._closed_first


def test_promises_without_their_capture_are_lost_when_the_engine_is_gone(tmp_path: Path) -> None:
    acknowledged: list[str] = []
    receiver = ReportReceiver(tmp_path, acknowledged.append)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(receiver.address)
    reports = [PromiseReport(path="/f/1", sample_id="s-1"), PromiseReport(path="/f/2", sample_id="s-2"),
               PromiseReport(sample_id="s-3"), PromiseReport(path="/f/4"),
               FileReport(path="/f/1", ok=True, raw_bytes=10, seconds=0.1),
               CompletionReport(request_id="s-1", attempt_id="a" * 32, ok=True, raw_bytes=10, seconds=0.1),
               CompletionReport(request_id="s-3", attempt_id="a" * 32, ok=False, error="broker refused"),
               FileReport(path="/f/5", ok=True, raw_bytes=10),  # before its promise (another process)
               FileReport(path="/f/old", ok=False, earlier=True, error="died"),  # an earlier server's loss
               PromiseReport(path=str(tmp_path / "whole.safetensors"), sample_id="s-6")]  # written, never reported
    (tmp_path / "whole.safetensors").write_bytes(b"whole")
    try:
        for report in reports:
            push.send(report.model_dump_json().encode())
        push.send(PromiseReport(path="/f/5").model_dump_json().encode())
        deadline = time.monotonic() + 10
        while receiver.files.ok + receiver.samples.ok + receiver.samples.failed < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        push.close(linger=1000)
        receiver.close()  # the engine is gone: what is still promised was lost
    assert acknowledged == ["s-1"]
    assert (receiver.samples.ok, receiver.samples.failed, receiver.samples.errors) == (1, 1, ["broker refused"])
    assert receiver.files.lost == ["/f/2", "/f/4"] and receiver.samples.lost == ["s-2", "s-6"]
    assert (receiver.files.ok, receiver.files.unreported) == (3, 1)  # /f/1, /f/5, and the whole file found
    receiver.settle_samples(["s-2"])  # the dataset side found s-6: Kafka acknowledged it as the engine died
    assert (receiver.samples.ok, receiver.samples.unreported, receiver.samples.lost) == (2, 1, ["s-2"])
    assert receiver.earlier == ["/f/old"] and receiver.files.failed == 0  # not this server's loss


def test_readiness_tells_a_silent_kafka_from_backpressure(tmp_path: Path) -> None:
    receiver = ReportReceiver(tmp_path)
    try:
        for state in (KafkaState(in_flight=3, in_flight_bytes=3 << 20, unacknowledged_s=1.0, full_s=0.0),
                      KafkaState(in_flight=3, in_flight_bytes=3 << 20, unacknowledged_s=8.0, full_s=0.0),
                      KafkaState(in_flight=9, in_flight_bytes=9 << 20, unacknowledged_s=12.0, full_s=2.0),
                      KafkaState(in_flight=0, in_flight_bytes=0, unacknowledged_s=0.0, full_s=0.0)):
            receiver._count(state.model_dump_json().encode())
            said = receiver.kafka_condition()
            if state.full_s:
                assert said is not None and said.startswith("slowed by backpressure") and "12 s" in said
            elif state.unacknowledged_s >= STALL_SECONDS:
                assert said is not None and said.startswith("answering, Kafka behind") and "3 captures" in said
            else:
                assert said is None
    finally:
        receiver.close()
