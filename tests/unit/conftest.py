"""Fixtures the codec tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def real_hidden_states() -> torch.Tensor:
    """SmolLM2's hidden states (HF transformers, float32) on a short text."""
    from transformers import AutoTokenizer

    from hsx import models
    from hsx.reference import HFReference

    path = models.prepare(names=["smollm2-135m-instruct"])["smollm2-135m-instruct"]
    ids = AutoTokenizer.from_pretrained(path)("Hidden states of a real model compress better than noise.")["input_ids"]
    return HFReference(path).hidden_states(ids, [2, 15, 27, 30])
