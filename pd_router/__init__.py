"""pd_router: the OpenAI-compatible prefill/decode router (see docs/router.md)."""

from pd_router.app import RouterApp, create_app
from pd_router.errors import RouterError
from pd_router.settings import RouterSettings, SettingsError, load_settings
from pd_router.wire import ErrorBody, ModelList, ReadinessReport

__all__ = [
    "ErrorBody",
    "ModelList",
    "ReadinessReport",
    "RouterApp",
    "RouterError",
    "RouterSettings",
    "SettingsError",
    "create_app",
    "load_settings",
]
