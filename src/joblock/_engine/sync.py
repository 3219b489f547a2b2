"""The threaded driver: operations over blocking sockets, one connection per server,
shared by every thread of the process.

No thread of its own: the callers do the I/O. A caller writes its request itself
(whoever finds the connection's writer role free writes everything queued, so
requests that arrive together leave in one write), then waits. One waiting caller
at a time is the *leader*: it reads the replies of everyone's requests, and the
callers whose operations are done are woken one at a time, each by the one before
as it runs (see ``wake``). When the leader's own is done it hands the role to
another waiting caller, its *heir*, and the callers that come before the heir runs
(those the same read woke, calling again) queue their requests for it to write in
one write. A lone caller is writer and leader at once: write, read, return, with no
hand-off and no extra system call.

With several servers (a Redis Cluster, Redlock), TLS, or timers, the leader waits
in ``select`` over the connections and a wake-up pipe instead of in ``recv``.
OpenSSL sockets are not safe for a read and a write from two threads at once, so
only the leader writes to a TLS connection.

A forked child starts with a state of its own: it never touches its parent's
sockets, locks or leader (Celery and RQ workers fork).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator
from threading import get_ident
from time import monotonic
from types import ModuleType
from typing import Any, TypeVar, cast

from .. import errors
from ..settings import Settings
from .listeners import ThreadListener
from .ops import Call, Engine, Interrupted, Loading, Operation, interruption
from .requests import Request, Resolver, Target
from .sockets import RECV_SIZE, Reloads, broken_error, open_socket, timeout_error
from .waits import Listen, Park, Wakeups
from .wire import Wire

__all__ = ["Driver"]

T = TypeVar("T")

# A connection idle for longer than this is checked before it is used again: one the
# server closed meanwhile (its `timeout`, a restart, CLIENT KILL) is dropped before
# anything is sent on it, for a retry there would be ambiguous (a retried release
# cannot tell an expired lock from its own earlier DEL).
IDLE_CHECK = 0.005

# A waiting caller looks again this often even if nobody woke it: a leader killed
# mid-read by a signal must not leave the others waiting forever.
FOLLOW_CHECK = 0.5

# RESOLVING: a Resolver's operation is finding out where the target is.
RESOLVING, NEW, CONNECTING, OPEN = "resolving", "new", "connecting", "open"

# How many forks this process is from the one that imported joblock (0 there), bumped in
# every forked child: a driver's state of an older count is the parent's. A list read in
# place (forks[0]) rather than a function: both drivers check it on every call.
forks = [0]


def _forked() -> None:
    forks[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class Connection:
    """One socket to one server, and its wire."""

    __slots__ = (
        "idle_since", "inbox", "last_progress", "plain", "receive", "recheck_at", "retire", "settings",
        "sock", "state", "target", "wire", "writing",
    )  # fmt: skip

    def __init__(self, target: Target, settings: Settings, core: ModuleType, refusing: set[str]) -> None:
        self.target = target
        self.settings = settings
        self.wire = Wire(core, settings, refusing)
        self.wire.interruptible = True
        self.sock: socket.socket | None = None
        self.inbox: list[bytes] = []  # bytes read and not yet fed (see recv)
        self.receive = core.receive
        self.plain = not settings.tls
        self.state = NEW
        self.writing = False
        self.retire = False  # close once idle (Locks.close() while others use it)
        self.idle_since = self.last_progress = monotonic()
        self.recheck_at = math.inf  # when to ask its Resolver again where the target is

    def settle(self, settings: Settings) -> None:
        """Where the connection goes, now that its Resolver found out."""
        self.settings = settings
        self.plain = not settings.tls
        self.wire.settle(settings)
        self.state = NEW

    def recv(self) -> None:
        """Reads what came into ``inbox``, for ``take``. The read and the keeping are one
        step (the core's ``receive``): a signal handler that raises just after the read (the
        pure build runs one between any two bytecodes) leaves the bytes kept, not lost,
        and the connection in step."""
        sock: Any = self.sock
        assert sock is not None
        inbox = self.inbox
        try:
            self.receive(sock, inbox, RECV_SIZE)
        except (BlockingIOError, TimeoutError, ssl.SSLWantReadError):
            raise timeout_error(self.settings) from None
        except OSError as e:
            raise broken_error(self.settings, e) from None
        if not inbox[-1]:
            raise broken_error(self.settings, None)
        if not self.plain:
            while sock.pending():  # decrypted bytes select cannot see
                self.receive(sock, inbox, RECV_SIZE)

    def take(self) -> bytes:
        """The bytes read since the last take."""
        inbox = self.inbox
        data = inbox[0] if len(inbox) == 1 else b"".join(inbox)
        inbox.clear()  # (the same list again: no new one per read)
        return data

    def send(self, data: bytes) -> None:
        assert self.sock is not None
        try:
            self.sock.sendall(data)
        except (BlockingIOError, TimeoutError, ssl.SSLWantWriteError):
            raise timeout_error(self.settings) from None
        except OSError as e:
            raise broken_error(self.settings, e) from None

    def closed_by_server(self) -> bool:
        """Whether the server closed this idle connection (or sent bytes nobody asked for)."""
        sock = self.sock
        assert sock is not None
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        if not readable:
            return False
        if isinstance(sock, ssl.SSLSocket):
            # TLS may have sent a session ticket, which is no data: read it to see.
            try:
                sock.setblocking(False)
                try:
                    sock.recv(1)
                finally:
                    sock.setblocking(True)
            except (BlockingIOError, ssl.SSLWantReadError):
                return False
            except (OSError, ValueError):
                return True
        return True  # b"": closed; anything else would be read as the next reply

    def close(self) -> None:
        if self.sock is not None:
            # Shut down first: a close alone leaves another thread blocked in recv on
            # the socket (an interrupted writer ending the leader's connection) until
            # socket_timeout; a shutdown ends that read at once.
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.drop()

    def drop(self) -> None:
        """Closes this process's copy of the socket, and nothing more (a forked child's)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


def interrupted_error(conn: Connection, failure: BaseException, what: str) -> errors.ConnectionError:
    """What the operations on ``conn``, ended by ``failure`` mid-exchange, learn: an
    interruption's loss (Interrupted) is retried without counting, any other counts."""
    kind = Interrupted if interruption(failure) else errors.ConnectionError
    return kind(f"{what} Redis at {conn.settings.address} was interrupted")


class _State(Engine):
    """A driver's connections, leader and timers in one process; the engine of its operations."""

    def __init__(
        self,
        core: ModuleType,
        settings_for: Callable[[Target], Settings],
        multi: bool,
        resolver: Resolver | None,
    ) -> None:
        self.generation = forks[0]
        self.core = core
        self.settings_for = settings_for
        self.resolver = resolver
        self.multi = multi  # several servers: the leader always waits in select
        # Reentrant only so that retake can tell whether it holds it (see there).
        self.mutex = threading.RLock()
        # Its two methods, bound once: taken and let go around every blocking call.
        self.hold, self.let_go = self.mutex.acquire, self.mutex.release
        self.conns: dict[Target, Connection] = {}
        self.refusing: set[str] = set()  # the servers that refuse SET NX GET (see Wire)
        self.reloads = Reloads()  # the servers found loading their dataset (LOADING)
        self.list: list[Connection] = []  # the same, as a list (looked at on every call)
        self.leader: int | None = None
        # The waiting caller handed the leader's role and not yet running: until it runs,
        # the others queue their requests behind it, for it to write in one write.
        self.heir: Operation | None = None
        self.waiting: list[Operation] = []
        self.due: list[Operation] = []  # the waiting callers to wake, in turn (see wake)
        self.woken = 0  # callers woken and not yet running
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.timer_seq = itertools.count()
        self.background: set[Operation] = set()
        self.polling = False  # the leader is in select: a new request must wake it
        self.poked = False
        self.wake_r: socket.socket | None = None
        self.wake_w: socket.socket | None = None
        self.listeners: dict[Target, ThreadListener] = {}
        # The last interruption a step caught and settled (see recover).
        self.caught: BaseException | None = None

    # -- the engine ---------------------------------------------------------------------

    def open(self, target: Target) -> Connection:
        conn = self.conns[target] = Connection(target, self.settings_for(target), self.core, self.refusing)
        self.list = list(self.conns.values())
        if self.resolver is not None:
            self.resolve(conn, self.resolved)
        return conn

    # -- where a Resolver's targets are -----------------------------------------------------

    def resolve(
        self, conn: Connection, then: Callable[[Connection, Settings | errors.JoblockError], None]
    ) -> None:
        assert self.resolver is not None
        op = self.resolver.resolve(conn.target, lambda found: then(conn, found))
        if op is not None:
            if conn.state is NEW:
                conn.state = RESOLVING
            self.spawn(op)

    def resolved(self, conn: Connection, found: Settings | errors.JoblockError) -> None:
        if self.conns.get(conn.target) is not conn:
            return
        if isinstance(found, errors.JoblockError):
            self.kill(conn, found, False)
            return
        assert self.resolver is not None
        conn.settle(found)
        conn.recheck_at = monotonic() + self.resolver.recheck
        if self.polling:
            self.poke()

    def rechecked(self, conn: Connection, found: Settings | errors.JoblockError) -> None:
        """A check of an open connection's target: one that moved ends the connection."""
        if self.conns.get(conn.target) is not conn:
            return
        assert self.resolver is not None
        conn.recheck_at = monotonic() + self.resolver.recheck
        if isinstance(found, Settings) and found.address != conn.settings.address:
            moved = errors.ConnectionError(f"Redis at {conn.settings.address} gave way to {found.address}")
            self.kill(conn, moved, True)

    def send(self, request: Request) -> None:
        conn = self.conns.get(request.target)
        if conn is None:
            conn = self.open(request.target)
        elif conn.state is OPEN and not conn.wire.busy():
            now = monotonic()
            # An idle connection due for a check of where its target is gets replaced
            # by one that finds out first: no request goes where the target was.
            if now - conn.idle_since > IDLE_CHECK and (now >= conn.recheck_at or conn.closed_by_server()):
                self.kill(conn, broken_error(conn.settings, None), True)
                conn = self.open(request.target)
            conn.last_progress = now
        elif self.resolver is not None and conn.state is OPEN and monotonic() >= conn.recheck_at:
            conn.recheck_at = math.inf  # one check at a time, while the requests go on
            self.resolve(conn, self.rechecked)
        try:
            conn.wire.submit(request)
        except errors.JoblockError:
            raise
        except BaseException as e:
            # Interrupted (a signal handler raising in the pure wire): the request may
            # await a reply without its bytes queued, or the reverse, and every reply
            # after it would go to the wrong caller; the others retry on a new connection.
            self.lose(conn, e, "a request to")
            raise
        if self.polling:
            self.poke()

    def later(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (monotonic() + delay, next(self.timer_seq), callback))
        if self.polling:
            self.poke()

    def wake(self, op: Operation) -> None:
        if op in self.background:
            if op.done:
                self.background.discard(op)
            elif op.wants_input:  # joblock's own input (leases to release): made here
                op.consume(op.produce())
            return
        if op.waiter is not None:
            # One caller woken at a time: woken together, the callers of a read would
            # each wake for their reply, find the GIL taken and sleep again until it is
            # theirs (with 32 threads, 7.6 context switches per acquire + release pair
            # against 3.6). A woken caller wakes the next as soon as it runs (follow):
            # one is always ready to take the GIL when it is let go.
            self.due.append(op)
            if not self.woken:
                self.wake_next()

    def wake_next(self) -> None:
        due = self.due
        while due:
            op = due.pop(0)
            if op.waiter is not None:  # (not timed out meanwhile, nor woken already)
                self.rouse(op)
                return

    def rouse(self, op: Operation) -> None:
        # Released first: a signal handler raising after it leaves a caller that runs and
        # finds its waiter still set, and starts the turns over (see follow), rather than
        # one marked woken that nobody woke.
        waiter = op.waiter
        waiter.release()
        op.waiter = None
        self.woken += 1

    def spawn(self, op: Operation) -> None:
        self.background.add(op)
        op.begin(self)

    # -- running an operation -------------------------------------------------------------

    def run(self, op: Operation) -> Any:
        me = get_ident()
        interrupted = self.retake()
        try:
            if interrupted is not None:  # before anything started
                raise interrupted
            op.engine = self
            op.start()
            unled = self.leader is None and self.heir is None
            if unled and not self.multi and not self.timers and len(self.list) == 1:
                conn = self.list[0]
                if (
                    conn.state is OPEN
                    and conn.plain
                    and not conn.writing
                    and conn.wire.busy()
                    and not op.done
                ):
                    self.alone(op, conn, me)
            while True:
                self.write(me)
                if op.done:
                    return op.outcome()
                if op.wants_input:
                    try:
                        self.let_go()
                        item = op.produce()
                    except BaseException as e:
                        self.caught = e  # (the caller's own input, or an interruption: settled here)
                        raise
                    finally:
                        interrupted = self.retake()
                    if interrupted is not None:
                        raise interrupted
                    op.consume(item)
                elif self.leader == me or (self.leader is None and self.heir is None):
                    self.lead(op, me)
                else:
                    self.follow(op)
        except BaseException as e:
            # An interrupted caller: its operation goes on, read by whoever leads next,
            # and takes back what it is granted.
            if not self.mutex._is_owned():  # type: ignore[attr-defined]
                self.retake()  # interrupted between a blocking call and its retake
            if not op.done:
                op.abandon()
            if op in self.waiting:  # (interrupted as it stopped following)
                self.waiting.remove(op)
                op.waiter = None
            if self.heir is op:
                self.heir = None
            if e is self.caught or e is op.error or isinstance(e, errors.JoblockError):
                self.caught = None
                if self.leader is None and self.heir is None and self.waiting:
                    self.handover()  # (this caller may have been the heir)
            else:
                self.recover(me, e)
            raise
        finally:
            self.let_go()

    def retake(self) -> BaseException | None:
        """Takes the mutex (back, after a blocking call), also when a signal handler raises
        while this thread waits for it (Ctrl-C, a job's time limit): what follows must
        run under it, and run() releases it at the end. Returns what was raised, for
        the caller to raise once its bookkeeping is done.

        A handler may also raise just after the mutex was taken, before this returns:
        the mutex is then this thread's already, and taking it again would wait for
        ever (a plain lock) or twice (a reentrant one), so its owner is asked."""
        interrupted: BaseException | None = None
        while True:
            try:
                self.hold()
                return interrupted
            except BaseException as e:
                interrupted = self.caught = e
                if self.mutex._is_owned():  # type: ignore[attr-defined]
                    return interrupted

    def recover(self, me: int, failure: BaseException) -> None:
        """After an interruption that no step caught: one that landed between a blocking
        call and its retake, or inside the bookkeeping around it (the pure build runs a
        signal handler between any two bytecodes). Which connection it left out of step
        (bytes read and not fed, taken and not written, a socket opened and not kept) and
        which caller unwoken is not known: every connection in use ends, its callers
        retrying on a new one as after a dropped connection, and every waiting caller
        looks again."""
        if self.leader == me:
            self.leader = None
            self.polling = False
        self.heir = None
        for conn in {*self.list, *self.conns.values()}:
            if (
                conn.wire.busy()
                or conn.writing
                or conn.state is CONNECTING
                or self.conns.get(conn.target) is not conn  # (interrupted in open or kill)
            ):
                self.kill(conn, interrupted_error(conn, failure, "a call on"), True)
        self.list = list(self.conns.values())
        self.wake_all()

    def wake_all(self) -> None:
        """Every waiting caller looks again: an interruption while they were being woken
        may have left one unwoken, or counted as woken."""
        self.due.clear()
        self.woken = 0
        for other in self.waiting:
            waiter = other.waiter
            if waiter is not None:
                other.waiter = None
                self.woken += 1
                if waiter.locked():  # (not if a rouse interrupted after its release let it go)
                    waiter.release()

    def alone(self, op: Operation, conn: Connection, me: int) -> None:
        """The lone caller's round trip: write, read, and nothing else in between.

        When the reply does not finish the operation (more to send, more callers
        came), the general loop of ``run`` goes on from here.
        """
        self.leader = me
        try:
            out = self.output(conn)
            conn.writing = True
            failure: BaseException | None = None
            written = out is None
            try:
                self.let_go()  # (in the try: a handler may raise once it is let go)
                if out is not None:
                    conn.send(out)
                    written = True
                conn.recv()
            except BaseException as e:
                failure = e
            interrupted = self.retake()
            conn.writing = False
            if written or failure is None:
                interrupted = self.received(conn, failure, out is not None) or interrupted
            else:  # (the bytes may have gone in part: the connection is out of step)
                interrupted = self.lose(conn, failure, "a write to") or interrupted
            if interrupted is not None:
                raise interrupted
        except BaseException:
            if self.mutex._is_owned():  # type: ignore[attr-defined]  # (else run() recovers)
                self.leader = None
                if self.waiting:
                    self.handover()
            raise
        self.leader = None
        if self.waiting:
            self.handover()

    def handover(self) -> None:
        """The leader is done: the first caller still waiting leads next, woken at once.

        One whose call the same read finished (waiting for its turn to be woken) passes
        the role on as it runs: the role goes along the callers being woken until one
        that waits for a reply takes it, and by then they have queued what they send
        next, for it to write in one write. A caller making its input (a batch's next
        keys, from the caller's own iterable) is passed over: it would read nothing
        until that is made.
        """
        self.leader = None
        for other in self.waiting:
            if other.waiter is not None and not other.wants_input:
                self.rouse(other)  # (first: an heir nobody woke would hold the others back)
                self.heir = other
                break

    def follow(self, op: Operation) -> None:
        waiter = threading.Lock()
        waiter.acquire()
        op.waiter = waiter
        self.waiting.append(op)
        try:
            self.let_go()
            waiter.acquire(timeout=FOLLOW_CHECK)
        except BaseException as e:
            self.caught = e  # (settled below)
            raise
        finally:
            interrupted = self.retake()
            self.waiting.remove(op)
            heir = self.heir is op
            if heir:
                self.heir = None
            if op.waiter is None:  # woken: the next caller's turn
                self.woken = max(self.woken - 1, 0)
            else:
                # Not woken, looking again on its own: the turns start over, should a
                # signal handler that raised in a waker (the pure build's) have broken them.
                op.waiter = None
                self.woken = 0
            if self.due and not self.woken:
                self.wake_next()
            if heir and (op.done or op.wants_input) and self.waiting:
                self.handover()  # its call is done, or it has its input to make: pass it on
        if interrupted is not None:
            raise interrupted

    def lead(self, op: Operation, me: int) -> None:
        mine = self.leader is None
        self.leader = me
        try:
            while not op.done and not op.wants_input:
                if self.timers:
                    self.fire_timers()
                self.write(me)
                if op.done or op.wants_input:
                    break
                self.read_once()
        except BaseException:
            if mine and self.mutex._is_owned():  # type: ignore[attr-defined]  # (else run() recovers)
                self.handover()
            raise
        if mine:
            self.handover()

    # -- I/O (the mutex is held on entry and exit, released around blocking calls) --------

    def write(self, me: int) -> None:
        """Writes what is queued on every connection this thread may write to.

        While a leader reads, it writes too: what callers queue during one round trip
        leaves in one write once the replies are in, rather than in a write each.
        """
        leader = self.leader
        leading = leader is not None and leader == me  # (None after a lone caller's round trip)
        for conn in self.list:
            if conn.state is not OPEN or conn.writing:
                continue
            if not leading and (not conn.plain or self.leader is not None or self.heir is not None):
                continue
            data = self.output(conn)
            while data is not None:
                conn.writing = True
                failure: BaseException | None = None
                try:
                    self.let_go()
                    conn.send(data)
                except BaseException as e:
                    failure = e
                interrupted = self.retake()
                conn.writing = False
                if failure is not None:
                    interrupted = self.lose(conn, failure, "a write to") or interrupted
                if interrupted is not None:
                    raise interrupted
                if failure is not None:
                    break
                data = self.output(conn)

    def output(self, conn: Connection) -> bytes | None:
        """What to write to ``conn`` next. Interrupted (a signal handler raising in the
        pure wire as it takes the bytes, whose replies it then awaits), the bytes may be
        lost: the connection is out of step, and the others on it retry on a new one."""
        try:
            return conn.wire.output()
        except errors.JoblockError:
            raise
        except BaseException as e:
            self.lose(conn, e, "a write to")
            raise

    def read_once(self) -> None:
        """One wait for replies (or a timer), and what it brought."""
        conns = self.list
        if len(conns) == 1 and not self.multi and not self.timers:
            conn = conns[0]
            if conn.state is OPEN and conn.plain and conn.wire.busy():
                self.receive(conn)  # the lone-caller path: straight into recv
                return
        for conn in conns:
            if conn.state is NEW:
                self.connect(conn)
                return  # its handshake is written next
        busy = [c for c in conns if c.state is OPEN and c.wire.busy()]
        timer = self.timers[0][0] - monotonic() if self.timers else None
        if len(busy) == 1 and busy[0].plain and timer is None and not self.multi:
            self.receive(busy[0])
            return
        self.wait_in_select(busy, timer)

    def receive(self, conn: Connection) -> None:
        failure: BaseException | None = None
        try:
            self.let_go()
            conn.recv()
        except BaseException as e:
            failure = e
        interrupted = self.retake()
        interrupted = self.received(conn, failure) or interrupted
        if interrupted is not None:
            raise interrupted

    def received(
        self, conn: Connection, failure: BaseException | None, first: bool = False
    ) -> BaseException | None:
        """What a read brought (also when interrupted since: what was read is not lost), and
        how it ended: returns an interruption, to be raised. One in a plain read loses
        nothing (see Connection.recv), and the connection goes on; a TLS connection may
        hold decrypted bytes that select cannot see, and ends. ``first``: the first read
        after a write (see ``Wire.quick``)."""
        if conn.inbox:
            self.feed(conn, conn.take(), first)
        if failure is None:
            return None
        if conn.plain and not isinstance(failure, errors.JoblockError):
            self.caught = failure
            return failure
        return self.lose(conn, failure, "a read from")

    def lose(self, conn: Connection, failure: BaseException, what: str) -> BaseException | None:
        """Ends ``conn`` after ``failure`` in a send or a read; returns it when it
        is not joblock's (an interruption, to be raised). Interrupted, with bytes maybe sent
        or read in part, the connection is out of step: the others on it retry on a new one."""
        if isinstance(failure, errors.JoblockError):
            self.kill(conn, failure, True)
            return None
        self.caught = failure
        self.kill(conn, interrupted_error(conn, failure, what), True)
        return failure

    def wait_in_select(self, busy: list[Connection], timer: float | None) -> None:
        if self.wake_r is None:
            self.wake_r, self.wake_w = socket.socketpair()
            self.wake_r.setblocking(False)
            self.wake_w.setblocking(False)
        now = monotonic()
        waits = [c.last_progress + c.settings.socket_timeout - now for c in busy]
        if timer is not None:
            waits.append(timer)
        timeout = max(0.0, min(waits)) if waits else None
        if timeout is None and not busy:
            # Nothing to read, nothing timed: only another caller's request can change
            # that, and it pokes the pipe.
            timeout = FOLLOW_CHECK
        self.polling, self.poked = True, False
        wake_r = self.wake_r
        try:
            self.let_go()
            ready, _, _ = select.select(
                [wake_r, *(c.sock for c in busy if c.sock is not None)], [], [], timeout
            )
        except BaseException as e:
            self.caught = e  # (settled below)
            raise
        finally:
            interrupted = self.retake()
            self.polling = False
        if interrupted is not None:
            raise interrupted
        if wake_r in ready:
            with contextlib.suppress(OSError):
                while wake_r.recv(4096):
                    pass
        now = monotonic()
        for conn in busy:
            if conn.sock in ready:
                conn.last_progress = now
                self.receive(conn)
            elif conn.state is OPEN and now - conn.last_progress >= conn.settings.socket_timeout:
                self.kill(conn, timeout_error(conn.settings), True)

    def poke(self) -> None:
        if not self.poked and self.wake_w is not None:
            self.poked = True
            with contextlib.suppress(OSError):
                self.wake_w.send(b"\0")

    def connect(self, conn: Connection) -> None:
        conn.state = CONNECTING
        failure: BaseException | None = None
        pause = self.reloads.pause(conn.target)
        sock: socket.socket | None = None
        try:
            self.let_go()
            if pause:  # a server still loading its dataset would answer LOADING again at once
                time.sleep(pause)
            sock = open_socket(conn.settings)
        except BaseException as e:
            failure = e
        interrupted = self.retake()
        if isinstance(failure, errors.JoblockError):
            self.kill(conn, failure, False)
        elif failure is not None:
            # Interrupted: nothing was sent on it, and the next caller to lead connects
            # again; its requests wait for that (the connection is not lost).
            if sock is not None:
                sock.close()
            conn.state = NEW
            interrupted = self.caught = failure
        else:
            conn.sock = sock
            conn.state = OPEN
            conn.last_progress = monotonic()
            conn.wire.connected()
        if interrupted is not None:
            raise interrupted

    def feed(self, conn: Connection, data: bytes, first: bool = False) -> None:
        conn.last_progress = now = monotonic()
        try:
            # A lone caller's commonest replies skip the parser (it writes, then reads).
            if not (first and conn.wire.quick(data)):
                conn.wire.feed(data)
        except errors.JoblockError as e:  # not RESP, the handshake refused, a primary demoted: unusable
            self.kill(conn, e, isinstance(e, errors.ConnectionError))  # the demoted: sent again
            return
        except BaseException as e:
            # Interrupted (a signal handler raised in the pure parser or an operation's
            # step, another thread's too), with the replies read in part: the connection
            # is out of step, and the others on it retry on a new one rather than take
            # each other's replies. A caller may have been left unwoken: all look again.
            self.lose(conn, e, "reading replies from")
            self.wake_all()
            raise
        if not conn.wire.busy():
            conn.idle_since = now
            if conn.retire:
                self.kill(conn, None, True)

    def kill(self, conn: Connection, error: errors.JoblockError | None, retryable: bool) -> None:
        """Closes ``conn``; every operation with requests on it learns of the loss."""
        if type(error) is Loading:
            self.reloads.loading(conn.target, conn.settings, error)
        if self.conns.get(conn.target) is conn:
            del self.conns[conn.target]
            self.list = list(self.conns.values())
        conn.close()
        interrupted: BaseException | None = None
        for op, requests in conn.wire.drop().items():
            assert error is not None  # only an idle connection is closed without one
            try:
                op.lost(requests, error, retryable)
            except BaseException as e:  # (a signal handler): the other operations still learn of it
                interrupted = interrupted or e
        if interrupted is not None:
            self.caught = interrupted
            self.wake_all()  # (one may be done and not woken)
            raise interrupted

    def fire_timers(self) -> None:
        timers = self.timers
        now = monotonic()
        while timers and timers[0][0] <= now:
            _, _, callback = heapq.heappop(timers)
            callback()

    # -- waiting for a lock (see waits.py) ------------------------------------------------

    def listen(self, step: Listen) -> Wakeups | None:
        with self.mutex:
            listener = self.listeners.get(step.target)
            if step.lazy:
                return listener.ready_for(step) if listener is not None else None
            if listener is None:
                wakeups = Wakeups(
                    self.core, self.settings_for(step.target), step.target, step.target is not None
                )
                wakeups.run_later = self.run_later
                listener = self.listeners[step.target] = ThreadListener(wakeups)
        return listener.listen(self.found(step.target), step)

    def found(self, target: Target) -> Settings:
        """The settings the requests to ``target`` use: a Sentinel service's primary is
        found first (by a PING, for a client that has not asked anything yet)."""
        conn = self.conns.get(target)
        if conn is None or not conn.settings.found:
            self.run(Call(target, self.core, [("PING",)], self.settings_for(target).retries, idempotent=True))
            conn = self.conns.get(target)
        return conn.settings if conn is not None else self.settings_for(target)

    def run_later(self, op: Operation) -> None:
        """Runs ``op`` in a thread of its own, its outcome no one's (a departed waiter's
        leave, or the release of a lock handed to one): the listener that asks for it
        goes on reading."""

        def run() -> None:
            with contextlib.suppress(Exception):
                self.run(op)

        threading.Thread(target=run, daemon=True).start()

    def park(self, step: Park) -> bytes | None:
        slot = step.slot
        if not slot.messages:
            try:
                self.listeners[step.leave.target].wait(slot, step.seconds)
            except BaseException:
                # Interrupted: leave the queue, giving back a lock handed over meanwhile.
                step.leave.abandoned = True
                with contextlib.suppress(Exception):
                    self.run(step.leave)
                raise
        return slot.take()

    def close(self) -> None:
        """Closes the idle connections now and the busy ones once they are idle."""
        for listener in list(self.listeners.values()):
            listener.close()
        with self.mutex:
            for conn in list(self.conns.values()):
                if conn.wire.busy():
                    conn.retire = True
                else:
                    self.kill(conn, None, True)

    def forget(self) -> None:
        """In a forked child: drop the parent's sockets (our copies only) without a word on them."""
        for conn in self.conns.values():
            conn.drop()
        for sock in (self.wake_r, self.wake_w):
            if sock is not None:
                sock.close()
        for listener in self.listeners.values():
            listener.forget()


class Driver:
    """Runs operations for one lock client over blocking sockets (see the module docstring).

    ``settings_for`` gives the settings of each target; ``multi`` says the client talks
    to several servers; a ``resolver`` finds out where targets are (Redis Sentinel).
    """

    def __init__(
        self,
        core: ModuleType,
        settings_for: Callable[[Target], Settings],
        multi: bool = False,
        resolver: Resolver | None = None,
    ):
        self._core = core
        self._settings_for = settings_for
        self._multi = multi
        self._resolver = resolver
        self._state = _State(core, settings_for, multi, resolver)

    def _current(self) -> _State:
        state = self._state
        if state.generation != forks[0]:
            # No lock guards this: one taken by a parent's thread at the fork would stay
            # taken in the child forever.
            state.forget()
            state = self._state = _State(self._core, self._settings_for, self._multi, self._resolver)
        return state

    def run(self, op: Operation) -> Any:
        """Carries out ``op`` and returns its result (or raises its error)."""
        state = self._state
        if state.generation != forks[0]:
            state = self._current()
        return state.run(op)

    def drive(self, plan: Generator[Any, Any, T]) -> T:
        """Carries out a plan: each operation (or pause, or wait) it yields, its result
        (or error) sent back."""
        value: Any = None
        failure: Exception | None = None
        while True:
            try:
                op = plan.send(value) if failure is None else plan.throw(failure)
            except StopIteration as stop:
                return cast(T, stop.value)
            try:
                if isinstance(op, Operation):
                    value = self.run(op)
                elif isinstance(op, Park):
                    value = self._current().park(op)
                elif isinstance(op, Listen):
                    value = self._current().listen(op)
                else:
                    time.sleep(op.seconds)
                    value = None
                failure = None
            except Exception as e:
                value, failure = None, e

    def close(self) -> None:
        self._current().close()


def call(settings: Settings, core: ModuleType, commands: list[tuple[Any, ...]], **options: Any) -> list[Any]:
    """``commands`` on a connection of their own, closed afterwards: for the tools.

    Their replies, in order; ``options`` are those of ``Call`` (an error reply is
    raised unless ``errors_as_replies``).
    """
    driver = Driver(core, lambda _: settings)
    try:
        return cast(
            "list[Any]", driver.run(Call(None, core, commands, settings.retries, idempotent=True, **options))
        )
    finally:
        driver.close()
