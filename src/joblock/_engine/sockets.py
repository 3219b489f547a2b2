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

from .. import errors
from ..settings import Settings

__all__ = ["broken_error", "connect_error", "open_socket", "timeout_error", "tls_context", "unfound_error"]

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
