"""What both drivers need to open sockets to Redis: TLS contexts, blocking sockets (the
threaded driver's and the wake-up listeners'), and the errors they raise.

No message here quotes a password: settings only ever show their address.
"""

from __future__ import annotations

import asyncio
import math
import socket
import ssl
import struct
import sys
import time
from collections.abc import Hashable

from .. import errors
from ..settings import Settings
from .ops import Loading

__all__ = [
    "Reloads",
    "broken_error",
    "connect_error",
    "open_socket",
    "timeout_error",
    "tls_context",
    "unfound_error",
]

_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

# Bytes asked of the kernel per read: a window of 1,000 replies is about 5 KB, a burst
# of many callers' replies more. Kept under malloc's mmap threshold (128 KiB): a read
# buffer above it costs an mmap, an mremap and a munmap on every read.
RECV_SIZE = 65536


def tls_context(s: Settings) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=s.ssl_ca_certs)
    ctx.check_hostname = s.ssl_check_hostname and s.ssl_cert_reqs != "none"
    ctx.verify_mode = _CERT_REQS[s.ssl_cert_reqs]
    if s.ssl_certfile:
        ctx.load_cert_chain(s.ssl_certfile, s.ssl_keyfile)
    return ctx


def connect_error(s: Settings, e: BaseException) -> errors.ConnectionError:
    """The error for a failed connect (timeout, TLS, refused)."""
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return errors.TimeoutError(f"could not connect to Redis at {s.address} within {s.connect_timeout} s")
    if isinstance(e, ssl.SSLError):
        return errors.ConnectionError(f"TLS handshake with Redis at {s.address} failed: {e.reason}")
    strerror = getattr(e, "strerror", None)
    return errors.ConnectionError(f"could not connect to Redis at {s.address}: {strerror or e}")


def timeout_error(s: Settings) -> errors.TimeoutError:
    return errors.TimeoutError(f"Redis at {s.address} did not answer within {s.socket_timeout} s")


def broken_error(s: Settings, e: BaseException | None) -> errors.ConnectionError:
    if e is None:
        return errors.ConnectionError(f"Redis at {s.address} closed the connection")
    strerror = getattr(e, "strerror", None)
    return errors.ConnectionError(f"connection to Redis at {s.address} broke: {strerror or e}")


def reconnect_pauses(s: Settings) -> list[float]:
    """The pauses between connect attempts: ``retries`` of them, growing, at most 1 s."""
    return [min(0.05 * 2**attempt, 1.0) for attempt in range(s.retries)]


# The pauses before connecting again to a server that answered LOADING: doubling from
# the first to the longest, and all of them within ``socket_timeout`` of its first LOADING.
LOADING_PAUSE = 0.05
LOADING_MAX_PAUSE = 1.0


class Reloads:
    """The servers a driver found reading their dataset after a restart, and when to
    connect to each again: both drivers' backoff for LOADING.

    A call whose server answers LOADING waits for it, as for a slow reply, for up to
    ``socket_timeout`` seconds from the first LOADING, asking again after pauses that
    grow from 50 ms to 1 s; past that the error stands, and the calls fail once their
    ``retries`` are spent. The time counts per server, not per call: every caller of a
    driver sees the same restart.
    """

    __slots__ = ("_servers",)

    def __init__(self) -> None:
        # target -> [first LOADING, when to connect again, pauses so far]
        self._servers: dict[Hashable, list[float]] = {}

    def loading(self, target: Hashable, s: Settings, error: Loading) -> None:
        """``target``'s connection ended on ``error``: makes it patient while time is left."""
        now = time.monotonic()
        found = self._servers.get(target)
        # A LOADING later than the connection made after the last pause could bring is
        # another restart, or a client that was idle meanwhile: its wait starts anew.
        if found is None or now > found[1] + s.connect_timeout + s.socket_timeout:
            found = self._servers[target] = [now, now, 0]
        left = found[0] + s.socket_timeout - now
        if left <= 0:
            found[1] = now  # no more pauses: the calls spend their retries, then raise
            return
        pause = min(LOADING_PAUSE * 2 ** found[2], LOADING_MAX_PAUSE, left)
        found[1] = now + pause
        found[2] += 1
        error.patient = True

    def pause(self, target: Hashable) -> float:
        """Seconds to wait before connecting to ``target`` (0: connect now)."""
        found = self._servers.get(target)
        return 0.0 if found is None else max(0.0, found[1] - time.monotonic())


# Ten milliseconds: the longest scheduler tick (HZ=100) a kernel socket timeout counts in.
KERNEL_TICK_MICROS = 10_000


def _set_timeouts(sock: socket.socket, seconds: float) -> bool:
    """Kernel-side send and receive timeouts on a blocking socket, where the platform has them.

    Python's own socket timeout polls before every send and recv; the kernel's costs
    nothing until it fires (then recv raises BlockingIOError).
    """
    if sys.platform not in ("linux", "darwin"):
        return False
    # The kernel counts these in scheduler ticks (1-10 ms) and can fire up to a tick
    # early; one tick more keeps ``socket_timeout`` the least time a caller waits.
    micros = math.ceil(seconds * 1e6) + KERNEL_TICK_MICROS
    tv = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    except OSError:
        return False
    return True


def open_socket(s: Settings) -> socket.socket:
    """A connected socket (TLS wrapped), after up to ``s.retries`` retries of a refused connect."""
    pauses = iter(reconnect_pauses(s))
    while True:
        try:
            return _open(s)
        except errors.ConnectionError:
            pause = next(pauses, None)
            if pause is None:
                raise
            time.sleep(pause)


def unfound_error(s: Settings) -> errors.ConnectionError:
    """For a client given a redis+sentinel:// URL that does not ask the sentinels."""
    return errors.ConnectionError(
        f"{s.address} is found by asking them, which this client does not do"
        " (joblock.Locks and joblock.aio.AsyncLocks do)"
    )


def _open(s: Settings) -> socket.socket:
    if not s.found:
        raise unfound_error(s)
    try:
        if s.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(s.connect_timeout)
            try:
                sock.connect(s.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((s.host, s.port), timeout=s.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if s.keepalive:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if s.tls:
            try:
                sock = tls_context(s).wrap_socket(sock, server_hostname=s.host)
            except BaseException:
                sock.close()
                raise
    except OSError as e:  # TimeoutError and ssl.SSLError too
        raise connect_error(s, e) from None
    if _set_timeouts(sock, s.socket_timeout):
        sock.settimeout(None)
    else:
        sock.settimeout(s.socket_timeout)
    return sock
