"""What both drivers need to open sockets to Redis: TLS contexts and the errors they raise.

No message here quotes a password: settings only ever show their address.
"""

from __future__ import annotations

import asyncio
import ssl

from .. import errors
from ..settings import Settings

__all__ = ["broken_error", "connect_error", "timeout_error", "tls_context"]

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
