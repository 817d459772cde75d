"""Discovery's sources on their own (no HTTP): the servers file (add, remove, edit, a bad
write), DNS names re-resolved (a resolver injected), drain on remove and re-add."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd_router.fleet.backends import Backends
from pd_router.fleet.discovery import Discovery, NotAdminOwned
from pd_router.settings import validate_settings
from pd_settings.servers import FileWatch, read_servers_file, resolve_all
from tests.fakes.fake_resolver import FakeResolver


def write(path: Path, text: str) -> None:
    """As a deployment should: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make(tmp_path: Path, text: str | None = None, resolver: FakeResolver | None = None,
         **settings: object) -> Discovery:
    values: dict[str, object] = {"port": 8000, **settings}
    if text is not None:
        path = tmp_path / "servers.yaml"
        write(path, text)
        values["servers_file"] = path
    s = validate_settings(values)
    backends = Backends.from_urls(s.prefill, s.decode, s.decode_slots, s.require_handshake)
    return Discovery(s, backends, resolver=resolver or FakeResolver())


def urls(d: Discovery, role: str) -> dict[str, bool]:
    """url -> draining, of the router's list for ``role``."""
    listed = d.backends.prefill if role == "prefill" else d.backends.decode
    return {b.url: b.draining for b in listed}


async def test_servers_file_add_edit_remove(tmp_path: Path) -> None:
    d = make(tmp_path, "prefill: [http://p1:8100]\ndecode:\n  - {url: http://d1:8200, kv_endpoint: d1:8300}\n")
    added = []
    d.on_added = added.append
    await d.refresh()
    assert urls(d, "prefill") == {"http://p1:8100": False} and urls(d, "decode") == {"http://d1:8200": False}
    assert [b.url for b in added] == ["http://p1:8100", "http://d1:8200"]

    write(d._file.path, '{"prefill": ["http://p1:8100"], "decode": ["http://d1:8200", "http://d2:8200/"]}')  # JSON
    await d.refresh()
    assert urls(d, "decode") == {"http://d1:8200": False, "http://d2:8200": False}

    # d1 has a slot held: removed, it drains (no new requests) until the slot comes back
    d1 = d.backends.find("decode", "http://d1:8200")
    d1.in_use = 1
    write(d._file.path, "prefill: [http://p1:8100]\ndecode: [http://d2:8200]\n")
    await d.refresh()
    assert urls(d, "decode") == {"http://d1:8200": True, "http://d2:8200": False}
    d1.healthy = d1.compatible = True
    d1.models = frozenset({"m"})
    assert not d1.accepting and d.backends.pick_decode("m") is None  # d2 not probed: nothing to pick
    d1.in_use = 0
    await d.refresh()
    assert urls(d, "decode") == {"http://d2:8200": False}

    # listed again: it comes back
    write(d._file.path, "prefill: [http://p1:8100]\ndecode: [http://d2:8200, http://d1:8200]\n")
    await d.refresh()
    assert urls(d, "decode") == {"http://d2:8200": False, "http://d1:8200": False}


async def test_a_drained_server_listed_again_before_it_is_dropped_is_taken_back(tmp_path: Path) -> None:
    d = make(tmp_path, "decode: [http://d1:8200]\nprefill: [http://p:1]\n")
    await d.refresh()
    d.backends.decode[0].in_use = 1
    write(d._file.path, "decode: []\nprefill: [http://p:1]\n")
    await d.refresh()
    assert urls(d, "decode") == {"http://d1:8200": True}
    write(d._file.path, "decode: [http://d1:8200]\nprefill: [http://p:1]\n")
    await d.refresh()
    assert urls(d, "decode") == {"http://d1:8200": False}


@pytest.mark.parametrize("bad", ["", "prefill: [not-a-url]\n", "prefill: [http://p:1\n", "- a list\n",
                                 "prefill: []\ndecode: []\nextra: 1\n"])
async def test_a_bad_servers_file_keeps_the_last_good_list(tmp_path: Path, bad: str) -> None:
    d = make(tmp_path, "prefill: [http://p:1]\ndecode: [http://d:2]\n")
    await d.refresh()
    write(d._file.path, bad)
    await d.refresh()
    assert urls(d, "prefill") == {"http://p:1": False} and urls(d, "decode") == {"http://d:2": False}
    assert d._file.error
    write(d._file.path, "prefill: [http://p:1]\ndecode: [http://d:3]\n")  # fixed: read again
    await d.refresh()
    assert urls(d, "decode") == {"http://d:3": False}  # d:2 had nothing in flight: dropped at once
    assert d._file.error is None


def test_file_watch_reads_only_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    write(path, "prefill: [http://p:1]\n")
    watch = FileWatch(path)
    assert watch.poll() and watch.current.prefill == ("http://p:1",)
    assert not watch.poll()  # unchanged
    write(path, "prefill: [http://p:1]\ndecode: [{url: 'http://d:2', kv_endpoint: 'd:3'}]\n")
    assert watch.poll() and watch.current.kv_endpoints() == ("d:3",)
    path.unlink()
    assert not watch.poll() and "cannot read" in watch.error and watch.current.kv_endpoints() == ("d:3",)


def test_servers_file_errors_name_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    write(path, "decode:\n  - {url: 'http://d:2', kv_endpoint: 'no-port'}\n")
    with pytest.raises(ValueError, match=r"decode\.0\.kv_endpoint.*NAME:PORT"):
        read_servers_file(path)
    write(path, "decode: [ftp://d:2]\n")
    with pytest.raises(ValueError, match=r"decode\.0\.url.*not an http"):
        read_servers_file(path)


async def test_dns_names_are_re_resolved_and_a_failed_lookup_keeps_the_last_answer(tmp_path: Path) -> None:
    resolver = FakeResolver({"decode.ns.svc": ["10.0.0.2", "10.0.0.1"], "prefill.ns.svc": ["10.0.1.1"]})
    d = make(tmp_path, resolver=resolver, decode_dns=["http://decode.ns.svc:8200"],
             prefill_dns="http://prefill.ns.svc:8100")
    await d.refresh()
    assert urls(d, "decode") == {"http://10.0.0.1:8200": False, "http://10.0.0.2:8200": False}
    assert urls(d, "prefill") == {"http://10.0.1.1:8100": False}
    assert d.sources_of("decode", "http://10.0.0.1:8200") == ["dns"]

    resolver.names["decode.ns.svc"] = ["10.0.0.2", "10.0.0.3"]  # a pod replaced
    await d.refresh()
    assert urls(d, "decode") == {"http://10.0.0.2:8200": False, "http://10.0.0.3:8200": False}

    resolver.names["decode.ns.svc"] = OSError("temporary failure in name resolution")
    await d.refresh()
    assert urls(d, "decode") == {"http://10.0.0.2:8200": False, "http://10.0.0.3:8200": False}
    assert resolver.lookups.count("decode.ns.svc") == 3

    resolver.names["decode.ns.svc"] = ["fd00::7"]
    await d.refresh()
    assert urls(d, "decode") == {"http://[fd00::7]:8200": False}


def test_resolve_all_formats_addresses() -> None:
    resolver = FakeResolver({"n": ["10.0.0.1", "::1", "10.0.0.1"]})
    assert resolve_all("n:8300", resolver) == ["10.0.0.1:8300", "[::1]:8300"]
    with pytest.raises(ValueError, match="NAME:PORT"):
        resolve_all("n", resolver)


async def test_admin_source_adds_and_removes_only_its_own(tmp_path: Path) -> None:
    d = make(tmp_path, "prefill: [http://p:1]\ndecode: [http://d:2]\n", prefill=["http://static:1"])
    await d.refresh()
    assert d.add_admin("decode", "http://a:2") and not d.add_admin("decode", "http://a:2")
    assert "http://a:2" in urls(d, "decode")
    with pytest.raises(NotAdminOwned) as exc:
        d.remove_admin("decode", "http://d:2")
    assert exc.value.sources == ["file"]
    with pytest.raises(NotAdminOwned):
        d.remove_admin("prefill", "http://static:1")
    assert not d.remove_admin("decode", "http://nowhere:2")
    assert d.remove_admin("decode", "http://a:2")
    assert "http://a:2" not in urls(d, "decode")  # nothing in flight: dropped at once
    assert [(e.url, e.sources) for e in d.listing().backends] == [
        ("http://static:1", ["static"]), ("http://p:1", ["file"]), ("http://d:2", ["file"])]


def test_settings_need_a_source_for_each_role(tmp_path: Path) -> None:
    from pd_router.settings import SettingsError

    with pytest.raises(SettingsError, match="no decode server"):
        validate_settings({"prefill": ["http://p:1"], "host": "0.0.0.0"})
    with pytest.raises(SettingsError, match="NAME:PORT"):
        validate_settings({"prefill": ["http://p:1"], "decode_dns": ["http://d"]})
    with pytest.raises(SettingsError, match="servers_file.*cannot read"):
        validate_settings({"servers_file": str(tmp_path / "missing.yaml")})
    # loopback bind: the admin API may add them later; a key does the same off loopback
    assert validate_settings({}).admin_enabled()
    assert validate_settings({"host": "0.0.0.0", "api_key": "k"}).admin_enabled()
