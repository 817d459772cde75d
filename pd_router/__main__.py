"""``python -m pd_router --prefill URL ... --decode URL ...`` (also the ``pd_router`` script)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from pd_http.logs import configure_logging
from pd_router.server.app import create_app
from pd_router.server.serve import router_server
from pd_router.settings import SettingsError, load_settings


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(f"pd_router: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe otherwise
    app = create_app(settings)
    router_server(app, settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
