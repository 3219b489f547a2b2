"""The kernel's stop behind ``on_lost="exit"``: SIGKILL at a still-working block's deadline.

``on_lost="exit"`` is carried out by a thread of the process (``joblock.lost``'s
watchman, ``EARLY`` before the deadline), which the OS has to run in time. On a loaded
machine it can sit runnable for tens of milliseconds while the block's thread works on,
and a block inside a C call that holds the GIL keeps it from running at all. So the
process also asks the kernel, by a POSIX timer (``timer_create``), to kill it with
SIGKILL at the earliest deadline of its "exit" blocks that still work: the signal ends
every thread of the process at once, whatever the scheduler does. A block that ended,
or whose thread the watchman's stop parked, no longer counts, so a stop in time still
exits with ``EXIT_STATUS`` after logging why.

Linux only (``timer_create`` through ctypes, as neither twin of the core needs a
compiler for it); elsewhere the watchman's stop is the only one.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
import threading
from typing import Any

__all__ = ["KillTimer", "kill_timer"]

CLOCK_MONOTONIC = 1  # time.monotonic()'s clock on Linux: deadlines need no conversion
SIGEV_SIGNAL = 0
TIMER_ABSTIME = 1


class _Sigevent(ctypes.Structure):
    # struct sigevent: a union sigval, the signal, how to notify, padding to 64 bytes.
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("pad", ctypes.c_int * ((64 - ctypes.sizeof(ctypes.c_void_p) - 8) // 4)),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("interval", _Timespec), ("value", _Timespec)]


def _libc() -> Any:
    """The C library's timer_create and timer_settime, or None where there are none."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own: no search, no subprocess
    if not hasattr(libc, "timer_create"):  # glibc < 2.34 keeps them in librt
        try:
            libc = ctypes.CDLL("librt.so.1", use_errno=True)
        except OSError:
            return None
    return libc


class KillTimer:
    """One kernel timer per process, set to the earliest deadline of the blocks it guards."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}  # by id() of the guard
        self._timer: ctypes.c_void_p | None = None
        self._set_for = 0.0  # the deadline the kernel's timer is set for (0: none)
        self._libc: Any = False  # looked up on first use; None where there is no timer_create

    def set(self, guard: object, deadline: float) -> None:
        """The block of ``guard`` is killed at ``deadline`` (monotonic) unless it ends first."""
        with self._lock:
            if 0.0 < deadline < math.inf:
                self._deadlines[id(guard)] = deadline
            else:
                self._deadlines.pop(id(guard), None)
            self._apply()

    def drop(self, guard: object) -> None:
        """``guard``'s block ended or was stopped: it no longer counts."""
        with self._lock:
            if self._deadlines.pop(id(guard), None) is not None:
                self._apply()

    def _apply(self) -> None:
        when = min(self._deadlines.values(), default=0.0)
        if when == self._set_for or (self._timer is None and not self._create()):
            return
        spec = _Itimerspec()
        if when:  # 0 disarms it
            # A deadline already passed still arms it (the kernel fires at once).
            spec.value.sec = int(when)
            spec.value.nsec = int((when - int(when)) * 1e9)
        if self._libc.timer_settime(self._timer, TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timer_settime failed")
        self._set_for = when

    def _create(self) -> bool:
        if self._libc is False:
            self._libc = _libc()
        if self._libc is None:
            return False
        event = _Sigevent(signo=signal.SIGKILL, notify=SIGEV_SIGNAL)
        timer = ctypes.c_void_p()
        if self._libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            raise OSError(ctypes.get_errno(), "timer_create failed")
        self._timer = timer
        return True

    def forked(self) -> None:
        # A child has no timers of its parent's, nor its parent's blocks.
        self._lock = threading.Lock()
        self._deadlines = {}
        self._timer = None
        self._set_for = 0.0


kill_timer = KillTimer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=kill_timer.forked)
