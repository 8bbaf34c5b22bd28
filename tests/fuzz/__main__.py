"""``python -m tests.fuzz``: the fuzzing campaign (:mod:`tests.fuzz.campaign`)."""

from tests.fuzz.campaign import main

raise SystemExit(main())
