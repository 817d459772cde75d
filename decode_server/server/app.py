"""The decode server's ASGI app: start-up and shutdown around its state (:mod:`decode_server.server.state`).

``create_app`` takes factories, so the same app runs the real engine and receiver
(``python -m decode_server``) or fakes (tests). Loading the engine can take minutes
(TileRT): it runs in a thread after the server started listening, so ``/health``
answers at once and ``/ready`` turns 200 when the engine is loaded and the KV
receiver listens. A load failure is logged and reported through ``on_fatal``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from connector.receiver_state import ReceiverStats
from decode_server.server.metrics import DecodeMetrics
from decode_server.server.slots import SlotTable
from decode_server.server.state import AppConfig, DecodeState, EngineFactory, ReceiverFactory, build_info
from decode_server.server.text import GenerationDefaults, TextTokenizer
from pd_http.tracing import Tracing

log = logging.getLogger(__name__)


def receiver_stats(state: DecodeState) -> ReceiverStats | None:
    """The KV receiver's counters once it runs (``decode_server_kv_*``)."""
    return state.receiver.stats if state.receiver is not None else None


def create_app(config: AppConfig, engine_factory: EngineFactory, receiver_factory: ReceiverFactory,
               on_fatal: Callable[[BaseException], None] | None = None, tracing: Tracing | None = None) -> FastAPI:
    """``tracing``: this app's tracer (:func:`pd_http.tracing.otlp_tracing`), shut down with the app;
    None: tracing off."""
    from decode_server.server.auth import RequireApiKey
    from decode_server.server.routes import router

    tokenizer = TextTokenizer.from_model_dir(config.model_dir)
    state: DecodeState
    slots = SlotTable(config.slots, config.max_queue)
    state = DecodeState(config=config, tokenizer=tokenizer,
                        defaults=GenerationDefaults.from_model_dir(config.model_dir, tokenizer),
                        slots=slots, metrics=DecodeMetrics(lambda: slots.busy, config.slots, build_info(config),
                                                           config.served_model_name, lambda: receiver_stats(state)),
                        tracing=tracing)
    state.metrics.watch_slots(slots)

    async def load() -> None:
        try:
            await state.load(engine_factory, receiver_factory)
        except Exception as exc:  # reported through /ready and on_fatal
            state.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("decode server failed to start")
            if on_fatal is not None:
                on_fatal(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load())
        try:
            yield
        finally:
            loader.cancel()
            await asyncio.gather(loader, return_exceptions=True)
            await state.shutdown()

    app = FastAPI(title="decode_server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.decode = state
    app.include_router(router)
    if config.api_key is not None:
        app.add_middleware(RequireApiKey, api_key=config.api_key)
    return app
