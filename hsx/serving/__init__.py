"""``hsx serve``: vLLM's own OpenAI server with hsx behind it, on one machine or
as a deployment's serving pods. ``command`` is the command and its steps;
``plan`` what it needs, checked first; ``pipeline`` its dataset side (topics, the
sink, the ready events followed); ``reports`` the connector's reports (promises,
captures, the Kafka side, draft swaps: metrics, readiness, the summary);
``acceptance`` live acceptance per draft version; ``rollbacks`` a worse
promoted draft rolled back by the servers that follow a drafts store;
``learning`` the loop beside the server (``--learn``: the trainer)."""
