"""LowerTier: a tier below the CPU tier (the disk tier, the remote tier).

A lower tier holds chunk payloads of one namespace and part (:class:`tierkv.keys.Part`)
under 32-byte keys. The CPU slab is its only gateway to the GPU: payloads come from slots
and go into slots. The I/O threads that drive it (:class:`tierkv.transfer.tier_io.TierIO`)
and the operator tools (:mod:`tierkv.tools`) use nothing but this interface.

Primitives and their contracts (every implementation):

- ``put_many(items, deletes=())``: delete ``deletes``, then store ``items`` (key, payload of
  exactly ``payload_bytes``); the payloads are copied before it returns, so slots may be
  reused. No room is a value (``PutResult.full``, with a message naming the setting), never
  an exception; a tier that fails underneath raises :class:`BrokenError`.
- ``put_in_batches(items, batch_bytes)``: ``put_many`` in transactions of at most
  ``batch_bytes`` (one item at least), what they wrote together (:class:`Batches`); an
  exception stops it and is returned with what landed before (the one write-batch loop:
  spills, the shutdown flush, the warm-up).
- ``delete_many(keys)``: absent keys are ignored; returns how many existed.
- ``read_into(key, out)``: ``OK`` only for verified bytes of this namespace, part and key,
  copied into ``out[:payload_bytes]``; ``MISSING``; or ``CORRUPT`` (the value failed its
  checks; a writable tier deletes it). ``out``'s contents are unspecified unless ``OK``.
  ``read_many_into(items)``: ``read_into`` of each ``(key, out)``, their statuses in order
  (a tier may keep them all in flight: the disk tier does); the first exception stops it.
  ``read_batch_bytes`` (0): the chunk bytes worth handing it in one call (the disk tier:
  ``disk.read_bytes_in_flight``); an I/O layer's readers share it.
- ``scan()``: every stored chunk as a :class:`ChunkRecord` (no payload read).
- ``verify(repair)``: check every value; ``repair`` deletes bad ones (:class:`VerifyReport`).
- ``sync()`` (the durability point), ``sync_if_due()`` (the tier's own schedule; the I/O
  thread calls it when idle), ``statistics()``, ``close()`` (idempotent; later calls raise
  :class:`ClosedError`, except that a tier may keep answering ``statistics()`` with its
  final counts, as the remote tier does for the engine's last metrics, and ``sync()`` of a
  tier with nothing to make durable may do nothing; the contract suite,
  ``tests/integration/test_lower_tier_contract.py``, holds both tiers to the rest).
- ``read_only``: nothing is changed; writes raise :class:`UsageError`.
- ``sync_every_seconds``: how often an idle I/O thread should call ``sync_if_due`` (None:
  never). ``sync_inline`` (True): ``put_many`` itself syncs when due; an I/O layer that
  syncs on a thread of its own sets it False, so no writer waits on an fsync.
- ``write_lanes`` (1) and ``lane_of(key)`` (0): writes of keys in different lanes may run
  concurrently (the disk tier: one lane per shard); within a lane they run in order.
- ``transient_failures`` (False): a :class:`BrokenError` means the tier is gone until it is
  reopened (a disk); True: the next call may succeed (a network tier reconnects), so the
  I/O layer keeps using it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

_Tier = TypeVar("_Tier", bound="LowerTier")

# A tool's check as it goes: (chunks, bytes) so far and the total when known (what
# ``tierkv verify`` prints on stderr).
Progress = Callable[[int, int, int | None], None]


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class ChunkCheck:
    """One value read and checked (a tier's ``verify_chunk``): ``MISSING`` (gone), ``OK`` or ``CORRUPT`` with what is
    wrong, whether the bad value was deleted, and the value bytes read."""

    status: ReadStatus
    problem: str | None = None
    deleted: bool = False
    bytes_read: int = 0


@dataclass(frozen=True)
class PutResult:
    """What one ``put_many`` did. ``full`` keys found no room (not an error)."""

    written: tuple[bytes, ...]
    full: tuple[bytes, ...] = ()
    deleted: int = 0
    num_bytes: int = 0
    message: str | None = None


@dataclass
class Batches:
    """What ``put_in_batches`` did: the keys written and those that found no room (over
    every transaction), the first no-room message, the transactions committed, and the
    exception that stopped it (the later items not written)."""

    written: list[bytes] = field(default_factory=list)
    full: list[bytes] = field(default_factory=list)
    message: str | None = None
    txns: int = 0
    error: Exception | None = None


@dataclass(frozen=True)
class ChunkRecord:
    """One stored chunk as the tier's index knows it (the value itself is checked on read)."""

    key: bytes
    payload_len: int
    seq: int


@dataclass(frozen=True)
class VerifyReport:
    """``bad_keys``: values failing any check, or index entries without a value.
    ``damaged``: the tier's storage itself was found damaged (what the checks said); it
    was then rebuilt empty (``rebuilt``) when the tier may repair."""

    checked: int
    bad_keys: tuple[bytes, ...]
    repaired: int
    damaged: str | None = None
    rebuilt: bool = False


class LowerTier(ABC):
    """A tier below the CPU tier; see the module docstring."""

    payload_bytes: int
    read_only: bool
    medium: str = "lower"  # its name in messages and thread names ("disk io: ...")
    setting: str = "its settings"  # the setting a message of its failure sends one to
    sync_inline: bool = True
    write_lanes: int = 1
    transient_failures: bool = False
    read_batch_bytes: int = 0

    @staticmethod
    def lane_of(key: bytes) -> int:
        return 0

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, Any]],
                 deletes: Sequence[bytes] = ()) -> PutResult: ...

    def per_txn(self, batch_bytes: int) -> int:
        """Values per transaction of at most ``batch_bytes`` (:meth:`put_in_batches`)."""
        return max(1, batch_bytes // self.payload_bytes)

    def put_in_batches(self, items: Sequence[tuple[bytes, Any]], batch_bytes: int, *,
                       stop_when_full: bool = False) -> Batches:
        """``put_many`` of ``items`` in transactions of at most ``batch_bytes``;
        ``stop_when_full``: none after one that found no room. See the module docstring."""
        per_txn = self.per_txn(batch_bytes)
        done = Batches()
        for start in range(0, len(items), per_txn):
            try:
                result = self.put_many(items[start : start + per_txn])
            except Exception as exc:  # noqa: BLE001 - the caller says what it stopped
                done.error = exc
                break
            done.txns += 1
            done.written += result.written
            done.full += result.full
            done.message = done.message or result.message
            if result.full and stop_when_full:
                break
        return done

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def read_into(self, key: bytes, out: Any) -> ReadStatus: ...

    def read_many_into(self, items: Sequence[tuple[bytes, Any]]) -> list[ReadStatus]:
        return [self.read_into(key, out) for key, out in items]

    @abstractmethod
    def scan(self, batch: int = 1024) -> Iterator[ChunkRecord]: ...

    @abstractmethod
    def verify(self, repair: bool = False, batch: int = 64,
               progress: Callable[[int], None] | None = None) -> VerifyReport:
        """``progress(values checked so far)`` is called as the check goes (per batch)."""

    def sync(self) -> None:
        """Make what was written durable; by default nothing to do (a remote tier's
        durability is its server's)."""

    def sync_if_due(self) -> bool:
        return False

    @property
    def sync_every_seconds(self) -> float | None:
        return None

    @abstractmethod
    def statistics(self) -> Any: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self: _Tier) -> _Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
