"""``decode_server_build_info``: what the decode server runs, with the receiver's KV layout
fingerprint (the one its capabilities advertise) once the engine is loaded."""

from __future__ import annotations

import hashlib

import httpx

from pd_build.prometheus import parse
from pd_wire.decode import CAPABILITIES_PATH, DecodeCapabilities


def test_build_info_on_metrics(make_server, model_dir) -> None:
    srv = make_server()
    (info,) = parse(httpx.get(srv.url + "/metrics").text)["decode_server_build_info"]
    caps = DecodeCapabilities.model_validate(httpx.get(srv.url + CAPABILITIES_PATH).json())
    assert (info.component, info.model) == ("decode", "fake-model")
    assert info.kv_layout == caps.layout_fingerprint
    assert info.model_config_sha256 == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
