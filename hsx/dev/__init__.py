"""Development tooling that ``hsx demo``, the benchmarks (``bench/``) and the
tests share: hsx services as child processes (:mod:`hsx.dev.spawn`), fresh topic
sets (:mod:`hsx.dev.topics`), service command lines (:mod:`hsx.dev.commands`),
reading a service's operations endpoint (:mod:`hsx.dev.scrape`), a local S3
server (:mod:`hsx.dev.s3server`, :mod:`hsx.dev.s3service`) and datasets built without an engine
(:mod:`hsx.dev.datasets`, :mod:`hsx.dev.training_data`).

Production deployments need none of it. Nothing here imports ``tests`` or
``bench``; they import from here.
"""
