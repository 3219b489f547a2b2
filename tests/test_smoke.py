def test_acquire_release(locks):
    lease = locks.acquire("a", 5)
    assert lease is not None
    assert locks.acquire("a", 5) is None
    assert lease.release() is True
