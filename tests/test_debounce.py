"""The debounce lifetime of joblock.frameworks, driven by hand as the adapters drive it.

Each enqueue (``admit``) gets a delay from the server and a ticket with a fresh token;
each message at the worker (``Run.begin``) runs only while its token is the latest.
Real redis-server, every core twin, the threaded and the asyncio clients. The workers
of Celery, RQ and Dramatiq run debounced jobs in test_celery, test_rq and test_dramatiq.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis

from joblock.aio import AsyncLocks
from joblock.cluster import ClusterLocks
from joblock.frameworks import DEBOUNCE, UNTIL_EXECUTED, Policy, Run, Ticket, admit, admit_async, admit_many


@pytest.fixture
def client(redis_server):
    made = redis.Redis.from_url(redis_server.url)
    yield made
    made.close()


def debounced(locks, **options):
    options.setdefault("ttl", 10)
    options.setdefault("debounce", 30)
    return Policy(locks, name="Reindex", lifetime=DEBOUNCE, identifier=lambda doc, rev: doc, **options)


def through_the_queue(admission):
    """The ticket as the worker reads it off the message."""
    return Ticket.load(admission.ticket.dump())


def test_a_burst_runs_once_with_the_last_arguments_and_drops_the_others(locks, client, caplog):
    caplog.set_level(logging.INFO, logger="joblock")
    p = debounced(locks)
    sent = [(("doc", rev), admit(p, ("doc", rev), {})) for rev in range(5)]
    assert all(a.send and a.verdict.countdown == 30 and a.lease is None for _, a in sent)
    assert len({a.ticket.token for _, a in sent}) == 5  # a fresh token for each enqueue
    # Nothing is held as a lock: the key is the burst's pending token and its start.
    key = p.lock_key(("doc", 0), {})
    assert client.hget(key, "t") == sent[-1][1].ticket.token
    assert 30_000 < client.pttl(key) <= 40_000  # the delay, then the ttl for the queue's lag
    ran = []
    for args, admission in sent:
        run = Run(p, through_the_queue(admission), args, {}, job_id=str(args))
        verdict = run.begin()
        if verdict is None:
            with run:
                ran.append(args)
        else:
            assert verdict.value is None and verdict.countdown is None
    assert ran == [("doc", 4)]
    assert caplog.text.count("Job superseded: Reindex with 'doc', 0") == 1
    assert caplog.text.count("Job superseded") == 4


def test_the_last_message_may_reach_the_worker_first(locks):
    p = debounced(locks)
    first, last = admit(p, ("doc", 1), {}), admit(p, ("doc", 2), {})
    assert Run(p, through_the_queue(last), ("doc", 2), {}).begin() is None
    assert Run(p, through_the_queue(first), ("doc", 1), {}).begin().countdown is None  # dropped after it


def test_an_enqueue_after_the_run_began_starts_a_new_burst(locks):
    p = debounced(locks)
    before = admit(p, ("doc", 1), {})
    run = Run(p, through_the_queue(before), ("doc", 1), {})
    assert run.begin() is None
    with run:
        during = admit(p, ("doc", 2), {})  # the run read its arguments already: this one runs too
    assert during.verdict.countdown == 30
    assert Run(p, through_the_queue(during), ("doc", 2), {}).begin() is None


def test_debounce_max_caps_the_postponement(locks, client):
    p = debounced(locks, debounce=30, debounce_max=31)
    admissions = [admit(p, ("doc", rev), {}) for rev in range(3)]
    assert admissions[0].verdict.countdown == 30
    # The burst began less than a second ago: later enqueues run at most 31 s after it.
    assert all(29 < a.verdict.countdown <= 31 for a in admissions[1:])
    key = p.lock_key(("doc", 0), {})
    # Once the cap is reached, each enqueue asks to run at once (and still supersedes).
    client.hset(key, "f", int(client.hget(key, "f")) - 31_000)
    late = admit(p, ("doc", 3), {})
    assert late.verdict.countdown == 0
    assert Run(p, through_the_queue(admissions[-1]), ("doc", 2), {}).begin() is not None
    assert Run(p, through_the_queue(late), ("doc", 3), {}).begin() is None
    # The run ended that burst: the next enqueue waits the whole window again.
    assert admit(p, ("doc", 4), {}).verdict.countdown == 30


def test_a_retry_of_the_run_is_not_superseded(locks):
    p = debounced(locks)
    admission = admit(p, ("doc", 1), {})
    run = Run(p, through_the_queue(admission), ("doc", 1), {}, job_id="j")
    assert run.begin() is None
    with run:
        retry = Ticket.load(run.retry_ticket().dump())
        run.keep()
    assert retry.token == admission.ticket.token and retry.started
    assert Run(p, retry, ("doc", 1), {}, job_id="j").begin() is None


def test_a_job_enqueued_around_the_adapter_is_debounced_at_the_worker(locks, client):
    p = debounced(locks)
    run = Run(p, None, ("doc", 1), {}, job_id="j")
    verdict = run.begin()
    assert verdict.countdown == 30  # the adapter sends it again for then, with its token
    later = Ticket.load(run.rescheduled(verdict.attempt).dump())
    assert later.token is not None and client.hget(run.key, "t") == later.token
    assert Run(p, later, ("doc", 1), {}).begin() is None
    # A direct call, where nothing can send the job again, just runs.
    assert Run(p, None, ("doc", 1), {}, can_reschedule=False).begin() is None


def test_a_message_that_outwaited_its_key_still_runs_once(locks, client, caplog):
    p = debounced(locks)
    first, last = admit(p, ("doc", 1), {}), admit(p, ("doc", 2), {})
    client.delete(p.lock_key(("doc", 1), {}))  # as if the key had expired in a backlog
    assert Run(p, through_the_queue(first), ("doc", 1), {}).begin() is None
    assert "had expired" in caplog.text
    assert Run(p, through_the_queue(last), ("doc", 2), {}).begin() is not None


def test_an_unsent_message_leaves_the_burst_to_the_one_it_superseded(locks, client):
    p = debounced(locks)
    sent = admit(p, ("doc", 1), {})
    unsent = admit(p, ("doc", 2), {})
    unsent.abandon()  # its message could not be sent
    key = p.lock_key(("doc", 1), {})
    assert client.hget(key, "t") == sent.ticket.token
    assert Run(p, through_the_queue(sent), ("doc", 1), {}).begin() is None
    alone = admit(p, ("doc", 3), {})
    alone.abandon()  # the first of a burst: nothing pending afterwards
    assert client.hget(key, "t") is None


def test_a_batch_debounces_in_order_and_leaves_other_jobs_to_their_locks(locks, client):
    p = debounced(locks)
    other = Policy(locks, name="Other", ttl=10, lifetime=UNTIL_EXECUTED)
    admissions = admit_many([(p, ("doc", 1), {}), (other, (1,), {}), (p, ("doc", 2), {})])
    assert [a.send for a in admissions] == [True, True, True]
    assert admissions[1].lease is not None
    assert client.hget(p.lock_key(("doc", 1), {}), "t") == admissions[2].ticket.token


def test_the_asyncio_client_debounces_too(core, redis_server, client):
    async def main():
        made = type("AsyncLocks", (AsyncLocks,), {"_core": core})(redis_server.url, prefix="adeb")
        p = debounced(made, asynchronous=True)
        try:
            first = await admit_async(p, ("doc", 1), {})
            last = await admit_async(p, ("doc", 2), {})
            assert (await Run(p, through_the_queue(first), ("doc", 1), {}).begin_async()) is not None
            run = Run(p, through_the_queue(last), ("doc", 2), {})
            assert (await run.begin_async()) is None
            async with run:
                pass
        finally:
            await made.close()

    asyncio.run(main())
    assert client.hget("adeb:Reindex:doc", "ran") is not None


# -- bad options: a clear error naming the option, and nothing written ----------------------


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"lifetime": DEBOUNCE}, ValueError, "lock_lifetime='debounce' needs lock_debounce"),
        ({"lifetime": DEBOUNCE, "debounce_max": 5}, ValueError, "needs lock_debounce"),
        ({"lifetime": DEBOUNCE, "debounce": -1}, ValueError, "lock_debounce must be a finite number"),
        ({"lifetime": DEBOUNCE, "debounce": 0}, ValueError, "lock_debounce must be"),
        ({"lifetime": DEBOUNCE, "debounce": "1"}, TypeError, "lock_debounce must be a number"),
        ({"lifetime": DEBOUNCE, "debounce": 2, "debounce_max": -3}, ValueError, "lock_debounce_max must be"),
        (
            {"lifetime": DEBOUNCE, "debounce": 5, "debounce_max": 2},
            ValueError,
            r"lock_debounce_max \(2\) must",
        ),
        ({"debounce": 5}, ValueError, "lock_debounce is for lock_lifetime='debounce', not 'while_executing'"),
        ({"lifetime": UNTIL_EXECUTED, "debounce_max": 5}, ValueError, "lock_debounce_max is for"),
    ],
)
def test_bad_debounce_options_are_refused_naming_them(locks, client, options, error, words):
    with pytest.raises(error, match=words):
        Policy(locks, name="Reindex", ttl=10, option_prefix="lock_", **options)
    assert client.keys(f"{locks.prefix}:*") == []


def test_the_errors_name_the_options_as_the_adapter_spells_them(locks):
    with pytest.raises(ValueError, match=r"^lifetime='debounce' needs debounce:"):
        Policy(locks, name="Reindex", ttl=10, lifetime=DEBOUNCE)


def test_a_cluster_client_is_refused_for_debounce():
    made = ClusterLocks("redis://127.0.0.1:1")  # nothing is sent: refused as it is given
    with pytest.raises(TypeError, match="debounce lifetime needs a client of one server, not ClusterLocks"):
        debounced(made)
    lazy = debounced(lambda: made)
    with pytest.raises(TypeError, match="not ClusterLocks"):
        admit(lazy, ("doc", 1), {})
