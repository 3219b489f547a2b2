"""Lost means stopped, measured (issue 34's targets): late writes, stop latency, operator release.

    python scripts/lost_run.py                      # 1,000 trials per strategy, both cores
    python scripts/lost_run.py --trials 50 --core pure

Three processes per core (the pure one runs with JOBLOCK_NO_EXTENSIONS=1):

- this one, the *orchestrator*: the lock's redis-server, a fault proxy in front of it,
  a second redis-server that is the guarded resource's *recorder*, and the *second
  client*, which takes each key once it expires;
- a *holder* process (``--holder STRATEGY``): a job with ``auto_renew`` and
  ``on_lost=STRATEGY`` per key, reaching the lock's Redis through the proxy, whose work
  is a loop of writes to the recorder (in raw RESP, no client library between
  the work and its cancellation or interrupt) and a little Python between them. For
  ``"exit"`` each job runs in a child the holder forks, as a forked worker does.

A trial: the holder's jobs start; at a random moment mid-job the proxy stalls (Redis
unreachable for the holder; ``--fault sigstop`` stops the lock's redis-server instead)
and the second client tries each key until it gets it, with SET NX PX (what joblock's
acquire sends) in a script that also reads the lock server's clock at the grant. Each
write of the holder is a script on the recorder that reads the recorder's clock, and
carries the holder's clock when it was sent. Both servers run on this host and read its
clock: a write is *late* when it landed after the grant, and *sent late* when the
holder sent it after the grant (a write sent before but landing after was in flight:
what fencing, not ``on_lost``, protects a store from).

Stop latency: from the lease's deadline (read by the holder from its lease) to the
work's loop ending with the exception, on one monotonic clock shared by the processes.
Release latency: from just before ``joblock release``'s admin call (``admin.release``)
to the holder's ``"cancel"`` (and ``"interrupt"``) block ending.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# The fault proxy lives in the test rig, beside the suite.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

STRATEGIES = ("cancel", "interrupt", "exit")
SPIN = 200  # Python steps between two writes (tens of microseconds)


# -- the recorder: raw RESP to a Redis that is not the lock's ------------------------------


def resp(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def log_key(key: str) -> str:
    return f"log:{key}"


def recorder_socket(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# A write to the guarded resource: the recorder's clock (this host's, in microseconds)
# pushed on the key's log, read in the same script, so it is when the write happened.
# With it, the holder's clock when it sent the write (monotonic microseconds): a write
# that lands late may have been sent before the holder stopped (in flight).
WRITE = (
    "local t = redis.call('TIME') "
    "return redis.call('RPUSH', KEYS[1], t[1] .. string.format('%06d', t[2]) .. ':' .. ARGV[1])"
)
# The second client's grant: SET NX PX, as joblock's acquire sends it, and the lock
# server's clock at the grant (the same host's clock as the recorder's).
TAKE = (
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then "
    "local t = redis.call('TIME') return t[1] .. string.format('%06d', t[2]) end return false"
)


def read_reply(sock: socket.socket, buffer: bytearray) -> bytes | None:
    """One RESP reply (an integer, status, bulk or nil) from ``sock``: its payload."""
    while b"\r\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        buffer += chunk
    end = buffer.index(b"\r\n")
    head = bytes(buffer[:end])
    if head[:1] != b"$":
        del buffer[: end + 2]
        if head[:1] == b"-":
            raise RuntimeError(head.decode())
        return head[1:]
    size = int(head[1:])
    if size < 0:
        del buffer[: end + 2]
        return None
    while len(buffer) < end + 2 + size + 2:
        buffer += sock.recv(4096)
    body = bytes(buffer[end + 2 : end + 2 + size])
    del buffer[: end + 2 + size + 2]
    return body


def call(sock: socket.socket, command: bytes) -> bytes | None:
    sock.sendall(command)
    return read_reply(sock, bytearray())


def spin() -> int:
    total = 0
    for i in range(SPIN):
        total += i
    return total


# -- the holder ---------------------------------------------------------------------------


def sync_job(
    locks: Any, key: str, strategy: str, ttl: float, port: int, ready: Any, auto_renew: bool
) -> dict:
    import joblock

    sock = recorder_socket(port)
    logged = log_key(key)
    info: dict[str, Any] = {"key": key}

    @locks.job(ttl=ttl, auto_renew=auto_renew, on_lost=strategy, key=lambda: key, on_expired=lambda: None)
    def job() -> None:
        lease = joblock.current_lease()
        ready()
        try:
            while True:
                call(sock, resp("EVAL", WRITE, "1", logged, str(time.monotonic_ns() // 1000)))
                spin()
        except BaseException:
            info["stopped"] = time.monotonic()
            info["deadline"] = lease._deadline if lease is not None else None
            raise

    try:
        job()
        info["outcome"] = "finished" if "deadline" in info else "not acquired"
    except joblock.LockLost as error:
        info["outcome"] = error.cause
    except Exception as error:  # reported, not hidden
        info["outcome"] = repr(error)
    finally:
        if "deadline" not in info and "stopped" not in info:
            ready()  # never held: the round must not wait for it
    sock.close()
    return info


async def async_job(locks: Any, key: str, ttl: float, port: int, ready: Any, auto_renew: bool) -> dict:
    import joblock

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    logged = log_key(key)
    info: dict[str, Any] = {"key": key}

    @locks.job(ttl=ttl, auto_renew=auto_renew, on_lost="cancel", key=lambda: key, on_expired=lambda: None)
    async def job() -> None:
        lease = joblock.current_lease()
        ready()
        try:
            while True:
                writer.write(
                    resp("EVAL", WRITE, "1", logged, str(time.monotonic_ns() // 1000))
                )  # sent now; the reply is awaited (where a cancellation lands)
                await reader.readuntil(b"\r\n")  # an integer reply
                spin()
        except BaseException:
            info["stopped"] = time.monotonic()
            info["deadline"] = lease._deadline if lease is not None else None
            raise

    try:
        await job()
        info["outcome"] = "finished" if "deadline" in info else "not acquired"
    except joblock.LockLost as error:
        info["outcome"] = error.cause
    except Exception as error:
        info["outcome"] = repr(error)
    finally:
        if "deadline" not in info and "stopped" not in info:
            ready()
    writer.close()
    return info


def holder(args: argparse.Namespace) -> None:
    """Runs rounds told on stdin (a JSON line of keys), says "ready" once every job holds
    its lock, and, on "report", what each job did."""
    import logging

    import joblock
    from joblock.aio import AsyncLocks

    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    out = sys.stdout

    def say(message: Any) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    lines = iter(sys.stdin.readline, "")
    if args.holder == "cancel":
        loop = asyncio.new_event_loop()
        alocks = loop.run_until_complete(_make_async(AsyncLocks, args))
        for line in lines:
            keys = json.loads(line)["keys"]
            started = asyncio.Event()
            count = [0]

            def one_ready(
                count: list[int] = count, started: asyncio.Event = started, n: int = len(keys)
            ) -> None:
                count[0] += 1
                if count[0] == n:
                    started.set()

            tasks = [
                loop.create_task(async_job(alocks, key, args.ttl, args.recorder, one_ready, args.renew))
                for key in keys
            ]
            loop.run_until_complete(started.wait())
            say("ready")
            # The jobs run on while the orchestrator waits; its "report" line comes on stdin.
            reported = loop.run_until_complete(_report_when_told(tasks))
            say(reported)
        loop.run_until_complete(alocks.close())
        return
    if args.holder == "interrupt":
        locks = joblock.Locks(args.lock_url, prefix=args.prefix)
        for line in lines:
            keys = json.loads(line)["keys"]
            results: list[dict] = []
            barrier = threading.Semaphore(0)
            threads = [
                threading.Thread(
                    target=lambda key=key, results=results, barrier=barrier: results.append(
                        sync_job(
                            locks, key, "interrupt", args.ttl, args.recorder, barrier.release, args.renew
                        )
                    )
                )
                for key in keys
            ]
            for thread in threads:
                thread.start()
            for _ in keys:
                barrier.acquire()
            say("ready")
            sys.stdin.readline()
            for thread in threads:
                thread.join()
            say(results)
        return
    # "exit": each job in a forked child, as RQ's work horse or Celery's prefork child.
    for line in lines:
        keys = json.loads(line)["keys"]
        readers, writers = os.pipe()
        children = {}
        for key in keys:
            pid = os.fork()
            if pid == 0:
                os.close(readers)
                try:
                    locks = joblock.Locks(args.lock_url, prefix=args.prefix)
                    sync_job(
                        locks,
                        key,
                        "exit",
                        args.ttl,
                        args.recorder,
                        lambda writers=writers: os.write(writers, b"r"),
                        args.renew,
                    )
                finally:
                    os._exit(3)  # the job ended without exiting at its loss
            children[pid] = key
        os.close(writers)
        got = b""
        while len(got) < len(keys):
            chunk = os.read(readers, 64)
            if not chunk:
                break
            got += chunk
        os.close(readers)
        say("ready")
        sys.stdin.readline()
        results = []
        for pid, key in children.items():
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            results.append({"key": key, "outcome": "exit" if code == 75 else f"status {code}"})
        say(results)


async def _make_async(cls: Any, args: argparse.Namespace) -> Any:
    return cls(args.lock_url, prefix=args.prefix)


async def _report_when_told(tasks: list[asyncio.Task]) -> list[dict]:
    await asyncio.to_thread(sys.stdin.readline)
    return list(await asyncio.gather(*tasks))


# -- the orchestrator ---------------------------------------------------------------------


class Holder:
    def __init__(
        self, strategy: str, lock_url: str, recorder: int, prefix: str, ttl: float, renew: bool
    ) -> None:
        # Open while the holder runs (its stderr): kept for a look when a round fails.
        self.log = tempfile.NamedTemporaryFile(prefix=f"lost-run-{strategy}-", suffix=".log", delete=False)  # noqa: SIM115
        command = [sys.executable, __file__, "--holder", strategy, "--lock-url", lock_url]
        command += ["--recorder", str(recorder), "--prefix", prefix, "--ttl", str(ttl)]
        command += [] if renew else ["--no-renew"]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )

    def tell(self, message: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def hear(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the holder ended: see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(30)


def writes_after(recorder: socket.socket, key: str, granted: int | None, offset: float) -> dict[str, int]:
    """The holder's writes (``writes``), those that landed after the second client's grant
    (``late``), and of these the ones sent after it (``sent_late``, by the holder's clock:
    ``offset`` is wall minus monotonic); the key's log is cleared."""
    buffer = bytearray()
    recorder.sendall(resp("LRANGE", log_key(key), "0", "-1") + resp("DEL", log_key(key)))
    while b"\r\n" not in buffer:
        buffer += recorder.recv(65536)
    end = buffer.index(b"\r\n")
    count = int(buffer[1:end])
    del buffer[: end + 2]
    stamps = []
    for _ in range(count):
        entry = read_reply(recorder, buffer)
        assert entry is not None
        landed, sent = entry.split(b":")
        stamps.append((int(landed), int(sent) + int(offset * 1e6)))
    read_reply(recorder, buffer)  # DEL's
    late = [] if granted is None else [sent for landed, sent in stamps if landed > granted]
    return {
        "writes": len(stamps),
        "late": len(late),
        "sent_late": sum(1 for sent in late if granted is not None and sent > granted),
    }


def loss_round(ctx: dict, holder: Holder, keys: list[str], ttl: float, fault: str) -> list[dict]:
    """One round: the jobs hold, the fault comes mid-job, the second client takes each key."""
    proxy, server, recorder = ctx["proxy"], ctx["server"], ctx["recorder"]
    holder.tell({"keys": keys})
    assert holder.hear() == "ready"
    time.sleep(random.uniform(0.2, 0.6) * ttl)  # mid-job: between renewals, anywhere
    if fault == "proxy":
        proxy.stall(60.0)
    else:
        os.kill(server.process.pid, signal.SIGSTOP)
        time.sleep(ttl + random.uniform(0.0, 0.02))  # past the lock's expiry in Redis
        os.kill(server.process.pid, signal.SIGCONT)
    take = {key: resp("EVAL", TAKE, "1", key, f"second-{os.getpid()}", "60000") for key in keys}
    granted: dict[str, int] = {}
    give_up = time.monotonic() + 10 * ttl + 5
    while len(granted) < len(keys) and time.monotonic() < give_up:
        for key in keys:
            if key not in granted:
                stamp = call(ctx["direct"], take[key])
                if stamp is not None:
                    granted[key] = int(stamp)
    proxy.heal()
    holder.tell("report")
    results = holder.hear()
    ctx["direct"].sendall(b"".join(resp("DEL", key) for key in granted))
    replies = bytearray()
    for _ in granted:
        read_reply(ctx["direct"], replies)
    offset = time.time() - time.monotonic()  # the recorder's clock less the holder's
    for info in results:
        if info["key"] not in granted:
            info["outcome"] = f"never taken ({info['outcome']})"
        info.update(writes_after(recorder, info["key"], granted.get(info["key"]), offset))
        if info["key"] in granted:
            info["granted"] = granted[info["key"]] / 1e6 - offset
    return results


def release_round(ctx: dict, holder: Holder, keys: list[str]) -> list[dict]:
    """One round of operator releases: each key released while its job works."""
    from joblock._tools import admin

    holder.tell({"keys": keys})
    assert holder.hear() == "ready"
    released = {}
    for key in keys:
        time.sleep(random.uniform(0.005, 0.02))
        with contextlib.redirect_stdout(io.StringIO()):
            released[key] = time.monotonic()
            admin.release(ctx["server"].url, key)
    time.sleep(0.05)
    holder.tell("report")
    results = holder.hear()
    for info in results:
        info["released"] = released[info["key"]]
        writes_after(ctx["recorder"], info["key"], None, 0.0)  # cleared
    return results


def stats(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"n": len(values), "min_ms": ordered[0] * 1e3, "median_ms": statistics.median(values) * 1e3,
            "p99_ms": p99 * 1e3, "max_ms": ordered[-1] * 1e3}  # fmt: skip


def run_core(args: argparse.Namespace) -> dict:
    import joblock
    from joblock._core import core
    from joblock._tools.servers import RedisServer
    from rig.faults import FaultProxy

    report: dict[str, Any] = {"core": core.__name__.rsplit(".", 1)[-1], "ttl": args.ttl, "fault": args.fault}
    with RedisServer() as server, RedisServer() as store, FaultProxy(server.port) as proxy:
        recorder = recorder_socket(store.port)
        prefix = f"lostrun{os.getpid()}"
        locks = joblock.Locks(server.url, prefix=prefix)
        ctx = {
            "locks": locks,
            "proxy": proxy,
            "server": server,
            "recorder": recorder,
            "direct": recorder_socket(server.port),
        }
        lock_url = proxy.url if args.fault == "proxy" else server.url
        for strategy in args.strategies:
            holder = Holder(strategy, lock_url, store.port, prefix, args.ttl, renew=True)
            results: list[dict] = []
            started = time.monotonic()
            try:
                done = 0
                while done < args.trials:
                    keys = [
                        f"{prefix}:{strategy}:{done + i}"
                        for i in range(min(args.parallel, args.trials - done))
                    ]
                    results += loss_round(ctx, holder, keys, args.ttl, args.fault)
                    done += len(keys)
            finally:
                holder.close()
            outcomes: dict[str, int] = {}
            for info in results:
                outcomes[info["outcome"]] = outcomes.get(info["outcome"], 0) + 1
            latencies = [
                i["stopped"] - i["deadline"] for i in results if i.get("stopped") and i.get("deadline")
            ]
            report[strategy] = {
                "trials": len(results),
                "late_writes": sum(i["late"] for i in results),
                "trials_with_late_writes": sum(1 for i in results if i["late"]),
                "late_writes_sent_after_grant": sum(i["sent_late"] for i in results),
                "writes": sum(i["writes"] for i in results),
                "outcomes": outcomes,
                "stop_after_deadline": stats(latencies),
                # The second client's grant after the holder's deadline (never before: the
                # deadline is within the lock's expiry in Redis), on the holder's clock.
                "grant_after_deadline": stats(
                    [i["granted"] - i["deadline"] for i in results if i.get("granted") and i.get("deadline")]
                ),
                "seconds": round(time.monotonic() - started, 1),
                "late_trials": [i for i in results if i["late"]][:20],
            }
            print(f"{report['core']} {strategy}: {json.dumps(report[strategy])}", file=sys.stderr, flush=True)
        for strategy in ("cancel", "interrupt"):
            if strategy not in args.strategies or not args.release_trials:
                continue
            holder = Holder(strategy, server.url, store.port, prefix, 60.0, renew=False)
            results = []
            try:
                done = 0
                while done < args.release_trials:
                    n = min(args.parallel, args.release_trials - done)
                    results += release_round(
                        ctx, holder, [f"{prefix}:release-{strategy}:{done + i}" for i in range(n)]
                    )
                    done += n
            finally:
                holder.close()
            latencies = [i["stopped"] - i["released"] for i in results if i.get("stopped")]
            report[f"release_{strategy}"] = {
                "trials": len(results),
                "outcomes": sorted({i["outcome"] for i in results}),
                "stop_after_release": stats(latencies),
            }
            print(f"{report['core']} release {strategy}: {json.dumps(report[f'release_{strategy}'])}",
                  file=sys.stderr, flush=True)  # fmt: skip
        recorder.close()
        locks.close()
    return report


def table(reports: list[dict]) -> str:
    rows = ["| strategy | core | trials | late writes (trials) | of them sent late | stop after deadline: "
            "median / p99 / max (ms) |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for report in reports:
        for strategy in STRATEGIES:
            row = report.get(strategy)
            if not row:
                continue
            s = row["stop_after_deadline"]
            latency = (
                f"{s['median_ms']:.2f} / {s['p99_ms']:.2f} / {s['max_ms']:.2f}" if s else "(process exits)"
            )
            late = f"{row['late_writes']} ({row['trials_with_late_writes']})"
            sent = row["late_writes_sent_after_grant"]
            rows.append(f"| {strategy} | {report['core']} | {row['trials']} | {late} | {sent} | {latency} |")
    rows += ["", "| operator release | core | trials | stop after release: median / p99 / max (ms) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for report in reports:
        for strategy in ("cancel", "interrupt"):
            row = report.get(f"release_{strategy}")
            if row and row["stop_after_release"]:
                s = row["stop_after_release"]
                timing = f"{s['median_ms']:.2f} / {s['p99_ms']:.2f} / {s['max_ms']:.2f}"
                rows.append(f"| {strategy} | {report['core']} | {row['trials']} | {timing} |")
    return "\n".join(rows)


def main() -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1)  # kill -USR1 shows where a stuck process is
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=1000, help="trials per strategy (default 1000)")
    parser.add_argument(
        "--release-trials", type=int, default=None, help="operator releases (default: --trials)"
    )
    parser.add_argument("--ttl", type=float, default=0.3, help="the jobs' ttl in seconds (default 0.3)")
    parser.add_argument("--parallel", type=int, default=4, help="jobs per round (default 4)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (default all)")
    parser.add_argument("--fault", choices=("proxy", "sigstop"), default="proxy")
    parser.add_argument("--core", choices=("compiled", "pure", "both"), default="both")
    parser.add_argument("--json", help="write the reports here too")
    parser.add_argument("--holder", help=argparse.SUPPRESS)
    parser.add_argument("--lock-url", help=argparse.SUPPRESS)
    parser.add_argument("--recorder", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--no-renew", dest="renew", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("--one-core", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.holder:
        holder(args)
        return
    args.strategies = [s for s in args.strategies.split(",") if s]
    if args.release_trials is None:
        args.release_trials = args.trials
    if args.one_core:
        print(json.dumps(run_core(args)))
        return
    reports = []
    for core in ("compiled", "pure") if args.core == "both" else (args.core,):
        env = dict(os.environ, JOBLOCK_NO_EXTENSIONS="1" if core == "pure" else "0")
        argv = [
            a for a in sys.argv[1:] if not a.startswith("--core") and a not in ("compiled", "pure", "both")
        ]
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--one-core"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(table(reports))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(reports, out, indent=1)


if __name__ == "__main__":
    main()
