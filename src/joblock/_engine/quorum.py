"""Redlock's fan-out without I/O: the same window to every server, each one's answer.

The quorum itself (who granted, validity, what to give back) is decided by the
Redlock clients' plans from what this operation collects; here only the sending.
A server that cannot be reached, or whose connection broke past its retries,
answers with its error instead of replies: to Redlock, a "no".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import errors
from .ops import Operation
from .requests import Request, Window

__all__ = ["OnEvery"]


class OnEvery(Operation):
    """One window per server (targets 0..n-1); the result: per server, its replies or its error."""

    __slots__ = ("answers", "left", "tries", "windows")

    def __init__(self, windows: Sequence[Window], retries: int) -> None:
        super().__init__(retries)
        self.windows = windows
        self.answers: list[Any] = [None] * len(windows)
        self.tries = [0] * len(windows)
        self.left = len(windows)

    def start(self) -> None:
        if not self.windows:
            self.finish(self.answers)
        for server, window in enumerate(self.windows):
            if not window.keys:  # nothing to ask this server
                self._settle(server, [])
                continue
            window.op = self
            self.engine.send(window)

    def _settle(self, server: int, answer: Any) -> None:
        self.answers[server] = answer
        self.left -= 1
        if not self.left:
            self.finish(self.answers)

    def answer(self, request: Request, replies: list[Any]) -> None:
        self._settle(request.target, replies)

    def lost(self, requests: list[tuple[Request, bool]], error: errors.JoblockError, retryable: bool) -> None:
        for request, sent in requests:
            server = request.target
            if (
                retryable
                and isinstance(error, errors.ConnectionError)
                and not isinstance(error, errors.AuthenticationError)
                and self.tries[server] < self.retries
            ):
                self.tries[server] += 1
                self.engine.send(request.retried() if sent else request)
            else:
                self._settle(server, error)
