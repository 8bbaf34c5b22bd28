"""``hsx serve --learn``'s trainer metrics, read from the trainer's log as it
grows: the latest step and loss, a line still being written left for the next
read, a restarted trainer's new log read from its start."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

from hsx.serving.learning import TrainerProgress


def _gauges() -> tuple[float | None, ...]:
    return tuple(REGISTRY.get_sample_value(f"hsx_serve_trainer_{name}") for name in ("step", "loss", "samples"))


def test_the_latest_complete_step_line_sets_the_gauges(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    progress = TrainerProgress()
    progress.read(log)  # not there yet: nothing
    log.write_bytes(b"INFO speculators: loading\n"
                    b"INFO step 1: loss 2.5000, first-token accuracy 0.100, 8 samples so far\n"
                    b"INFO step 2: loss 2.2500, first-token accuracy 0.200, 16 samples so far\nINFO step 3: loss 1.")
    progress.read(log)
    assert _gauges() == (2, 2.25, 16)
    with log.open("ab") as out:
        out.write(b"9000, first-token accuracy 0.300, 24 samples so far\n")
    progress.read(log)
    assert _gauges() == (3, 1.9, 24)
    restarted = tmp_path / "trainer.2.log"
    restarted.write_bytes(b"INFO step 3: loss 1.8000, first-token accuracy 0.310, 24 samples so far\n")
    progress.read(restarted)
    assert _gauges() == (3, 1.8, 24)
