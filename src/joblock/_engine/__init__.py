"""joblock's protocol engine: operations without I/O, and the two drivers that carry them out.

- ``requests``: the pieces written to a connection (windows of lock commands) and how
  each is sent again after a lost reply or a NOSCRIPT.
- ``wire``: one connection's traffic as a state machine: requests go out in order,
  replies come back to the request they answer; the handshake and script reloads.
- ``ops``, ``batches``, ``topology``, ``quorum``: every lock operation as a state
  machine over requests (single locks, batches, Redis Cluster routing, Redlock).
- ``sync`` and ``aio``: the only code that does I/O: blocking sockets shared by
  threads, and asyncio; both multiplex concurrent callers on shared connections.

The modules of the hot path, those with a ``.pxd`` beside them, are also compiled by
Cython from these very sources (see ``joblock._core``).
"""
