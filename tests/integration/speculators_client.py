"""Run with .venv-speculators' python: speculators' own online client against a
vLLM server, as ``speculators train --on-missing generate`` uses it.

    speculators_client.py URL MODEL REQUESTS_JSON OUT.safetensors

REQUESTS_JSON is a list of ``{"input_ids": [...]}`` (completions) or with
``messages`` (chat). For each, ``generate_hidden_states`` sends the request and
checks the prompt's token ids; ``hs_connectors.FileTransfer`` waits on the lock
and loads the file; the tensors go into OUT as ``<i>/hidden_states`` and
``<i>/token_ids``, the handle's path as metadata, and then (as the trainer does)
the file is deleted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
from hs_connectors.transfer import FileTransfer
from safetensors.torch import save_file
from speculators.data_generation.vllm_client import generate_hidden_states


def main() -> None:
    url, model, requests, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    client = openai.Client(base_url=f"{url}/v1", api_key="unused")
    transfer = FileTransfer(out.parent)
    tensors, handles = {}, {}
    for i, item in enumerate(requests):
        handle, params = generate_hidden_states(client, model, item)
        loaded = transfer.get_generated(params)
        if loaded is None:
            raise SystemExit(f"request {i}: FileTransfer found no file at {handle}")
        for name, tensor in loaded.items():
            tensors[f"{i}/{name}"] = tensor.contiguous()
        handles[str(i)] = handle
        transfer.delete(handle)
    save_file(tensors, str(out), metadata={"handles": json.dumps(handles)})


if __name__ == "__main__":
    main()
