"""pd_router: the OpenAI-compatible prefill/decode router (docs/router.md, docs/architecture.md).

Reading order: :mod:`pd_router.request` (a request's stages, from
:mod:`pd_router.request.stages`), then what they stand on: :mod:`pd_router.state` (what one
router app owns), :mod:`pd_router.slots`, :mod:`pd_router.fleet`, :mod:`pd_router.upstream`,
:mod:`pd_router.errors`; the client APIs' bodies in :mod:`pd_router.apis`; the app around it all
in :mod:`pd_router.server`; :mod:`pd_router.settings` and :mod:`pd_router.metrics`.

The public names below are imported on first use (PEP 562), so importing a submodule such
as :mod:`pd_router.answers` does not load the app, FastAPI or the HTTP clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pd_router.answers import ModelList, ReadinessReport
    from pd_router.errors import RouterError
    from pd_router.server.app import RouterApp, create_app
    from pd_router.settings import RouterSettings, load_settings
    from pd_wire.errors import ErrorBody

_EXPORTS = {
    "ErrorBody": "pd_wire.errors",
    "ModelList": "pd_router.answers",
    "ReadinessReport": "pd_router.answers",
    "RouterApp": "pd_router.server.app",
    "RouterError": "pd_router.errors",
    "RouterSettings": "pd_router.settings",
    "create_app": "pd_router.server.app",
    "load_settings": "pd_router.settings",
}
__all__ = [
    "ErrorBody",
    "ModelList",
    "ReadinessReport",
    "RouterApp",
    "RouterError",
    "RouterSettings",
    "create_app",
    "load_settings",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pd_router' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
