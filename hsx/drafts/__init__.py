"""EAGLE-3 drafts trained on hsx data: what a checkpoint holds (:mod:`.checkpoint`)
and how well it drafts for its verifier in vLLM (:mod:`.acceptance`, ``hsx eval-draft``)."""
