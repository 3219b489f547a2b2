"""``joblock web`` with a million locks held: the first page's time, and Redis kept free.

    python benchmarks/web_first_page.py [--locks 1000000] [--page-size 100] [--rounds 20] [--fifo] [--json]

Starts a throwaway redis-server, takes ``--locks`` locks with ``Locks.acquire_many``
(``joblock:BenchJob<i % 20>:<i>``, an hour of ttl), then runs the real ``joblock web``
command against it and fetches, ``--rounds`` times each over a fresh HTTP connection as a
browser would:

- the first page: the HTML, then its first page of locks as JSON (the sum is what a
  person waits for before the table shows);
- a filtered first page (``BenchJob7:*``, one key in 20);
- a page deep in the scan (the one after 50 "next page"s);
- a filter that matches nothing, which scans until its time budget is spent.

How long Redis was blocked is measured two ways, both over every fetch above:

- SLOWLOG with ``slowlog-log-slower-than 0`` logs every command with the time Redis spent
  executing it; the longest of the page's commands (SCAN, TYPE, GET, PTTL, ZRANGE, TIME,
  LRANGE) is the longest any one of them kept every other client waiting.
- A prober process sends a PING every half millisecond on its own connection the whole
  time and records each round trip: the longest is what a job's command waited at worst
  while the page read, pipelined batches and the machine's own scheduling included (an
  upper bound). The prober then runs as long again with no page being read: the
  machine's own noise.

Both count wall-clock time: a redis-server that the OS pauses mid-command (other
processes on a small machine) shows as a slow command, which is why percentiles come
with each maximum. ``--fifo`` runs the redis-server under SCHED_FIFO (Linux, as root),
so that nothing else on the machine pauses it: what is left is Redis's own work.

For scale, one ``KEYS joblock:*`` over the same keys (what the page never sends) is run
at the end, its time read from SLOWLOG too. Nothing here asserts: it measures and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any

import joblock
from joblock._tools.admin import Node
from joblock._tools.servers import RedisServer
from joblock.settings import parse_url

PAGE_COMMANDS = {"scan", "type", "get", "pttl", "zrange", "time", "lrange"}

# A PING every 0.5 ms on one connection until stdin closes; then the round trips (µs),
# sorted. It sleeps between probes: a process that never sleeps is the first one the OS
# sets aside on a busy machine, and its round trips would measure that instead of Redis.
PROBER = r"""
import socket, sys, threading, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
rtts = []
while not done.is_set():
    t = time.perf_counter()
    sock.sendall(b"*1\r\n$4\r\nPING\r\n")
    assert sock.recv(64) == b"+PONG\r\n"
    rtts.append((time.perf_counter() - t) * 1e6)
    time.sleep(0.0005)
print(" ".join(f"{x:.0f}" for x in sorted(rtts)))
"""


def probe(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBER, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def stop(prober: subprocess.Popen[str]) -> dict[str, float]:
    """Stops the prober; its round trips' quantiles (µs)."""
    rtts = [float(x) for x in prober.communicate("", timeout=60)[0].split()]
    return {
        "probes": len(rtts),
        "median_us": rtts[len(rtts) // 2],
        "p99_us": rtts[int(len(rtts) * 0.99)],
        "p999_us": rtts[int(len(rtts) * 0.999)],
        "max_us": rtts[-1],
    }


def fill(url: str, n: int) -> float:
    """Takes ``n`` locks in batches; seconds it took."""
    locks = joblock.Locks(url, prefix="joblock")
    started = time.perf_counter()
    for start in range(0, n, 100_000):
        keys = [f"joblock:BenchJob{i % 20}:{i}" for i in range(start, min(n, start + 100_000))]
        assert all(locks.acquire_many(keys, 3600))
    locks.close()
    return time.perf_counter() - started


def fetch(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read()
    return time.perf_counter() - started, body


def page(base: str, match: str = "", cursor: str = "") -> tuple[float, dict[str, Any]]:
    elapsed, body = fetch(f"{base}/api/locks?" + urllib.parse.urlencode({"match": match, "cursor": cursor}))
    return elapsed, json.loads(body)


def ms(samples: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(samples) * 1000, 1),
        "max_ms": round(max(samples) * 1000, 1),
    }


def measure(base: str, rounds: int) -> dict[str, Any]:
    first, html, json_only, filtered, deep, nothing = [], [], [], [], [], []
    keys: dict[str, int] = {}
    for _ in range(rounds):
        t_html, _ = fetch(base + "/")
        t_json, data = page(base)
        html.append(t_html)
        json_only.append(t_json)
        first.append(t_html + t_json)
        keys["first"] = data["keys"]
        t, data = page(base, "BenchJob7:*")
        filtered.append(t)
        keys["filtered"] = data["keys"]
        t, data = page(base, "NoSuchJob")
        nothing.append(t)
        keys["nothing"] = data["keys"]
    cursor = ""
    for _ in range(50):
        cursor = page(base, cursor=cursor)[1]["next"]
    for _ in range(rounds):
        t, data = page(base, cursor=cursor)
        deep.append(t)
        keys["deep"] = data["keys"]
    return {
        "first_page": ms(first),
        "first_page_html": ms(html),
        "first_page_json": ms(json_only),
        "filtered_first_page": ms(filtered),
        "page_51": ms(deep),
        "filter_matching_nothing": ms(nothing),
        "keys_per_page": keys,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--locks", type=int, default=1_000_000)
    parser.add_argument("--page-size", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--fifo", action="store_true", help="run redis-server under SCHED_FIFO (root)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    with RedisServer() as server:
        filled = fill(server.url, args.locks)
        node = Node(parse_url(server.url))
        if args.fifo:
            pid = int(re.search(rb"process_id:(\d+)", node.call("INFO", "server")).group(1))  # type: ignore[union-attr]
            os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(50))
        node.calls([
            ("CONFIG", "SET", "slowlog-log-slower-than", "0"),
            ("CONFIG", "SET", "slowlog-max-len", "1000000"),
        ])  # fmt: skip
        command = subprocess.Popen(
            [sys.executable, "-m", "joblock", "web", "--port", "0", "--page-size", str(args.page_size)],
            env={**os.environ, "REDIS_URL": server.url},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            banner = command.stdout.readline()  # type: ignore[union-attr]
            found = re.search(r" on (http://\S+?)/ ", banner)
            assert found, banner
            base = found.group(1)
            fetch(base + "/static/web.js")  # the command's imports and first connection, before timing
            prober = probe(server.port)
            node.call("SLOWLOG", "RESET")
            started = time.perf_counter()
            results = measure(base, args.rounds)
            measured = time.perf_counter() - started
            paging = stop(prober)  # first: reading a long SLOWLOG back keeps Redis busy itself
            entries = node.call("SLOWLOG", "GET", -1)
        finally:
            command.terminate()
            command.wait(30)
        prober = probe(server.port)
        time.sleep(measured)
        idle = stop(prober)
        page_commands = sorted(
            (e for e in entries if e[3][0].decode().lower() in PAGE_COMMANDS), key=lambda e: e[2]
        )
        node.call("SLOWLOG", "RESET")
        node.call("KEYS", "joblock:*")
        keys_us = next(e[2] for e in node.call("SLOWLOG", "GET", -1) if e[3][0].lower() == b"keys")
        info = node.call("INFO", "server").decode()
        node.close()

    longest = page_commands[-1]
    results.update({
        "locks": args.locks,
        "page_size": args.page_size,
        "rounds": args.rounds,
        "fill_s": round(filled, 1),
        "redis_sched_fifo": args.fifo,
        "redis": re.search(r"redis_version:(\S+)", info).group(1),  # type: ignore[union-attr]
        "page_commands_logged": len(page_commands),
        "page_commands_p99_us": page_commands[int(len(page_commands) * 0.99)][2],
        "page_commands_p999_us": page_commands[int(len(page_commands) * 0.999)][2],
        "page_commands_over_1ms": sum(e[2] > 1000 for e in page_commands),
        "longest_page_command_us": longest[2],
        "longest_page_command": " ".join(a.decode(errors="replace") for a in longest[3][:6]),
        "ping": {"while paging": paging, "with no page read": idle},
        "keys_command_ms": round(keys_us / 1000, 1),
        "cpus": os.cpu_count(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    })  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"joblock web, {args.locks:,} locks held (filled in {results['fill_s']} s), pages of "
        f"{args.page_size} keys, Redis {results['redis']}, {results['cpus']} CPUs "
        f"(load {results['load_average']}); {args.rounds} rounds"
        + ("; redis-server under SCHED_FIFO" if args.fifo else "")
    )
    names = ["first_page", "first_page_html", "first_page_json", "filtered_first_page", "page_51"]
    for name in [*names, "filter_matching_nothing"]:
        r = results[name]
        print(f"  {name.replace('_', ' '):<28} median {r['median_ms']:>7.1f} ms   max {r['max_ms']:>7.1f} ms")
    print(f"  keys per page: {results['keys_per_page']}")
    print(
        f"  the page's commands in Redis: p99 {results['page_commands_p99_us']} µs, "
        f"p99.9 {results['page_commands_p999_us']} µs, "
        f"{results['page_commands_over_1ms']} of {results['page_commands_logged']:,} over 1 ms, "
        f"longest {results['longest_page_command_us']} µs ({results['longest_page_command']})"
    )
    for when, q in results["ping"].items():
        print(
            f"  PING round trips {when}: median {q['median_us']:.0f} µs, p99 {q['p99_us']:.0f} µs, "
            f"p99.9 {q['p999_us']:.0f} µs, max {q['max_us']:.0f} µs ({q['probes']:,} probes)"
        )
    print(
        f"  for scale, one KEYS joblock:* (never sent by the page): {results['keys_command_ms']} ms in Redis"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
