"""The embedded broker and the ``hsx broker`` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from confluent_kafka.admin import AdminClient

from hsx.local.broker import EmbeddedBroker, free_port
from hsx.runtime.kafka import ensure_topics
from hsx.runtime.settings import KafkaSettings, TopicSettings

pytestmark = pytest.mark.integration


def test_embedded_broker_serves_topics_and_stops() -> None:
    with EmbeddedBroker() as broker:
        kafka = KafkaSettings(bootstrap=broker.bootstrap)
        ensure_topics(kafka, TopicSettings(partitions=3), ["t1"])
        metadata = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=5)
        assert len(metadata.topics["t1"].partitions) == 3
        # Creating an existing topic again is not an error.
        ensure_topics(kafka, TopicSettings(partitions=3), ["t1"])
    assert not broker.running


def test_hsx_broker_command_prints_address_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "broker", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"127.0.0.1:{port}"
        AdminClient({"bootstrap.servers": f"127.0.0.1:{port}"}).list_topics(timeout=5)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
    # Nothing listens any more: the broker child went with it.
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=1).close()
