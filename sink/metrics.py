"""The sink's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

SAMPLES = Counter("hsx_sink_samples", "Samples written to the dataset")
TOKENS = Counter("hsx_sink_tokens", "Tokens written to the dataset")
SHARDS = Counter("hsx_sink_shards", "Shards written")
READY_EVENTS = Counter("hsx_sink_ready_events", "hidden_states.ready events published")
DUPLICATES = Counter("hsx_sink_duplicates", "Samples dropped as duplicates")
REJECTED = Counter("hsx_sink_rejected", "Samples or records sent to the DLQ", ["error_class"])
BUFFERED_BYTES = Gauge("hsx_sink_buffered_bytes", "Bytes held in memory (pending blocks + open shards)")
REBALANCES = Counter("hsx_sink_rebalances", "Partition assignments and revocations", ["kind"])
COMMIT_SECONDS = Histogram("hsx_sink_commit_seconds", "Offset commit latency")
LAG = Gauge("hsx_sink_consumer_lag", "Records behind the end of the partition", ["topic", "partition"])
