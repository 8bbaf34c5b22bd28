"""A stand-in training process for tests/integration/test_online_loader.py: it
reads a ReadyStream through a DataLoader with 2 workers, "trains" on each batch
by appending its request ids to a log (flushed and fsynced: the step happened),
then commits, and with ``--state`` saves the loader state as a checkpoint would.
``--crash-after K`` SIGKILLs the process after batch K's step, before its
commit: the worst moment for a kill between batches.

    python -m tests.integration.online_trainer BOOTSTRAP DATASET TOPIC GROUP LOG [--state F] [--shuffle N] [--crash-after K]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hsx.trainer import PaddedCollate, ReadyStream

BATCH = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "dataset", "topic", "group", "log"):
        parser.add_argument(name)
    parser.add_argument("--state", type=Path)
    parser.add_argument("--shuffle", type=int, default=0)
    parser.add_argument("--crash-after", type=int)
    args = parser.parse_args()
    stream = ReadyStream(args.bootstrap, args.dataset, args.group, topic=args.topic, shuffle_buffer=args.shuffle,
                         until_end=True)
    if args.state is not None and args.state.exists():
        stream.load_state_dict(json.loads(args.state.read_text()))
    loader = DataLoader(stream, batch_size=BATCH, num_workers=2, collate_fn=PaddedCollate(torch.float32))
    with open(args.log, "a") as log:
        for step, batch in enumerate(loader, start=1):
            log.write(json.dumps(batch["request_ids"]) + "\n")
            log.flush()
            os.fsync(log.fileno())
            if step == args.crash_after:
                os.kill(os.getpid(), signal.SIGKILL)
            stream.commit(batch)
            if args.state is not None:
                tmp = args.state.with_suffix(".tmp")
                tmp.write_text(json.dumps(stream.state_dict()))
                tmp.replace(args.state)
    stream.close()


if __name__ == "__main__":
    main()
