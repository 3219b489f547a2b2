"""joblock: Redis locks for background jobs.

One job of a kind at a time, one job per argument set, and deduplication at dispatch
for schedulers that push thousands of jobs per second. The hot path is compiled;
a pure-Python twin with the same API runs where the compiled core is missing
(``joblock.implementation`` says which is active).
"""

from ._core import implementation
from .cluster import ClusterLocks
from .errors import (
    AuthenticationError,
    BatchConnectionError,
    BatchError,
    ConnectionError,
    JoblockError,
    LimitMismatchError,
    LockLost,
    LockNotAcquired,
    NoPermissionError,
    OutOfMemoryError,
    ProtocolError,
    ReadOnlyError,
    ReplicationError,
    ReplyError,
    TimeoutError,
    WrongTypeError,
)
from .jobs import current_lease
from .locks import Lease, Locks
from .metrics import instrument, uninstrument
from .redlock import Redlock, RedlockLease
from .settings import Settings

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BatchConnectionError",
    "BatchError",
    "ClusterLocks",
    "ConnectionError",
    "JoblockError",
    "Lease",
    "LimitMismatchError",
    "LockLost",
    "LockNotAcquired",
    "Locks",
    "NoPermissionError",
    "OutOfMemoryError",
    "ProtocolError",
    "ReadOnlyError",
    "Redlock",
    "RedlockLease",
    "ReplicationError",
    "ReplyError",
    "Settings",
    "TimeoutError",
    "WrongTypeError",
    "current_lease",
    "implementation",
    "instrument",
    "uninstrument",
]
