"""The dataset library, below the sink (which writes through it) and the trainer
(which reads through it): the layout (shards, index, key files: :mod:`.shards`),
storage on disk or S3 (:mod:`.storage`), the dataset codecs and the one decoding
step (:mod:`.encoding`), the readers :func:`~hsx.dataset.reader.open_dataset` and
:func:`~hsx.dataset.reader.follow`, and ``hsx inspect`` (:mod:`.inspect`).

It imports neither the sink service nor the trainer; ``follow`` reads ready
events through the runtime's Kafka layer.
"""
