"""``hsx run``: producer, extractor and sink on one machine for a file of
prompts. ``command`` is the command and its steps; ``plan`` what a run needs,
checked first, and what it picks for its services; ``ledger`` every published
prompt accounted for (a ready event or a dead letter)."""
