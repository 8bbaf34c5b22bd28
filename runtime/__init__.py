"""Runtime helpers the services use in production: settings, the Kafka client layer,
errors and exit codes, logging, health and metrics. Depends only on ``hsx.schemas``."""
