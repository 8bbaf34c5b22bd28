"""The hsx KV connector, loaded by vLLM via ``kv_connector_module_path="hsx.extractor.connector"``.

``HsxConnector`` is imported on first access (vLLM's factory does
``getattr(module, "HsxConnector")``), so that the torch-only modules of this
package (``gather``, ``fp8``) import on machines without vLLM, such as
``bench/gpu_check.py``'s GPU host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.extractor.connector.connector import HsxConnector

__all__ = ["HsxConnector"]


def __getattr__(name: str) -> Any:
    if name == "HsxConnector":
        from hsx.extractor.connector.connector import HsxConnector

        return HsxConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
