"""Waiting for a lock without polling: the queue script's operation and the wake-ups.

A waiting acquire (``acquire(..., wait=)``) queues in Redis (``_scripts.QUEUE``), and
a release hands the lock straight to the first live waiter and publishes that on the
waiter's client's channel, ``joblock:wake:<client id>``. Each client listens on one
connection per server however many of its callers wait: ``Wakeups`` is that
subscription without I/O (what to write, what the bytes read say), and each driver
carries it (a thread for the threaded driver, a protocol for asyncio).

In a Redis Cluster whose nodes have sharded pub/sub (Redis and Valkey >= 7.0), a
client listens on each primary with SSUBSCRIBE to a channel in the slot of each key
it waits for, ``joblock:wake:<client id>:<key>`` (and ``joblock:wake:lost:<key>`` for
a guarded lease's key), and the scripts publish there with SPUBLISH: a message stays
on the slot's shard and never crosses the cluster bus, as a classic PUBLISH, sent to
every node, would. A slot that moves away ends its channels' subscriptions (the server
says SUNSUBSCRIBE): their waiters look again, meet MOVED, and listen on the new primary.

A plan waits by yielding ``Listen`` (the subscription must be live before it queues:
a waiter whose client is not listening is passed over as dead) and ``Park`` (until
its message, or a timeout: the lock's own expiry, or a rare safety re-check).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import threading
import time
from collections.abc import Callable, Generator
from types import ModuleType
from typing import Any

from .. import errors, metrics
from .._scripts import QUEUE_SHA, RELEASE_SHA
from ..settings import Settings
from .ops import EXTEND, AcquireOne, Call, Operation, ScriptOne
from .requests import Single, Target
from .wire import handshake_commands, handshake_error

__all__ = [
    "LOST_CHANNEL", "RECHECK", "Listen", "Park", "QueueOne", "Session", "Slot", "Wakeups", "lost_message",
    "parse_entry", "queue_key", "stray_release", "waiting",
]  # fmt: skip

# Where an operator's release of a lock (``joblock release``, the locks page,
# ``joblock.testing``) is published, as "<cause> <the holder's token>": every client with
# a subscription listens on it, and tells the lease of that token it was lost for that
# cause (joblock.lost). Under "joblock:wake:", so an ACL's channel pattern for wake-ups
# covers it.
LOST_CHANNEL = b"joblock:wake:lost"
LOST_CAUSES = {b"released": "released", b"expired": "expired", b"taken": "taken"}


def lost_message(cause: bytes, token: bytes) -> bytes:
    return cause + b" " + token


# What a parked waiter is told when it must ask Redis itself: its client's
# subscription broke (a message may have been lost), or it was passed over because
# its lock is of another kind (it then meets the mismatch error).
RECHECK = b""

# A waiter that hears nothing asks again within about its own ttl, and about every
# SAFETY seconds at most: the safety net for a release that bypassed joblock's scripts
# (a DEL by hand) and for the expiry of a lock handed over after the waiter queued.
# Everything else wakes it by message, or at the lock's expiry.
SAFETY = 10.0
MIN_RECHECK = 0.001

# How many departed waiters a client remembers (see ``Wakeups.drop``): only a failed
# last step makes one, and each is forgotten when a lock handed to it is released.
MAX_DEPARTED = 10_000


# Seconds a queued waiter's deadline is given beyond its wait, for the server's clock:
# past it the server passes the waiter over (its client leaves the queue at the end of
# its wait anyway).
CLOCK_MARGIN = 5.0


def stray_release(target: Target, core: ModuleType, key: bytes, holder: bytes) -> Call:
    """The release of a lock handed to a waiter that had stopped waiting (its outcome is
    no one's: an error reply is not raised)."""
    release = (b"EVALSHA", RELEASE_SHA, 1, key, holder)
    return Call(target, core, [release], 0, scripted=True, errors_as_replies=True)


def tagged(key: bytes, suffix: bytes) -> bytes:
    """``key`` followed by ``suffix`` in the hash slot of ``key``, as the scripts' ``tagged``
    names it (a key without a hash tag is put in braces)."""
    start = key.find(b"{")
    if start >= 0 and key.find(b"}", start + 1) > start + 1:
        return key + suffix
    return key + suffix if b"}" in key else b"{" + key + b"}" + suffix


def queue_key(key: bytes) -> bytes:
    """Where the waiters of the lock at ``key`` queue: in its hash slot, as the scripts say."""
    return tagged(key, b":waiters")


def parse_entry(entry: bytes) -> tuple[bytes, bytes, float, int, int, bytes] | None:
    """A queued waiter: its client's id and number, its deadline (wall-clock seconds), its
    ttl in ms, its limit (0: a reader) and its token; None if it is no waiter of joblock's."""
    try:
        member, deadline, ms, _, limit, token = entry.split(b" ", 5)
        client, seq = member.split(b":", 1)
        return client, seq, int(deadline) / 1000, int(ms), int(limit), token
    except ValueError:
        return None


class Slot:
    """A waiting caller's mailbox: the messages for its entry, kept until it looks.

    The listener (a thread of its own, for the threaded driver) appends; the caller
    pops: each one step that cannot interleave, so no message falls between them.
    """

    __slots__ = ("channel", "messages", "notify", "seq")

    def __init__(self, seq: bytes, channel: bytes | None) -> None:
        self.seq = seq
        self.channel = channel  # the sharded channel its messages come on, if any
        self.messages: list[bytes] = []
        # The driver's way to wake the parked caller (set while it is parked).
        self.notify: Callable[[], None] | None = None

    def deliver(self, payload: bytes) -> None:
        self.messages.append(payload)
        notify = self.notify
        if notify is not None:
            notify()

    def wait(self, seconds: float) -> None:
        """The threaded driver's park while another thread reads the subscription (see
        ``listeners.ThreadListener.wait``): the calling thread waits until a message comes, or
        ``seconds`` pass. On a bare lock that ``deliver`` lets go: woken, the caller runs at
        once, where an Event's waiter would first wait for the deliverer to let go of the
        Event's own lock (listener to caller: 45 us median, 61 with an Event)."""
        gate = threading.Lock()
        gate.acquire()

        def notify() -> None:  # (a second message, or a re-check, finds it open already)
            with contextlib.suppress(RuntimeError):
                gate.release()

        self.notify = notify
        try:
            if not self.messages:
                gate.acquire(timeout=seconds)
        finally:
            self.notify = None

    def take(self) -> bytes | None:
        """A grant if one came, else RECHECK if that came, else None."""
        found = None
        while True:
            try:
                message = self.messages.pop()
            except IndexError:
                return found
            if found is None or message != RECHECK:  # a grant outranks a re-check
                found = message


class Wakeups:
    """One client's wake-up channel on one server: its id, and its callers' mailboxes.

    The id (and so each member) outlives the connection: ``session`` starts the
    reading of a new one, and ``broken`` tells every parked caller to check again.
    ``cluster``: a Cluster node's, which listens by sharded pub/sub where the node has it
    (``sharded``, learnt by the session); ``uses`` counts the callers that need each
    sharded channel (its waiters and guarded leases).
    """

    def __init__(self, core: ModuleType, settings: Settings, target: Target, cluster: bool = False) -> None:
        self.target = target
        self.id = os.urandom(8).hex().encode()
        self.channel = b"joblock:wake:" + self.id
        self.settings = settings
        self.core = core
        self.cluster = cluster
        self.sharded = False
        self.uses: dict[bytes, int] = {}
        self.slots: dict[bytes, Slot] = {}
        self._seq = itertools.count(1)
        # The numbers of waiters that stopped without leaving the queue, oldest first
        # (the listener thread reads them too), and the driver's way to run what they
        # leave to do: leave the queue, release a lock handed to one later.
        self.departed: dict[bytes, None] = {}
        self._departing = threading.Lock()
        self.sessions = 0  # connections made so far
        self.run_later: Callable[[Operation], None] | None = None
        # The guarded leases of the client on this server, by token (see joblock.lost).
        self.watched: dict[bytes, Any] = {}

    def sharded_channel(self, key: bytes | None, lost: bool = False) -> bytes | None:
        """The channel this client listens on for ``key``'s waiters (``lost``: for a guarded
        lease of ``key``) when it listens by sharded pub/sub; else None."""
        if not self.sharded or key is None:
            return None
        return (LOST_CHANNEL if lost else self.channel) + b":" + tagged(key, b"")

    def _use(self, channel: bytes | None, n: int) -> None:
        if channel is not None:
            left = self.uses.get(channel, 0) + n
            if left > 0:
                self.uses[channel] = left
            else:
                self.uses.pop(channel, None)

    def slot(self, channel: bytes | None = None) -> Slot:
        """A new waiter's mailbox (its messages come on ``channel``, a sharded one)."""
        slot = Slot(b"%d" % next(self._seq), channel)
        self.slots[slot.seq] = slot
        self._use(channel, 1)
        return slot

    def watch(self, lease: Any) -> None:
        """An operator's release of ``lease`` is to be heard (see joblock.lost)."""
        self.watched[lease._value] = lease
        self._use(self.sharded_channel(lease._key, lost=True), 1)

    def unwatch(self, lease: Any) -> None:
        if self.watched.pop(lease._value, None) is not None:
            self._use(self.sharded_channel(lease._key, lost=True), -1)

    def entry(self, slot: Slot, deadline: float, ms: int, counter: bytes, limit: int, token: bytes) -> bytes:
        """A waiter as it queues (see ``_scripts``): ``deadline`` is wall-clock seconds,
        ``counter`` its fencing counter's key (b"0": not fenced)."""
        return b"%s:%s %d %d %s %d %s" % (self.id, slot.seq, deadline * 1000, ms, counter, limit, token)

    def drop(self, slot: Slot, leave: Operation | None = None) -> None:
        """The waiter is done. ``leave``: it stopped without being sure it left the queue
        (a step failed, or it was interrupted), so it leaves in the background, and a
        lock handed to it meanwhile is released."""
        if self.slots.pop(slot.seq, None) is not None:
            self._use(slot.channel, -1)
        if leave is not None:
            with self._departing:
                self.departed[slot.seq] = None
                while len(self.departed) > MAX_DEPARTED:
                    del self.departed[next(iter(self.departed))]
            if self.run_later is not None:
                leave.abandoned = True  # a lock it was handed is given back
                self.run_later(leave)

    def message(self, payload: bytes) -> None:
        """A message on the channel: "<number> ?" (look again), or "<number> <the grant's
        reply> <length of the holder> <holder><key>" (a lock handed over)."""
        seq, _, rest = payload.partition(b" ")
        reply, _, rest = rest.partition(b" ")
        slot = self.slots.get(seq)
        if slot is not None:
            slot.deliver(RECHECK if reply == b"?" else reply)
        elif reply != b"?" and self.run_later is not None:
            with self._departing:
                departed = self.departed.pop(seq, False) is None
            if departed:
                size, _, rest = rest.partition(b" ")
                n = int(size)
                self.run_later(stray_release(self.target, self.core, rest[n:], rest[:n]))

    def released(self, payload: bytes) -> None:
        """An operator ended the hold of a token (``lost_message``): a guarded lease of ours is lost."""
        cause, _, token = payload.partition(b" ")
        lease = self.watched.get(token)
        if lease is not None:
            self.core.lose(lease, LOST_CAUSES.get(cause, "released"))

    def session(self, settings: Settings) -> Session:
        self.settings = settings
        self.sessions += 1
        return Session(self, settings)

    def broken(self, channel: bytes | None = None) -> None:
        """The subscription ended (``channel``: that sharded channel's alone, its slot moved
        away): every parked caller it served checks again itself."""
        for slot in list(self.slots.values()):
            if channel is None or slot.channel == channel:
                slot.deliver(RECHECK)


# How many sharded channels no caller needs a connection keeps subscribed: a client
# that waits for a key again soon finds its channel ready; past this many, the oldest go.
IDLE_CHANNELS = 1024


class Session:
    """One connection of a subscription: the handshake and SUBSCRIBE, then messages.

    A Cluster node's asks first whether the node has sharded pub/sub (``COMMAND INFO
    SSUBSCRIBE``): if it has, the connection subscribes to nothing until a caller needs
    a channel (``subscribe``); if not (Redis 6.2), it SUBSCRIBEs as elsewhere.
    """

    def __init__(self, wakeups: Wakeups, settings: Settings) -> None:
        self.wakeups = wakeups
        self.settings = settings
        self._reader = wakeups.core.Reader()
        self._handshake = handshake(settings)
        self._greeted = 0  # replies to the handshake and SUBSCRIBE (or the probe) read so far
        self.subscribed = False
        # Sharded channels: subscribed, asked for (in order, with who waits for each), and
        # being left by our own SUNSUBSCRIBE.
        self.channels: dict[bytes, None] = {}
        self._asked: dict[bytes, list[Callable[[errors.JoblockError | None], None]]] = {}
        self._leaving: set[bytes] = set()
        self._guard = threading.Lock()  # the threaded driver's callers and its reader share these

    def greeting(self) -> bytes:
        """What to write first: the handshake, then SUBSCRIBE (or the probe)."""
        last = (b"COMMAND", b"INFO", b"SSUBSCRIBE") if self.wakeups.cluster else self._subscribe()
        return self._encode([*self._handshake, last])

    def _subscribe(self) -> tuple[bytes, ...]:
        return (b"SUBSCRIBE", self.wakeups.channel, LOST_CHANNEL)

    def _encode(self, commands: list[tuple[Any, ...]]) -> bytes:
        encode = self.wakeups.core.encode_command
        return b"".join([encode(c) for c in commands])

    def feed(self, data: bytes) -> bytes:
        """Bytes read: handshake replies (an error one raises), then messages, delivered.
        What to write in answer (the SUBSCRIBE of a node without sharded pub/sub)."""
        self._reader.feed(data)
        got: list[Any] = []
        self.wakeups.core.take(self._reader, got, 1 << 30)
        out = b""
        for reply in got:
            if not self.subscribed:
                out += self._greet(reply)
            elif type(reply) is list and len(reply) == 3:
                self._push(reply[0], reply[1], reply[2])
            elif type(reply) is errors.ReplyError:
                with self._guard:  # an SSUBSCRIBE refused (an ACL, MOVED): the oldest asked
                    channel = next(iter(self._asked), None)
                    waiting = self._asked.pop(channel, []) if channel is not None else []
                error = errors.reply_error(reply.message, command="SSUBSCRIBE", key=channel)
                for then in waiting:
                    then(error)
        return out

    def _push(self, kind: bytes, channel: bytes, payload: Any) -> None:
        wakeups = self.wakeups
        if kind in (b"message", b"smessage"):
            if channel == LOST_CHANNEL or channel.startswith(LOST_CHANNEL + b":"):
                wakeups.released(payload)
            else:
                wakeups.message(payload)
        elif kind == b"ssubscribe":
            with self._guard:
                self.channels[channel] = None
                waiting = self._asked.pop(channel, [])
            for then in waiting:
                then(None)
        elif kind == b"sunsubscribe":
            with self._guard:
                self.channels.pop(channel, None)
                ours = channel in self._leaving
                self._leaving.discard(channel)
            if not ours:  # the node no longer serves its slot: its callers look again (and meet MOVED)
                wakeups.broken(channel)

    def subscribe(self, channel: bytes, then: Callable[[errors.JoblockError | None], None]) -> bytes:
        """``then`` is called once ``channel`` is subscribed (with None) or refused (with
        the error); what to write for it (with the SUNSUBSCRIBE of idle channels)."""
        with self._guard:
            ready = channel in self.channels
            if ready:  # used again: the last of the idle ones to go
                del self.channels[channel]
                self.channels[channel] = None
            else:
                asked = self._asked.get(channel)
                if asked is not None:
                    asked.append(then)
                    return b""
                self._asked[channel] = [then]
                commands: list[tuple[Any, ...]] = [(b"SSUBSCRIBE", channel)]
                uses = self.wakeups.uses
                idle = [c for c in self.channels if c not in uses]
                for old in idle[: max(0, len(idle) - IDLE_CHANNELS)]:
                    self._leaving.add(old)
                    del self.channels[old]
                    commands.append((b"SUNSUBSCRIBE", old))
        if ready:
            then(None)
            return b""
        return self._encode(commands)

    def ready(self, channel: bytes | None) -> bool:
        """Whether this connection listens for ``channel`` (None: the client's own)."""
        return self.subscribed and (channel is None or channel in self.channels)

    def failed(self, error: errors.JoblockError) -> None:
        """The connection ended: whoever waits for a channel is told."""
        with self._guard:
            waiting = [then for asked in self._asked.values() for then in asked]
            self._asked.clear()
        for then in waiting:
            then(error)

    def _greet(self, reply: Any) -> bytes:
        handshake = self._handshake
        if type(reply) is errors.ReplyError and self._greeted < len(handshake):
            raise handshake_error(self.settings, handshake[self._greeted], reply)
        self._greeted += 1
        if self._greeted <= len(handshake):
            return b""
        if self._greeted == len(handshake) + 1 and self.wakeups.cluster:
            # The probe: an entry for SSUBSCRIBE (a list) when the node has it.
            if type(reply) is list and reply and type(reply[0]) is list:
                self.wakeups.sharded = self.subscribed = True
                return b""
            self.wakeups.sharded = False
            return self._encode([self._subscribe()])
        if type(reply) is errors.ReplyError:
            raise handshake_error(self.settings, ("SUBSCRIBE",), reply)
        self.subscribed = True
        return b""


def handshake(settings: Settings) -> list[tuple[Any, ...]]:
    # A subscription has no database; ROLE would be answered, but a listener on a
    # demoted primary is caught by the queue script instead (its client is not
    # listening on the new primary).
    return [c for c in handshake_commands(settings) if c[0] not in ("SELECT", "ROLE")]


class Listen:
    """A plan's step: make sure its client listens on ``target``'s server; sent ``Wakeups``.

    ``again`` asks for a new connection (the queue script found the client not
    listening there: a failover moved the primary under the old subscription), unless
    the connection is no longer the one made as the ``stale``-th: another caller made a
    new one already. ``lazy`` asks only whether the client listens already. ``key``:
    the lock it listens for, whose channel a sharded subscription must have (``lost``:
    the channel of a guarded lease's key).
    """

    __slots__ = ("again", "key", "lazy", "lost", "stale", "target")

    def __init__(
        self,
        target: Target,
        again: bool = False,
        stale: int = 0,
        lazy: bool = False,
        key: bytes | None = None,
        lost: bool = False,
    ) -> None:
        self.target = target
        self.again = again
        self.stale = stale
        self.lazy = lazy  # sent None rather than connect when not listening yet
        self.key = key
        self.lost = lost

    def channel(self, wakeups: Wakeups) -> bytes | None:
        """The sharded channel this step needs, if its client listens by sharded pub/sub."""
        return wakeups.sharded_channel(self.key, self.lost)


class Park:
    """A plan's step: wait for ``slot``'s message or ``seconds``; sent the message or None.

    A caller that stops waiting meanwhile (cancelled, interrupted) leaves the queue
    through ``leave``, which the driver runs in the background, abandoned: a lock
    handed over to it in the meantime is released.
    """

    __slots__ = ("leave", "seconds", "slot")

    def __init__(self, slot: Slot, seconds: float, leave: QueueOne) -> None:
        self.slot = slot
        self.seconds = seconds
        self.leave = leave


class QueueOne(AcquireOne):
    """One step of a waiting (or a fair, or a reader's) acquire: the queue script.

    Its result is a Lease, None (busy, not queued), or an int: queued, and the
    milliseconds until the lock may free by itself (-1: not known, -3: the client is
    not listening on this server). An abandoned one leaves the queue, and gives back
    a lock it was handed meanwhile.
    """

    __slots__ = ("again", "entry", "fair", "patience")

    def __init__(
        self,
        owner: Any,
        target: Target,
        core: ModuleType,
        key: bytes,
        name: Any,
        value: bytes,
        ms: int,
        fenced: bool,
        limit: int,
        retries: int,
        entry: bytes = b"",
        patience: int = 0,
        fair: bool = False,
        again: bool = False,
    ) -> None:
        super().__init__(owner, target, core, key, name, value, ms, fenced, limit, retries)
        self.entry = entry  # the waiter as it queues
        self.patience = patience
        self.fair = fair
        self.again = again

    def step(self, entry: bytes, patience: float, again: bool) -> QueueOne:
        """The same acquire as a queued waiter's step, ``patience`` seconds left (0: it leaves)."""
        return QueueOne(
            self.owner, self.target, self.core, self.key, self.name, self.value, self.ms, self.fenced,
            self.limit, self.retries, entry, max(0, math.ceil(patience * 1000)), self.fair, again,
        )  # fmt: skip

    def start(self) -> None:
        self.engine.send(self.request(self.again))

    def request(self, again: bool) -> Single:
        """The script's call; sent again after a lost reply as a later step (``again``),
        which recognises the lock it was granted and the place it took."""
        extra = (
            1 if self.fenced else 0, self.limit, self.entry, self.patience, 1 if self.fair else 0,
            1 if again else 0,
        )  # fmt: skip
        payload = self.core.encode_acquire([self.key], [self.value], self.ms, QUEUE_SHA, extra)
        return Single(self, self.target, payload, True)

    def retry_form(self) -> Single:  # type: ignore[override]  # (AcquireOne's is a window)
        return self.request(True)

    def answer(self, request: Any, replies: list[Any]) -> None:
        reply = replies[0]
        if type(reply) is list:
            self.finish(reply[0])
        elif reply is None:
            self.finish(None)
        elif type(reply) is errors.ReplyError:
            self.fail(errors.reply_error(reply.message, command="EVALSHA", key=self.key))
        else:
            self.finish(self.lease(reply))

    def granted(self, payload: bytes) -> Any:
        """The lease a hand-off message grants (``payload`` is the acquire's reply)."""
        reply: Any = int(payload) if payload.isdigit() else payload
        lease = self.lease(reply)
        lease._handed_over = True
        return lease

    def undo(self) -> None:
        if type(self.result) is int and self.patience > 0:  # queued: leave the queue
            leave = self.step(self.entry, 0, True)
            leave.abandoned = True
            self.engine.spawn(leave)
        else:
            super().undo()


def waiting(first: QueueOne, patience: float) -> Generator[Any, Any, Any]:
    """A plan: ``first``'s acquire queued for up to ``patience`` seconds, until a release
    hands it the lock (a message), the lock would expire (its first waiter looks
    again then), or the wait ends (a last step that leaves the queue). A Lease or None.
    """
    deadline = time.monotonic() + patience
    key = first.key
    wakeups: Wakeups | None = yield Listen(first.target, lazy=True, key=key)
    if wakeups is None:
        # Not listening yet: a try that does not queue first, so that a client whose
        # locks are free when it waits never opens a subscription.
        got = yield first.step(b"", 0, False)
        if got is not None:
            return got
        wakeups = yield Listen(first.target, key=key)
    listened = wakeups.sessions  # the subscription this waiter queued under
    slot = wakeups.slot(wakeups.sharded_channel(key))
    counter = first.core.fence_key(first.key) if first.fenced else b"0"
    until = time.time() + patience + CLOCK_MARGIN  # wall-clock, as the scripts compare it
    entry = wakeups.entry(slot, until, first.ms, counter, first.limit, first.value)
    again = relistened = ended = False
    step = first
    try:
        while True:
            left = deadline - time.monotonic()
            step = first.step(entry, left, again)
            got = yield step
            if type(got) is not int:  # a Lease, or None once the wait is over (it left)
                ended = True
                return got
            again = True
            if got == -3 and not relistened:  # the server has no subscription of ours
                relistened = True
                yield Listen(first.target, again=True, stale=listened, key=key)
                listened = wakeups.sessions
                continue
            relistened = False
            # The first waiter looks again when the lock would expire. The others look
            # again within about their own ttl (a lock whose holder died frees at its
            # ttl, which is often theirs too), and at least every SAFETY seconds.
            own = first.ms / 1000 if first.ms else SAFETY  # 0: compat's lock without a timeout
            pause = min(SAFETY, max(own, MIN_RECHECK)) * random.uniform(1.0, 1.5)
            if got >= 0:
                pause = min(pause, got / 1000 + 0.001)
            # The time left now, not before the step's round trip: a slow one (a first
            # subscription, a busy machine) would otherwise carry the wait past its end.
            left = deadline - time.monotonic()
            message = yield Park(slot, min(pause, max(0.0, left)), step.step(entry, 0, True))
            if message:
                if metrics.recorder is not None:
                    metrics.recorder.handed_over()
                lease = step.granted(message)
                # Handed over by another client's release, at a time not known here but
                # after this waiter's last step was sent: its deadline counts from that
                # send. When that leaves it less than half its ttl (a long wait), an
                # extend sent now gives it its whole deadline; should the lock have expired
                # before (this caller was paused past the ttl), the wait goes on.
                if first.ms and lease._deadline - time.monotonic() < first.ms / 2000:
                    lease._deadline = 0.0  # not known until the extend says
                    extend = ScriptOne(lease, first.target, first.core, EXTEND, first.ms, first.retries)
                    if not (yield extend):
                        again = False
                        continue
                ended = True
                return lease
    finally:
        wakeups.drop(slot, None if ended else step.step(entry, 0, True))
