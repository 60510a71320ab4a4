"""The operator page's login throttle (docs/design/operations.md OP2).

A client — one address, an IPv6 one by its /64 (one host may hold all of it), and every
loopback address together (they are all this host) — that presented ``LOGIN_FAILURES`` wrong
tokens in the last ``LOGIN_WINDOW`` seconds is throttled until the oldest of them leaves the
window. At most ``MAX_CLIENTS`` clients are remembered; the one that
failed least recently goes first, so guesses from many addresses cannot grow the table. Times
are the caller's (the Trio clock), so tests drive it on virtual time.
"""

from __future__ import annotations

import collections
import ipaddress
from typing import Final

__all__ = [
    "LOGIN_FAILURES",
    "LOGIN_WINDOW",
    "LOOPBACK",
    "MAX_CLIENTS",
    "LoginThrottle",
    "client_of",
]

LOGIN_FAILURES: Final = 5
LOGIN_WINDOW: Final = 60.0
"""At most ``LOGIN_FAILURES`` refused tokens per ``LOGIN_WINDOW`` seconds from one client."""
LOOPBACK: Final = "loopback"
"""The one client every loopback address is (:func:`client_of`)."""
MAX_CLIENTS: Final = 1024
"""Clients whose refused tokens are remembered (the one that failed least recently goes)."""


class LoginThrottle:
    """Refused tokens per client, in their window."""

    def __init__(self) -> None:
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )
        """Each client's refused tokens in the window, the one that failed last at the end."""

    def throttled(self, client: str, now: float) -> bool:
        """Whether ``client`` has ``LOGIN_FAILURES`` refused tokens in the window ending at
        ``now``."""
        failures = self._failures.get(client)
        if failures is None:
            return False
        while failures and failures[0] <= now - LOGIN_WINDOW:
            failures.popleft()
        if not failures:
            del self._failures[client]
            return False
        return len(failures) >= LOGIN_FAILURES

    def failed(self, client: str, now: float) -> None:
        """Count a refused token of ``client`` at ``now``."""
        failures = self._failures.pop(client, None)
        if failures is None:
            failures = collections.deque(maxlen=LOGIN_FAILURES)
        failures.append(now)
        self._failures[client] = failures  # the one that failed last at the end
        while len(self._failures) > MAX_CLIENTS:  # the one that failed least recently goes
            self._failures.popitem(last=False)


def client_of(peer: str) -> str:
    """Who a refused token counts against: the client's address ``peer``, an IPv6 one by its
    /64, an IPv4-mapped one as the IPv4 address, and every loopback address (``127.0.0.0/8``,
    ``::1``) as the one client ``LOOPBACK`` — they are all this host, and a guesser on it
    could otherwise take 16 million addresses, five tries each, and push the clients it
    guessed from out of the table; anything else as it is."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return LOOPBACK
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
