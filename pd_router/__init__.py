"""pd_router: the OpenAI-compatible prefill/decode router (see docs/router.md)."""

from pd_router.app import RouterApp, create_app
from pd_router.errors import RouterError
from pd_router.settings import RouterSettings, SettingsError, load_settings

__all__ = ["RouterApp", "RouterError", "RouterSettings", "SettingsError", "create_app", "load_settings"]
