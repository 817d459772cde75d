"""The places of requests in the decode queues (pd_router/slots/fair.py) and the keys file that names
tenants (pd_router/tenants.py), as units."""

from __future__ import annotations

import hashlib
import io
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_router.errors import InvalidRequest, Unauthorized
from pd_router.slots.fair import AGED, MAX_TENANTS, FairShares, Place
from pd_router.tenants import DEFAULT_TENANT, OTHER_TENANT, Tenants, key_hash, main, read_keys


def _grant_all(shares: FairShares, places: list[tuple[str, Place]]) -> list[str]:
    """Serve ``places`` one at a time, first place first, each grant moving the clock."""
    order = []
    for tenant, place in sorted(places, key=lambda tp: tp[1]):
        shares.granted(place)
        order.append(tenant)
    return order


def test_two_backlogged_tenants_alternate_and_a_weight_is_a_share() -> None:
    shares = FairShares()
    places = [("a", shares.place(0, "a", 1.0, float(i))) for i in range(10)]
    places += [("b", shares.place(0, "b", 1.0, 100.0 + i)) for i in range(3)]
    order = _grant_all(shares, places)
    assert order[:6] == ["a", "b", "a", "b", "a", "b"], order
    heavy = FairShares()
    places = [("w2", heavy.place(0, "w2", 2.0, float(i))) for i in range(12)]
    places += [("w1", heavy.place(0, "w1", 1.0, float(i))) for i in range(12)]
    first = _grant_all(heavy, places)[:12]
    assert first.count("w2") == 8 and first.count("w1") == 4, first


def test_a_newcomer_starts_at_the_clock_and_a_pause_earns_no_credit() -> None:
    shares = FairShares()
    backlog = [shares.place(0, "a", 1.0, float(i)) for i in range(20)]
    for place in backlog[:5]:  # five served
        shares.granted(place)
    clock = shares.clock(0)
    b = shares.place(0, "b", 1.0, 50.0)
    assert b.share == clock - 0.5  # half a request behind the clock: it goes before the backlog's next
    assert b < backlog[5]
    # b was served long ago; after a pause it starts at the clock again, not at its old tag
    for place in backlog[5:]:
        shares.granted(place)
    again = shares.place(0, "b", 1.0, 60.0)
    assert again.share == shares.clock(0) - 0.5


def test_classes_have_their_own_clocks_and_the_aged_none() -> None:
    shares = FairShares()
    for i in range(5):
        shares.granted(shares.place(0, "a", 1.0, float(i)))
    low = shares.place(10, "b", 1.0, 9.0)
    assert low.share == -0.5 and shares.clock(10) == 0.0
    shares.granted(Place(AGED, 0.0, 1.0))
    shares.observe({10: 7.0, AGED: 99.0})
    assert shares.clock(10) == 7.0 and shares.clock(AGED) == 0.0
    shares.observe({10: 3.0})  # a clock never goes back
    assert shares.clock(10) == 7.0


def test_finish_tags_are_bounded() -> None:
    shares = FairShares()
    for i in range(MAX_TENANTS + 10):
        shares.granted(shares.place(0, f"t{i}", 1.0, float(i)))
    assert len(shares._finish) <= MAX_TENANTS


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from([0.5, 1.0, 2.0])), min_size=2, max_size=40))
def test_a_tenant_is_never_behind_its_fair_share_by_more_than_one_request(arrivals: list) -> None:
    """All queued at once: in every prefix of the grants, a backlogged tenant's count is within
    one request of its weighted share of that prefix (start-time fair queuing's bound)."""
    shares = FairShares()
    weights = {t: w for t, w in arrivals}
    places = [(t, shares.place(0, t, weights[t], float(i))) for i, (t, _) in enumerate(arrivals)]
    order = _grant_all(shares, places)
    queued = {t: sum(1 for u, _ in places if u == t) for t in weights}
    for n in range(1, len(order) + 1):
        prefix = order[:n]
        active = [t for t in weights if queued[t] > prefix.count(t)]  # still backlogged after the prefix
        if len(active) < 2:
            break
        total = sum(weights[t] for t in weights)
        for t in active:
            assert prefix.count(t) >= n * weights[t] / total - 1 - max(weights.values()) / min(weights.values()), (
                t, prefix)


def _keys(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(body)
    return path


def test_the_keys_file_names_tenants_by_their_keys_hash(tmp_path: Path) -> None:
    path = _keys(tmp_path, f'[[key]]\nname = "alice"\nsha256 = "{key_hash("alice-key-0123456789")}"\n'
                           f'weight = 3\nmin_priority = -5\nmax_queued = 4\n'
                           f'[[key]]\nname = "bob"\nsha256 = "{key_hash("bob-key-0123456789")}"\n')
    tenants = Tenants(None, path, None, 0, 10)
    alice = tenants.tenant(b"Bearer alice-key-0123456789")
    assert (alice.name, alice.weight, alice.min_priority, alice.max_queued) == ("alice", 3.0, -5, 4)
    bob = tenants.tenant(b"Bearer bob-key-0123456789", b"carol")  # no --tenant-header: ignored
    assert (bob.name, bob.min_priority, bob.max_queued) == ("bob", 0, 10)
    for bad in (None, b"", b"Bearer nope-0123456789", b"alice-key-0123456789"):
        with pytest.raises(Unauthorized):
            tenants.tenant(bad)
    assert tenants.label("alice") == "alice" and tenants.label("zed") == OTHER_TENANT
    assert set(tenants.labels()) == {DEFAULT_TENANT, OTHER_TENANT, "alice", "bob"}
    gateway = Tenants("gateway-key-0123456789", path, "X-Tenant", 0, None)
    assert gateway.tenant(b"Bearer gateway-key-0123456789").name == DEFAULT_TENANT
    assert gateway.tenant(b"Bearer gateway-key-0123456789", b"alice").weight == 3.0
    assert gateway.tenant(b"Bearer gateway-key-0123456789", b"zed").name == "zed"
    with pytest.raises(InvalidRequest):
        gateway.tenant(b"Bearer gateway-key-0123456789", b"a b")
    open_door = Tenants(None, None, None, 0, None)
    assert not open_door.required and open_door.tenant(None).name == DEFAULT_TENANT


@pytest.mark.parametrize(("body", "says"), [
    ('[[key]]\nname = "a"\nsha256 = "00"\n', "sha256"),
    (f'[[key]]\nname = "a"\nsha256 = "{"0" * 64}"\n[[key]]\nname = "a"\nsha256 = "{"1" * 64}"\n', "same name"),
    (f'[[key]]\nname = "a"\nsha256 = "{"0" * 64}"\n[[key]]\nname = "b"\nsha256 = "{"0" * 64}"\n', "same sha256"),
    (f'[[key]]\nname = "default"\nsha256 = "{"0" * 64}"\n', "not names"),
    (f'[[key]]\nname = "a"\nsha256 = "{"0" * 64}"\nweight = 0\n', "weight"),
    ('[[key]\n', "not valid TOML"),
])
def test_a_bad_keys_file_says_what_is_wrong_and_never_a_hash(tmp_path: Path, body: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as err:
        read_keys(_keys(tmp_path, body))
    assert "0" * 64 not in str(err.value)


def test_the_hash_command_prints_a_keys_file_line(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("my-key-0123456789\n"))
    assert main(["hash"]) == 0
    assert capsys.readouterr().out.strip() == f'sha256 = "{hashlib.sha256(b"my-key-0123456789").hexdigest()}"'
