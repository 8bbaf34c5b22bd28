"""Scheduler side: what each request asked of the connector, read once, in the
step that first schedules it: which rows to capture, the metadata its sample
carries, and where its file goes.

A request's ``kv_transfer_params`` (a client's, through vLLM's OpenAI server)
may carry ``include_output_tokens``, ``hidden_states_path`` (honoured only under
``allow_custom_save_path``, and only inside the storage root) and ``hsx``: a
client's :class:`~hsx.schemas.connector.ServedParams`, or the extractor's own
``RequestParams``, whose ``capture`` the file then follows. A bad ``hsx`` value
means nothing is captured for that request, with the reason in its response;
never an engine failure. Nothing a client sends can put a file outside
``shared_storage_path``: ids become names through
:func:`hsx.schemas.common.safe_name`.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue, ValidationError

from hsx.schemas.common import Capture, format_validation_error, safe_name
from hsx.schemas.drafts import Speculation
from hsx.schemas.connector import HIDDEN_STATES_PATH_KEY, PARAMS_KEY, FilesConfig, RequestParams, ServedParams
from hsx.schemas.manifest import SERVED_REQUEST_ID_CHARS, ServedRef

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asked:
    """What a newly scheduled request asked for."""

    capture: Capture | None
    """``None``: nothing is captured (the request opted out, or was refused)."""
    metadata: dict[str, JsonValue] | None = None
    file: str | None = None
    """Where its file goes, when the connector writes files."""
    error: str | None = None
    """Why nothing is captured, for the response's ``kv_transfer_params``."""


def read_request(engine_request_id: str, kv_params: dict[str, Any], *, files: FilesConfig | None,
                 served: bool) -> Asked:
    """What the request ``engine_request_id`` (vLLM's id, which embeds a client's
    ``X-Request-Id``) asked for. ``served``: its ``hsx`` key is a client's
    :class:`ServedParams`; else the extractor's ``RequestParams``."""
    hsx = kv_params.get(PARAMS_KEY)
    if not served:
        capture = hsx.get("capture", "all") if isinstance(hsx, dict) else "all"
        return Asked(capture, file=_file(files, engine_request_id, kv_params))
    try:
        asked = ServedParams.model_validate(hsx if hsx is not None else {})
    except ValidationError as exc:
        error = f"hidden states not captured: kv_transfer_params.{PARAMS_KEY}: {format_validation_error(exc)}"
        log.warning("request %r: %s", engine_request_id[:200], error)
        return Asked(None, error=error)
    if asked.capture is False:
        return Asked(None)
    capture: Capture = "all" if asked.capture is True else asked.capture
    return Asked(capture, asked.metadata, _file(files, engine_request_id, kv_params))


def served_params(server: str, sample_id: str, engine_request_id: str, asked: Asked,
                  speculation: Speculation | None = None) -> dict[str, Any]:
    """The Kafka side's :class:`RequestParams` for a served request, as the
    dict a :class:`~hsx.extractor.connector.metadata.SendJob` carries."""
    params = RequestParams(
        request_id=sample_id, attempt_id=uuid.uuid4().hex,
        source=ServedRef(server=server, request_id=engine_request_id[:SERVED_REQUEST_ID_CHARS]),
        metadata=asked.metadata, capture=asked.capture or "all", speculation=speculation)
    return params.model_dump(mode="json")


def _file(config: FilesConfig | None, engine_request_id: str, kv_params: dict[str, Any]) -> str | None:
    if config is None:
        return None
    root = os.path.abspath(config.shared_storage_path)
    path = os.path.join(root, f"{safe_name(engine_request_id)}.safetensors")
    custom = kv_params.get(HIDDEN_STATES_PATH_KEY)
    if custom is None:
        return path
    if not config.allow_custom_save_path:
        log.warning("request %r asked for hidden_states_path %r; ignored (allow_custom_save_path is off)",
                    engine_request_id[:200], str(custom)[:200])
        return path
    inside = _inside(root, custom)
    if inside is None:
        log.warning("request %r asked for hidden_states_path %r, not a .safetensors file inside %s; ignored",
                    engine_request_id[:200], str(custom)[:200], root)
        return path
    return inside


def _inside(root: str, custom: Any) -> str | None:
    """``custom`` as an absolute path when it is a ``.safetensors`` file name
    under ``root`` (symbolic links resolved), else ``None``."""
    if not isinstance(custom, str) or "\0" in custom or not custom.endswith(".safetensors") or len(custom) > 4096:
        return None
    resolved = os.path.realpath(os.path.join(root, custom))
    real_root = os.path.realpath(root)
    if os.path.commonpath([resolved, real_root]) != real_root or resolved == real_root:
        return None
    return resolved
