"""Drafts trained on hsx data measured in vLLM: how well one drafts for its
verifier (:mod:`.acceptance`, ``hsx eval-draft``). What a checkpoint holds and
the types hsx feeds are :mod:`hsx.runtime.draft_checkpoint` and
:mod:`hsx.runtime.draft_types` (the trainer reads them too)."""
