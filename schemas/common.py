"""Building blocks shared by every wire contract: the strict base model, the
request id type, and the one formatter for validation errors."""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _check_request_id(value: str) -> str:
    # The id names files and tensors downstream, so anything that could act as a
    # path component other than a plain name is refused here, once, for everyone.
    if not _REQUEST_ID_RE.fullmatch(value):
        raise ValueError("request_id must be 1-128 characters of [A-Za-z0-9._:-]")
    if value in {".", ".."} or ".." in value:
        raise ValueError("request_id must not be '.' or contain '..'")
    return value


RequestId = Annotated[str, AfterValidator(_check_request_id)]
"""1-128 chars of ``[A-Za-z0-9._:-]``, never ``.``/``..``: safe as a file or tensor name."""

SOURCE_ID_CHARS = 1024

SourceRequestId = Annotated[str, Field(min_length=1, max_length=SOURCE_ID_CHARS)]
"""Any id a dataset gave its row (``HumanEval/0``): the sample's own
``request_id`` is its :func:`sample_id`."""


def sample_id(identifier: str) -> str:
    """The sample id of a prompt whose id is ``identifier``: the id itself when it
    is a :data:`RequestId`, else its :func:`safe_name`. The same every time, and
    its own key (``sample_id(sample_id(x)) == sample_id(x)``), so a dataset
    can be asked for a sample by the id its prompt had."""
    try:
        return _check_request_id(identifier)
    except ValueError:
        return safe_name(identifier)

_SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_UNSAFE_CHARS_RE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(identifier: str) -> str:
    """A file name for any id a client or a dataset chose (``HumanEval/0``, an
    ``X-Request-Id`` with ``/``, ``..``, NUL or 10 KB): the id itself when it is
    1-128 characters of ``[A-Za-z0-9._-]`` not starting with ``.``, else its safe
    characters (at most 64) and a hash of the whole id, so two ids never share
    a name and none leaves the directory it is joined to."""
    if _SAFE_NAME_RE.fullmatch(identifier) and ".." not in identifier:
        return identifier
    digest = hashlib.blake2b(identifier.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()
    readable = _UNSAFE_CHARS_RE.sub("_", identifier).replace("..", "_").strip("._")[:64]
    return f"{readable}-{digest}" if readable else digest


NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveInt = Annotated[int, Field(gt=0)]
Capture = Literal["all", "last"]
"""Which tokens' hidden states a sample stores: every input token, or the final one."""
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class StrictModel(BaseModel):
    """Base of every event: unknown fields and type coercion are errors, instances
    are immutable, so what was validated is what travels."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def format_validation_error(exc: ValidationError, limit: int = 10) -> str:
    """One line naming each failing field and the rule it broke, e.g.
    ``token_ids.3: Input should be greater than or equal to 0 [greater_than_equal]``."""
    parts = []
    for err in exc.errors(include_url=False)[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(event)"
        parts.append(f"{loc}: {err['msg']} [{err['type']}]")
    extra = exc.error_count() - limit
    if extra > 0:
        parts.append(f"... and {extra} more")
    return "; ".join(parts)
