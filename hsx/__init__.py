"""The ``hsx`` command and the end-to-end demo; everything else lives in the
service packages (producer, extractor, sink), the contracts in ``schemas`` and
shared helpers in ``runtime``."""
