"""The remote tier while the session's 3-master cluster reshards under it: a client thread
reads every chunk byte-exact and writes new ones while slots (most chunks among them) move
master to master and back (:meth:`tests.redis_cluster.RedisCluster.reshard`, the way
``redis-cli --cluster reshard`` does it). redis-py follows ``ASK`` (a slot half moved) and
``MOVED`` (its owner changed); nothing read may ever be wrong, nothing written lost. The
slot layout is restored at the end: the cluster is shared by the session."""

from __future__ import annotations

import logging
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from redis.crc import key_slot

from tests.redis_cluster import HOST, RedisCluster
from tierkv.config import RemoteTierConfig
from tierkv.errors import BrokenError
from tierkv.keys import Namespace
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.tiers.remote.format import redis_key

PAYLOAD = 1024
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=512,
               tokens_per_chunk=16)
SLOTS = 300  # slots moved in each leg
PAUSE = 0.002  # seconds a slot stays open after each MIGRATE and before it is assigned


def payload_of(key: bytes) -> bytes:
    return random.Random(key).randbytes(PAYLOAD)


def slot_of(key: bytes) -> int:
    return key_slot(redis_key(b"tierkv:", NS.fingerprint(), 0, key))


def keys_where(count: int, seed: int, inside: set[int], wanted: bool) -> list[bytes]:
    """``count`` chunk keys whose slot is (``wanted``) or is not in ``inside``."""
    draw, keys = random.Random(seed), list[bytes]()
    while len(keys) < count:
        key = draw.randbytes(32)
        if (slot_of(key) in inside) == wanted:
            keys.append(key)
    return keys


class Redirects(logging.Handler):
    """Counts the ASK / MOVED answers redis-py's cluster client logs (at DEBUG) as it
    follows them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        for kind in ("ASK", "MOVED", "TRYAGAIN"):
            if record.getMessage().startswith(f"{kind} error received"):
                self.seen[kind] += 1


@pytest.fixture()
def redirects() -> Iterator[Redirects]:
    log = logging.getLogger("redis.cluster")
    handler, level, propagate = Redirects(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # thousands of DEBUG lines: counted here, not captured
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)
    log.propagate = propagate


def owners(cluster: RedisCluster) -> dict[int, int]:
    return {slot: port for port in cluster.ports for slot in cluster.slots_of(port)}


def restore(cluster: RedisCluster, layout: dict[int, int]) -> None:
    """Give every slot back to its owner in ``layout`` (closing any slot a failed move
    left open first)."""
    for port in cluster.ports:
        with redis.Redis(host=HOST, port=port) as node:
            open_slots = b"[" in node.execute_command("CLUSTER", "NODES")
        if open_slots:  # [slot->-id] / [slot-<-id]: a slot left MIGRATING / IMPORTING
            subprocess.run(["redis-cli", "--cluster", "fix", f"{HOST}:{port}",
                            "--cluster-yes"], capture_output=True, timeout=60)
    now = owners(cluster)
    for source in cluster.ports:
        for target in cluster.ports:
            slots = [slot for slot, port in now.items() if port == source and
                     layout.get(slot) == target != source]
            cluster.move_slots(slots, source, target)
    cluster.wait_ok()


def test_reads_and_writes_stay_exact_while_slots_move(redis_cluster: RedisCluster,
                                                     redirects: Redirects) -> None:
    cluster = redis_cluster
    cluster.flushall()
    layout = owners(cluster)
    assert len(layout) == 16384
    # the master holding slot 0: its lowest slots move to a second master, to the third,
    # and back (each leg moves the lowest SLOTS slots of its source: the same ones)
    first = layout[0]
    second, third = (port for port in cluster.ports if port != first)
    moving = set(cluster.slots_of(first)[:SLOTS])
    assert moving == set(range(SLOTS))
    initial = keys_where(120, 1, moving, True) + keys_where(80, 2, moving, False)
    fresh = iter([key for pair in zip(keys_where(600, 3, moving, True),
                                      keys_where(600, 4, moving, False)) for key in pair])
    written: list[bytes] = []  # chunks stored for sure (put_many returned)
    unsure: list[bytes] = []  # chunks of a put_many that raised
    reads: Counter[str] = Counter()
    broken: list[str] = []
    crashed: list[BaseException] = []
    stop = threading.Event()

    config = RemoteTierConfig(url=cluster.url, timeout_seconds=2.0, breaker_failures=1000)
    with RemoteTier(config, NS, 0, PAYLOAD) as tier:
        assert tier.cluster
        assert tier.put_many([(key, payload_of(key)) for key in initial]).num_bytes == \
            200 * PAYLOAD
        written.extend(initial)

        def client() -> None:
            out = bytearray(PAYLOAD)
            try:
                while not stop.is_set():
                    for key in list(written):
                        try:
                            status = tier.read_into(key, memoryview(out))
                        except BrokenError as exc:
                            broken.append(f"read: {exc}")
                            continue
                        if status is not ReadStatus.OK:
                            reads[status.name] += 1
                        elif bytes(out) != payload_of(key):
                            reads["WRONG"] += 1
                        else:
                            reads["OK"] += 1
                    batch = [key for key in (next(fresh, None) for _ in range(8)) if key]
                    if not batch:
                        continue
                    try:
                        result = tier.put_many([(key, payload_of(key)) for key in batch])
                    except BrokenError as exc:
                        broken.append(f"write: {exc}")
                        unsure.extend(batch)
                        continue
                    assert result.written == tuple(batch) and \
                        result.num_bytes == len(batch) * PAYLOAD, result
                    written.extend(batch)
                    try:
                        found = tier.exists_many(list(written))
                    except BrokenError as exc:
                        broken.append(f"exists: {exc}")
                        continue
                    if not all(found):
                        reads["EXISTS_FALSE"] += found.count(False)
            except BaseException as exc:  # seen by the main thread
                crashed.append(exc)

        worker = threading.Thread(target=client, name="reshard-client", daemon=True)
        started = time.monotonic()
        try:
            worker.start()
            time.sleep(0.1)  # the client is running before the first slot moves
            legs = [cluster.reshard(first, second, SLOTS, PAUSE),
                    # one key per MIGRATE: slots half moved (some keys ASK, some not)
                    cluster.reshard(second, third, SLOTS, PAUSE, batch=1),
                    cluster.reshard(third, first, SLOTS, PAUSE)]
            time.sleep(0.1)  # and after the last one
        finally:
            stop.set()
            worker.join(30)
            restore(cluster, layout)
        elapsed = time.monotonic() - started
        assert not worker.is_alive() and crashed == []
        during = len(written) - len(initial)
        print(f"\nreshard: legs moved {legs} keys in {elapsed:.2f} s; client reads {dict(reads)}"
              f", {during} chunks written during it, redirects {dict(redirects.seen)}, "
              f"{len(broken)} BrokenError {broken[:3]}")

        # nothing wrong was ever read, every read was a hit, nothing failed
        assert reads["WRONG"] == 0 and set(reads) == {"OK"}, reads
        assert reads["OK"] >= 3 * len(initial)
        assert broken == [], broken
        # the keys really moved (each leg carried every chunk in those slots), and the
        # client really had to follow the moves
        in_moving = sum(1 for key in written + unsure if slot_of(key) in moving)
        assert all(120 <= moved <= in_moving for moved in legs), (legs, in_moving)
        assert during >= 40
        assert redirects.seen["MOVED"] > 0 and redirects.seen["ASK"] > 0, redirects.seen

        # the layout is back, the cluster is healthy, and every chunk reads back exact
        assert owners(cluster) == layout
        for port in cluster.ports:
            with redis.Redis(host=HOST, port=port) as node:
                info = node.execute_command("CLUSTER", "INFO").decode()
                assert "cluster_state:ok" in info and "cluster_slots_ok:16384" in info
                assert node.dbsize() > 0
        out = bytearray(PAYLOAD)
        for key in written:
            assert tier.read_into(key, memoryview(out)) is ReadStatus.OK
            assert bytes(out) == payload_of(key)
        assert tier.exists_many(written) == [True] * len(written)
        listed = [record.key for record in tier.scan()]
        stored = set(listed)
        assert len(listed) == len(stored)  # no chunk on two masters
        assert set(written) <= stored <= set(written) | set(unsure)
        stats = tier.statistics()
        assert (stats.corrupt, stats.errors, stats.misses) == (0, 0, 0), stats
