"""The draft types speculators trains, and what hsx knows of each.

Every type hsx feeds conditions on the same data: the verifier's hidden states
at some aux layers and at its last layer (from which the trainer computes the
verifier's next-token targets), so ``hsx export`` writes one layout for all and
``hsx train-draft`` reads one stream. What differs is the config key naming the
aux layers, whether training batches are EAGLE-3's shifted ones (each position
predicts the next token from the previous position's states) or DFlash's
unshifted blocks, and how vLLM serves a checkpoint (vLLM's own
``SpeculatorsConfig`` reads that from ``config.json``). A type hsx cannot feed
or measure is refused with the reason (:data:`REFUSED`), never exported wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from hsx.runtime.errors import UsageError
from hsx.schemas.training import SpeculatorType


@dataclass(frozen=True)
class DraftType:
    name: SpeculatorType
    title: str
    aux_key: str
    """The ``config.json`` key of a saved draft naming the verifier layers it reads."""
    shifted: bool
    """Trained on EAGLE-3's shifted batches (speculators' ``shift_batch``); DFlash's are not."""
    eagle3_layers: bool
    """vLLM serves it with its EAGLE-3 model classes (P-EAGLE with parallel
    drafting): the aux layer ids may be left to the verifier's default, and its
    llama layers size the input projection from the model config. vLLM's DFlash
    model requires the ids and counts them."""


TYPES: dict[str, DraftType] = {t.name: t for t in (
    DraftType("eagle3", "EAGLE-3", "eagle_aux_hidden_state_layer_ids", shifted=True, eagle3_layers=True),
    DraftType("dflash", "DFlash", "aux_hidden_state_layer_ids", shifted=False, eagle3_layers=False),
    DraftType("peagle", "P-EAGLE", "eagle_aux_hidden_state_layer_ids", shifted=True, eagle3_layers=True),
)}
assert set(TYPES) == set(get_args(SpeculatorType))

REFUSED: dict[str, str] = {
    "mtp": "MTP drafts are trained on the verifier's own multi-token-prediction layers, which hsx does not "
           "extract (and speculators trains them with flex attention only, which has no CPU backend)",
    "xpress": "vLLM does not serve XPress drafts, so hsx could not measure one (vLLM serves eagle3, peagle, "
              "dflash, dflash2 and dspark checkpoints)",
    "dflash2": "not yet checked end to end by hsx (the same data as dflash: export with --speculator-type dflash "
               "and train with speculators' --speculator-type dflash2 at your own risk)",
    "dspark": "not yet checked end to end by hsx (the same data as dflash: export with --speculator-type dflash "
              "and train with speculators' --speculator-type dspark at your own risk)",
}
"""speculators' other types, and why hsx does not offer them."""


def draft_type(flag: str, name: str) -> DraftType:
    """The type ``name``; :class:`UsageError` naming ``flag`` with the reason
    for a type hsx refuses or does not know."""
    if name in TYPES:
        return TYPES[name]
    if name in REFUSED:
        raise UsageError(f"{flag} {name}: refused: {REFUSED[name]}")
    raise UsageError(f"{flag} {name}: not a draft type speculators trains (hsx feeds {', '.join(TYPES)})")
