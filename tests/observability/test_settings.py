"""The tracing and log-format options of the router and the decode server: read like every
other option, an invalid endpoint refused at start-up naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_server.__main__ import decode_tracing
from decode_server.settings import load_settings as decode_settings
from pd_router.settings import SettingsError
from pd_router.settings import load_settings as router_settings
from pd_router.state import router_tracing

BACKENDS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


def test_router_options():
    plain = router_settings(BACKENDS, {})
    assert (plain.log_format, plain.otlp_traces_endpoint, plain.otlp_traces_protocol) == ("text", None, "grpc")
    assert router_tracing(plain, "0") is None  # tracing off: no tracer at all
    s = router_settings([*BACKENDS, "--otlp-traces-endpoint", "http://127.0.0.1:4318"],
                        {"PD_ROUTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "PD_ROUTER_LOG_FORMAT": "json"})
    assert (s.log_format, s.otlp_traces_protocol) == ("json", "http/protobuf")
    tracing = router_tracing(s, "1.2.3")
    assert tracing is not None
    try:
        attrs = tracing.provider.resource.attributes
        assert (attrs["service.name"], attrs["service.version"]) == ("pd-router", "1.2.3")
    finally:
        tracing.shutdown()
    with pytest.raises(SettingsError, match=r"^--otlp-traces-endpoint='127.0.0.1:4317': .*http:// or https://"):
        router_settings([*BACKENDS, "--otlp-traces-endpoint", "127.0.0.1:4317"], {})
    with pytest.raises(SettingsError, match="--log-format"):
        router_settings([*BACKENDS, "--log-format", "xml"], {})


def test_decode_server_options(model_dir: Path):
    base = ["--engine", "reference", "--model", str(model_dir)]
    assert decode_tracing(decode_settings(base, {})) is None
    s = decode_settings([*base, "--otlp-traces-endpoint", "https://collector.example:4317", "--log-format", "json"], {})
    tracing = decode_tracing(s)
    assert tracing is not None and s.log_format == "json"
    try:
        assert tracing.provider.resource.attributes["service.name"] == "pd-decode-server"
    finally:
        tracing.shutdown()
    with pytest.raises(SettingsError, match="PD_DECODE_OTLP_TRACES_PROTOCOL"):
        decode_settings(base, {"PD_DECODE_OTLP_TRACES_PROTOCOL": "thrift"})
