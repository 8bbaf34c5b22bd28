"""hsx on one machine: what ``hsx run``, ``hsx demo`` and ``hsx broker`` run, and
what the benchmarks (``bench/``) and the tests build on.

- :mod:`hsx.local.broker`: the embedded Kafka-protocol broker (tansu, from PyPI).
- :mod:`hsx.local.spawn`: hsx services as child processes; :mod:`hsx.local.commands`
  their command lines; :mod:`hsx.local.scrape` their operations endpoint.
- :mod:`hsx.local.topics`: a run-scoped set of fresh topics.
- :mod:`hsx.local.s3server`, :mod:`hsx.local.s3service`: a local S3 server (SeaweedFS)
  for ``hsx demo --s3``, the benchmarks and the tests; :mod:`hsx.local.server_process`
  what it and the broker share (a child process, stopped in order).
- :mod:`hsx.local.datasets`, :mod:`hsx.local.training_data`: datasets built without an
  engine, for the benchmarks and the tests.

A production deployment (``hsx extract`` and ``hsx sink`` against a Kafka cluster)
uses none of it. Nothing here imports ``tests`` or ``bench``; they import from here.
"""
