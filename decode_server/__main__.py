"""``python -m decode_server --engine {reference,tilert} --model DIR ...`` (see --help)."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence

from connector.layout import KVLayout
from decode_server.engine.base import Engine
from decode_server.engine.build import EngineBuild
from decode_server.engine.process import ProcessEngine
from decode_server.server import AppConfig, create_app
from decode_server.settings import DecodeServerSettings, SettingsError, load_settings
from pd_grammar.spec import SchemaLimits
from pd_http.drain import DrainingServer
from pd_http.logs import configure_logging
from pd_http.tracing import Tracing, otlp_tracing
from pd_net.tcp import DeadPeer, dead_peer_protocol


def engine_factory(settings: DecodeServerSettings) -> Callable[[], Engine]:
    """The engine the settings name: built here (on the server's thread), or by a
    :class:`ProcessEngine` in a process of its own (``--engine-process``)."""
    build = EngineBuild(engine=settings.engine, model=settings.model, slots=settings.effective_slots,
                        max_seq_len=settings.max_seq_len, num_mtp=settings.num_mtp, kv_dtype=settings.kv_dtype,
                        attention_kernel=settings.attention_kernel)
    if not settings.engine_process:
        return build
    return functools.partial(ProcessEngine, build, (settings.model, settings.json_whitespace), settings.log_level,
                             settings.log_format)


def receiver_factory(settings: DecodeServerSettings):
    def build(layout: KVLayout, slots: int, max_tokens: int):
        from connector.receiver import KVReceiver, ReceiverSettings

        return KVReceiver(ReceiverSettings(layout=layout, max_tokens=max_tokens, slots=slots, host=settings.kv_host,
                                           port=settings.kv_port, device=settings.kv_device,
                                           secret=settings.kv_secret(), dead_peer_s=settings.dead_peer_timeout))
    return build


def decode_tracing(settings: DecodeServerSettings) -> Tracing | None:
    """The decode server's tracer, exporting to ``--otlp-traces-endpoint``; None (off) without one."""
    if settings.otlp_traces_endpoint is None:
        return None
    from pd_build.versions import dist_version

    return otlp_tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol, "pd-decode-server",
                        {"service.version": dist_version("tilert-pd") or "absent"})


def app_config(settings: DecodeServerSettings) -> AppConfig:
    return AppConfig(model_dir=settings.model, served_model_name=settings.model_name, engine=settings.engine,
                     slots=settings.effective_slots, max_seq_len=settings.max_seq_len, num_mtp=settings.num_mtp,
                     kv_timeout=settings.kv_timeout, write_timeout=settings.write_timeout,
                     max_queue=settings.max_queue,
                     reasoning_parser=settings.reasoning_parser != "none",
                     tool_call_parser=settings.tool_call_parser != "none", api_key=settings.api_key(),
                     schema_limits=SchemaLimits(max_bytes=settings.max_schema_bytes,
                                                max_depth=settings.max_schema_depth),
                     json_whitespace=settings.json_whitespace, freeze_heap=True, keep_kv=settings.keep_kv)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = load_settings(argv)
    except SettingsError as exc:
        print(f"decode_server: {exc}", file=sys.stderr)
        return 2
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    configure_logging(settings.log_level, settings.log_format)
    log = logging.getLogger("decode_server")
    if settings.engine == "tilert" and settings.slots != 1:
        log.warning("--slots %d ignored: the tilert engine decodes one sequence at a time", settings.slots)
    failures: list[BaseException] = []
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(app_config(settings), engine_factory(settings), receiver_factory(settings), on_fatal,
                     decode_tracing(settings))
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            log_config=None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
                            loop="uvloop", http=dead_peer_protocol(HttpToolsProtocol, DeadPeer.within(
                                settings.dead_peer_timeout)), access_log=False, timeout_graceful_shutdown=5)
    state = app.state.decode
    server = DrainingServer(config, lambda: state.drain(settings.drain_timeout))  # SIGTERM: drain, then stop
    server.run()
    if failures:
        log.error("decode server stopped: %s", failures[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
