"""Scheduler side of the connector's file contract: whether a request gets a file,
where, and which of its tokens it holds.

A request's own ``kv_transfer_params`` (a client's, through vLLM's OpenAI server)
may carry ``include_output_tokens``, ``hidden_states_path`` (honoured only under
``allow_custom_save_path``, and only inside the storage root) and ``hsx``
(:class:`~hsx.schemas.connector.ServedParams`, or the extractor's own
``RequestParams``, whose ``capture`` the file then follows). Nothing a client
sends can put a file outside ``shared_storage_path``: ids become names through
:func:`hsx.schemas.common.safe_name`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hsx.schemas.common import Capture, format_validation_error, safe_name
from hsx.schemas.connector import HIDDEN_STATES_PATH_KEY, PARAMS_KEY, FilesConfig, ServedParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileChoice:
    """What a newly scheduled request's file will be."""

    path: str | None
    """``None``: no file (the request opted out, or its parameters were refused)."""
    capture: Capture = "all"
    error: str | None = None
    """Why nothing is captured, for the response's ``kv_transfer_params``."""


def choose_file(config: FilesConfig, engine_request_id: str, kv_params: dict[str, Any],
                extractor_params: bool) -> FileChoice:
    """The file of the request ``engine_request_id`` (vLLM's id, which embeds a
    client's ``X-Request-Id``). ``extractor_params``: the ``hsx`` key holds
    the extractor's ``RequestParams`` rather than a client's ``ServedParams``."""
    try:
        capture = _capture(kv_params.get(PARAMS_KEY), extractor_params)
    except ValueError as exc:
        error = f"hidden states not captured: {exc}"
        log.warning("request %s: %s", engine_request_id, error)
        return FileChoice(None, error=error)
    if capture is None:
        return FileChoice(None)
    root = os.path.abspath(config.shared_storage_path)
    path = os.path.join(root, f"{safe_name(engine_request_id)}.safetensors")
    custom = kv_params.get(HIDDEN_STATES_PATH_KEY)
    if custom is not None:
        if not config.allow_custom_save_path:
            log.warning("request %s asked for hidden_states_path %r; ignored (allow_custom_save_path is off)",
                        engine_request_id, str(custom)[:200])
        elif (inside := _inside(root, custom)) is None:
            log.warning("request %s asked for hidden_states_path %r outside %s; ignored",
                        engine_request_id, str(custom)[:200], root)
        else:
            path = inside
    return FileChoice(path, capture)


def _capture(params: Any, extractor_params: bool) -> Capture | None:
    """``all``, ``last``, or ``None`` for no file; ``ValueError`` for parameters
    that cannot be read."""
    if params is None:
        return "all"
    if extractor_params:
        return params.get("capture", "all") if isinstance(params, dict) else "all"
    try:
        served = ServedParams.model_validate(params)
    except ValidationError as exc:
        raise ValueError(f"kv_transfer_params.{PARAMS_KEY}: {format_validation_error(exc)}") from None
    if served.capture is False:
        return None
    return "all" if served.capture is True else served.capture


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
