"""A loopback TCP proxy in front of a Redis server that injects network faults.

The tests use it to cut one connection at a chosen byte of the replies (a reply lost
whole, or broken off after a few bytes); the chaos run (``rig.chaos``) to
add latency with jitter, hold all traffic for seconds, and reset connections in the
middle of a reply, while its clients go on taking locks.

Each proxy runs an asyncio loop in a thread of its own. Every connection is four
tasks: a reader and a writer per direction, with a queue between them, so that added
latency delays each chunk without delaying the ones behind it (they keep their order:
a chunk is never written before the one read before it). Faults act in the writers:
a stall holds every writer until it ends, a cut or a reset ends the connection when
the next reply chunk reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["FaultProxy"]

T = TypeVar("T")


class _Link:
    """One proxied connection: its two streams, and where its replies are to be cut."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.sent = 0  # bytes of replies that went back to the client
        self.limit: int | None = None  # cut (FIN) once ``sent`` reaches it
        self.reset = False  # reset (RST) inside the next reply chunk
        self.closed = False


class FaultProxy:
    """Forwards loopback TCP to Redis at ``port`` and injects faults on demand.

    ``after`` and ``cuts``: cuts each of the first ``cuts`` connections once ``after``
    bytes of replies have gone back to the client (mid-reply, as a network failure
    would). With ``after=0`` the commands reach Redis and run, and the first reply is
    lost whole; with ``after=None`` nothing is cut until ``cut_after``. ``cut`` counts
    the connections cut so, ``connections`` those accepted.

    The chaos run's faults: ``delay`` (latency with jitter), ``stall`` (all traffic
    held for seconds), ``reset`` (connections reset inside a reply). ``injected``
    counts what each did.
    """

    def __init__(self, port: int, after: int | None = None, cuts: int = 1, seed: int | None = None) -> None:
        self.upstream = port
        self.after = after
        self.cuts_left = cuts if after is not None else 0
        self.cut = 0
        self.connections = 0
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._links: list[_Link] = []
        self._latency = (0.0, 0.0)
        self._stall_end = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="joblock-fault-proxy", daemon=True
        )
        self._thread.start()
        self._server = self._run(self._listen())

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs ``coroutine`` on the proxy's loop; its result, once done."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._accept, sock=self.listener)

    # -- faults, called from any thread ------------------------------------------------

    def cut_after(self, after: int, cuts: int = 1) -> None:
        """From here on, cuts ``cuts`` connections (the open one first, then new ones)
        once ``after`` more bytes of replies have gone back on each: counted from now, so
        the replies before (whose size differs with the server's version) do not matter."""

        async def arm() -> None:
            self.after = after
            self.cuts_left = cuts
            for link in self._links:
                if self.cuts_left and not link.closed:
                    self.cuts_left -= 1
                    link.limit = link.sent + after

        self._run(arm())

    def delay(self, mean: float, jitter: float = 0.0) -> None:
        """Holds every chunk, both ways, ``mean`` ± ``jitter`` seconds (uniform) from
        now on; ``delay(0)`` ends it."""

        async def set_latency() -> None:
            self._latency = (mean, jitter)
            if mean > 0:
                self.injected["latency"] += 1

        self._run(set_latency())

    def stall(self, seconds: float) -> None:
        """Holds all traffic, both ways, for ``seconds`` (a black hole that heals): new
        connections are accepted, nothing they send or are sent moves until it ends."""

        async def hold() -> None:
            self.injected["stall"] += 1
            end = self._loop.time() + seconds
            if end > self._stall_end:
                self._stall_end = end
                self._flowing.clear()
                self._loop.call_at(end, self._flow_if_over)

        self._run(hold())

    def _flow_if_over(self) -> None:
        if self._loop.time() >= self._stall_end:
            self._flowing.set()

    def reset(self, connections: int = 1) -> int:
        """Resets up to ``connections`` open connections, chosen at random, inside the
        next reply chunk each receives (the client gets part of it, then a RST); how
        many were chosen."""

        async def arm() -> int:
            open_links = [link for link in self._links if not link.closed and not link.reset]
            chosen = self._rng.sample(open_links, min(connections, len(open_links)))
            for link in chosen:
                link.reset = True
            return len(chosen)

        return self._run(arm())

    def heal(self) -> None:
        """Ends every fault in progress: no latency, no stall, no armed reset or cut."""

        async def clear() -> None:
            self._latency = (0.0, 0.0)
            self._stall_end = 0.0
            self._flowing.set()
            self.cuts_left = 0
            for link in self._links:
                link.reset = False
                link.limit = None

        self._run(clear())

    # -- the connections ---------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        link = _Link(writer)
        if self.cuts_left:
            self.cuts_left -= 1
            link.limit = self.after
        self._links = [each for each in self._links if not each.closed]
        self._links.append(link)
        try:
            up_reader, link.upstream = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:  # the server is down: the client sees its connection refused, as it would
            self.injected["refused"] += 1
            self._close(link, reset=True)
            return
        for source, sink, replies in ((reader, link.upstream, False), (up_reader, writer, True)):
            queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
            link.tasks.append(asyncio.create_task(self._read(source, queue)))
            link.tasks.append(asyncio.create_task(self._write(link, queue, sink, replies)))

    async def _read(self, source: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        """Reads chunks and queues each with the time it is due to go on."""
        due = 0.0
        try:
            while data := await source.read(65536):
                mean, jitter = self._latency
                now = self._loop.time()
                delay = max(0.0, mean + self._rng.uniform(-jitter, jitter)) if mean else 0.0
                due = max(due, now + delay)  # never before the chunk read before it
                queue.put_nowait((due, data))
        except OSError:
            pass
        queue.put_nowait((due, b""))  # the end of this direction

    async def _write(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes]],
        sink: asyncio.StreamWriter,
        replies: bool,
    ) -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._flowing.wait()
                if not data:
                    break
                if replies and link.reset:
                    # Part of this reply, then a reset: at a random byte inside it.
                    sink.write(data[: self._rng.randrange(len(data))])
                    self.injected["reset"] += 1
                    self._close(link, reset=True)
                    return
                if replies and link.limit is not None and link.sent + len(data) >= link.limit:
                    sink.write(data[: link.limit - link.sent])
                    self.cut += 1
                    break
                sink.write(data)
                await sink.drain()
                if replies:
                    link.sent += len(data)
        except (OSError, RuntimeError):  # the peer went away (RuntimeError: written after close)
            pass
        self._close(link, reset=False)

    def _close(self, link: _Link, reset: bool) -> None:
        if link.closed:
            return
        link.closed = True
        for writer in (link.client, link.upstream):
            if writer is None:
                continue
            if reset:
                sock = writer.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0: close() sends RST instead of FIN
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
        current = asyncio.current_task()
        for task in link.tasks:
            if task is not current:
                task.cancel()

    def close(self) -> None:
        """Stops listening and ends every connection."""

        async def stop() -> None:
            self._server.close()
            self._flowing.set()
            tasks = [task for link in self._links for task in link.tasks]
            for link in self._links:
                self._close(link, reset=False)
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_closed():
            return
        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self.listener.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
