"""Turn prompt events into hidden-state records: a Kafka consumer (``service``)
driving an in-process vLLM engine (``engine``) whose KV connector
(``connector``) streams compressed blocks to ``hidden_states.blocks``."""
