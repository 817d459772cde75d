"""TileRTConnector: a vLLM KV connector (kv_producer) pushing MLA(+MTP) KV over NIXL.

vLLM loads it with ``kv_connector_module_path: "connector"`` and takes
``TileRTConnector`` by name. The class is imported lazily so that the router and
the decode server can import :mod:`connector.protocol` without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TileRTConnector"]


def __getattr__(name: str) -> Any:
    if name == "TileRTConnector":
        from connector.tilert_connector import TileRTConnector

        return TileRTConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
