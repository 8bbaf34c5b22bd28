"""Runtime helpers shared by the services: settings, the Kafka client layer,
logging and the embedded development broker. Depends only on ``hsx.schemas``."""
