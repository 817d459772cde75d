"""The router's ``pd_router_build_info`` and ``GET /version`` (its backends' build info, read
from their ``/metrics``; the fakes have none, which /version says)."""

from __future__ import annotations

import httpx
import pytest

from pd_build.info import ABSENT
from pd_build.prometheus import parse
from pd_router.answers import ModelList, VersionReport
from tests.router.conftest import MODEL

pytestmark = pytest.mark.timeout(60)


def test_build_info_and_version(make_rig) -> None:
    rig = make_rig()
    (info,) = parse(httpx.get(rig.url + "/metrics").text)["pd_router_build_info"]
    assert info == rig.state.build and info.component == "router" and info.version != ABSENT
    report = VersionReport.model_validate(httpx.get(rig.url + "/version").json())
    assert report.router == info
    urls = [("prefill", rig.prefills[0].url), ("decode", rig.decodes[0].url)]
    assert [(b.role, b.url) for b in report.backends] == urls
    assert all(b.build == [] and b.error for b in report.backends)
    models = ModelList.model_validate(httpx.get(rig.url + "/v1/models").json())
    assert [(m.id, m.build) for m in models.data] == [(MODEL, [])]
