"""pd_net.tcp: the dead-peer bound, and the options it puts on a socket (the behaviour,
a pulled cable ending a stream within the bound, is tests/multinode/)."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_net.tcp import DeadPeer, detect_dead_peer


@given(st.floats(min_value=3, max_value=3600))
def test_within_never_exceeds_the_seconds_it_is_given(seconds: float) -> None:
    dead = DeadPeer.within(seconds)
    assert dead.bound_s <= seconds
    assert dead.idle >= 1 and dead.interval >= 1 and dead.count >= 1
    assert dead.bound_s >= seconds * 0.6 - 1  # not needlessly quicker either


@pytest.mark.parametrize(("seconds", "expected"), [(4, DeadPeer(1, 1, 3)), (10, DeadPeer(3, 2, 3))])
def test_within_splits_idle_and_probes(seconds: float, expected: DeadPeer) -> None:
    assert DeadPeer.within(seconds) == expected


def test_the_socket_gets_keepalive_and_the_user_timeout() -> None:
    with socket.socket() as sock:
        detect_dead_peer(sock, DeadPeer(2, 1, 4))
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 4
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
