"""Drafts trained on hsx data: the types hsx feeds (:mod:`.draft_types`), what a
checkpoint holds (:mod:`.checkpoint`) and how well it drafts for its verifier in
vLLM (:mod:`.acceptance`, ``hsx eval-draft``)."""
