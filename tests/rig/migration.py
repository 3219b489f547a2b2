"""A slot of a local Redis Cluster moved by hand to another primary (CLUSTER SETSLOT
and MIGRATE, as ``redis-cli --cluster reshard`` does)."""

from __future__ import annotations

from typing import Any

from joblock._tools.servers import LocalCluster


class Migration:
    """Moves one slot of a LocalCluster to another primary, step by step (CLUSTER SETSLOT
    and MIGRATE, as ``redis-cli --cluster reshard`` does): for the tests, and the chaos run's
    migrations while clients use the slot."""

    def __init__(self, cluster: LocalCluster, slot: int) -> None:
        self.cluster = cluster
        self.slot = slot
        self.source = cluster.primary_of(slot)
        self.target = next(n for n in cluster.primaries() if n is not self.source)

    def begin(self) -> None:
        c = self.cluster
        c.call(self.target, "CLUSTER", "SETSLOT", self.slot, "IMPORTING", c.node_id(self.source))
        c.call(self.source, "CLUSTER", "SETSLOT", self.slot, "MIGRATING", c.node_id(self.target))

    def move(self, keys: list[bytes]) -> None:
        if keys:
            self.cluster.call(
                self.source, "MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys
            )

    def move_all(self, limit: int | None = None) -> int:
        moved = 0
        while limit is None or moved < limit:
            count = 100 if limit is None else min(100, limit - moved)
            keys = self.cluster.call(self.source, "CLUSTER", "GETKEYSINSLOT", self.slot, count)
            if not keys:
                break
            self.move(keys)
            moved += len(keys)
        return moved

    def on_target(self, *args: Any) -> Any:
        # The importing node serves the slot's next command only after ASKING.
        return self.cluster.call_all(self.target, [("ASKING",), args])[1]

    def finish(self) -> None:
        c = self.cluster
        self.move_all()
        target_id = c.node_id(self.target)
        for node in [
            self.target,
            self.source,
            *(n for n in c.primaries() if n not in (self.source, self.target)),
        ]:
            c.call(node, "CLUSTER", "SETSLOT", self.slot, "NODE", target_id)
        c.wait_ok()
