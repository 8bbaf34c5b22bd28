"""The extractor's Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

PROMPTS = Counter("hsx_extractor_prompts", "Prompts whose records Kafka acknowledged")
TOKENS = Counter("hsx_extractor_tokens", "Prompt tokens whose hidden states were sent")
IN_FLIGHT = Gauge("hsx_extractor_prompts_in_flight", "Prompts consumed but not finished")
RAW_BYTES = Counter("hsx_extractor_block_raw_bytes", "Hidden-state bytes before compression")
COMPRESSED_BYTES = Counter("hsx_extractor_block_compressed_bytes", "Hidden-state bytes after compression")
DEAD_LETTERS = Counter("hsx_extractor_dead_letters", "Prompts sent to the DLQ", ["error_class"])
RETRIES = Counter("hsx_extractor_retries", "Extraction attempts retried")
REBALANCES = Counter("hsx_extractor_rebalances", "Partition assignments and revocations", ["kind"])
COMMIT_SECONDS = Histogram("hsx_extractor_commit_seconds", "Offset commit latency")
LAG = Gauge("hsx_extractor_consumer_lag", "Records behind the end of the partition", ["topic", "partition"])
