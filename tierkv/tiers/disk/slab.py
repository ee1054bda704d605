"""One shard's slab file: the chunk payloads of the disk tier, in fixed slots.

``part-<p>of<P>/shard-<s>/slab-0.kv`` is an array of slots of ``slot_bytes_for(payload_bytes)``
bytes (``docs/on-disk-format.md``): a 4 KiB header block (the value's prefix and header),
then the payload, padded to 4 KiB. The LMDB index beside it says which key is in which
slot; this module only moves bytes and keeps the slot allocator.

Primitives and contracts:

- ``SlabFile(path, payload_bytes, read_only=, direct_io=)`` opens (creating, when writable)
  the file: never a link, FIFO or device (``O_NOFOLLOW | O_NONBLOCK``), mode 0o600.
- ``write(slot, head, payload)``: one ``pwritev`` of the header block and the payload.
  With ``direct_io`` (and a filesystem that takes ``O_DIRECT``) it bypasses the page
  cache: from ``payload`` itself when it is 4 KiB aligned in address and length, else
  from a per-thread aligned bounce buffer (one copy). Safe from several threads.
- ``read(slot, out, pool)``: a slot's header block into this thread's buffer and its
  payload into ``out``; returns the bytes read (short past the file's end). With
  ``direct_io`` and ``out`` page-aligned: ``O_DIRECT``, the payload's pieces on ``pool``
  (:mod:`tierkv.tiers.disk.reads`); else (or where the filesystem refuses ``O_DIRECT``,
  said once per filesystem) one buffered ``preadv``.
- ``start_read(slot, out, head, pool, pieces=False)`` / ``finish_read(pending)``: the same
  read started on ``pool`` and ended later, the header block into the caller's aligned
  ``head`` (so one thread keeps many chunks in flight: :mod:`tierkv.tiers.disk.many`); one
  call per chunk unless ``pieces``.
- ``sync()``: ``fdatasync`` (payloads and the file's size).
- The allocator (one process writes a shard: the claim): ``allocate(count, limit)`` gives
  free slots first, then grows the file by exactly the slots it hands out
  (``posix_fallocate`` of their range, never past ``limit`` slots). It returns what it
  could and why it stopped: ``"limit"`` or ``"space"`` (ENOSPC, EDQUOT). ``release(slots)``
  gives slots back and their disk space with them (``fallocate(PUNCH_HOLE)``: a free slot
  is a hole, so the file's allocated bytes are its used slots'; a write into a hole
  allocates it again); ``adopt_used(slots)`` seeds it from the index (a slot no index entry
  names is free, and is punched: nothing else is persisted, so nothing can disagree with
  the index). The disk cap counts allocated bytes (``docs/on-disk-format.md``).
- A slot freed may be written again at once: every read checks the slot's header against
  the index entry (sequence and key-bound checksum), so an index entry that names a
  reused slot (a crash brought it back) never serves another write's bytes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.tiers.disk.format import ALIGN, HEADER_BLOCK, copy_bytes, slot_bytes_for
from tierkv.tiers.disk.reads import ReadPool

logger = logging.getLogger("tierkv.disk")

SLAB_NAME = "slab-0.kv"  # slab number 0; the index names the slab so more can follow
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE (linux/falloc.h)


def _fallocate() -> Callable[..., int] | None:
    """libc's ``fallocate(2)`` (Python's ``os`` has only ``posix_fallocate``), or None."""
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int
    return call


_FALLOCATE = _fallocate()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give back the disk space of ``length`` bytes at ``offset`` (the file keeps its size;
    they read as zeros); False where the filesystem cannot (EOPNOTSUPP: the space stays)."""
    if _FALLOCATE is None:
        return False
    if _FALLOCATE(fd, _PUNCH_HOLE, offset, length) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(code, f"fallocate(PUNCH_HOLE) failed: {os.strerror(code)}")


_REFUSED: set[int] = set()  # filesystems (st_dev) whose refusal of O_DIRECT was logged


def refused_direct(path: Path, what: str) -> None:
    """Log once per filesystem that it refused ``O_DIRECT`` (``what``: at open or on a
    read): its reads are buffered."""
    try:
        device = os.stat(path.parent).st_dev
    except OSError:
        device = -1
    if device not in _REFUSED:
        _REFUSED.add(device)
        logger.info("disk tier: the filesystem of %s refused O_DIRECT (%s); its slab "
                    "reads are buffered", path.parent, what)


@dataclass
class PendingRead:
    """A slot read :meth:`SlabFile.start_read` started (``fd`` None: it is done, buffered,
    ``count`` bytes); :meth:`SlabFile.finish_read` ends it."""

    offset: int
    head: memoryview
    out: memoryview
    fd: int | None
    futures: list[Future[int]]
    count: int = 0


def _address(view: Any) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


class SlabFile:
    """One shard's slab file and its slot allocator; see the module docstring."""

    def __init__(self, path: Path, payload_bytes: int, *, read_only: bool,
                 direct_io: bool = True) -> None:
        self.path = Path(path)
        self.payload_bytes = payload_bytes
        self.slot_bytes = slot_bytes_for(payload_bytes)
        self._padded = self.slot_bytes - HEADER_BLOCK
        self.read_only = read_only
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT
        self._fd = os.open(self.path, flags, 0o600)
        self._direct_fd: int | None = None  # for writes: None once refused
        self._direct_read_fd: int | None = None  # for reads: None once refused
        self._direct_opened: int | None = None  # closed by close(), refused or not
        if direct_io and hasattr(os, "O_DIRECT"):
            mode = os.O_RDONLY if read_only else os.O_RDWR
            try:
                self._direct_read_fd = os.open(self.path, mode | os.O_NOFOLLOW | os.O_CLOEXEC
                                               | os.O_DIRECT)
            except OSError:  # a filesystem without O_DIRECT (older tmpfs): buffered I/O
                refused_direct(self.path, "open")
            self._direct_opened = self._direct_read_fd
            if not read_only:
                self._direct_fd = self._direct_read_fd
        self._local = threading.local()
        self._lock = threading.Lock()
        self.slots = os.fstat(self._fd).st_size // self.slot_bytes  # slots the file holds
        self._free: list[int] = []
        self._high = 0  # slots below this are used or in _free
        self.mapped = False  # adopt_used() has run
        self._holes = True  # free slots are punched (False: the filesystem cannot)
        self.next_seq: int | None = None  # the writer's next sequence (set by the tier)
        self.closed = False

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    # -- bytes -------------------------------------------------------------------------

    def _buffers(self) -> tuple[memoryview, memoryview]:
        """This thread's aligned header block and payload bounce buffer (anonymous maps
        are page-aligned)."""
        local = self._local
        if not hasattr(local, "head"):
            local.maps = (mmap.mmap(-1, HEADER_BLOCK), mmap.mmap(-1, max(self._padded, ALIGN)))
            local.head, local.bounce = (memoryview(m) for m in local.maps)
        return local.head, local.bounce

    def write(self, slot: int, head: bytes, payload: memoryview) -> None:
        """Write ``head`` (zero padded to the header block) and ``payload`` into ``slot``."""
        for piece in self.pieces(slot, head, payload, len(payload) or 1):
            piece()

    def pieces(self, slot: int, head: bytes, payload: memoryview,
               piece_bytes: int) -> list[Callable[[], None]]:
        """The writes of ``slot`` (its header block, then its payload in ``piece_bytes``
        pieces, a multiple of 4 KiB) as calls that may run on any threads, in any order."""
        offset = slot * self.slot_bytes
        calls: list[Callable[[], None]] = [
            partial(self._write_head, offset, head, payload[:piece_bytes])]
        for start in range(piece_bytes, len(payload), piece_bytes):
            calls.append(partial(self._write_at, offset + HEADER_BLOCK + start,
                                 payload[start : start + piece_bytes]))
        return calls

    def _write_head(self, offset: int, head: bytes, first: memoryview) -> None:
        """The header block and the payload's first piece: one ``pwritev`` when the piece
        can go straight from the caller's buffer, else two writes."""
        block, _ = self._buffers()
        block[: len(head)] = head
        block[len(head):] = bytes(HEADER_BLOCK - len(head))
        fd = self._direct_fd if self._direct_fd is not None else self._fd
        if self._direct_fd is None or (len(first) % ALIGN == 0 and _address(first) % ALIGN == 0):
            try:
                written = os.pwritev(fd, [block, first], offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or fd == self._fd:
                    raise
                self._direct_fd = None  # the filesystem refused O_DIRECT here: buffered
                written = os.pwritev(self._fd, [block, first], offset)
            self._check_written(written, HEADER_BLOCK + len(first))
            return
        self._write_at(offset, block, aligned=True)
        self._write_at(offset + HEADER_BLOCK, first)

    def _write_at(self, offset: int, data: memoryview, aligned: bool = False) -> None:
        """``data`` at ``offset`` (4 KiB aligned): O_DIRECT from ``data`` itself when it is
        aligned in address and length, else from this thread's bounce buffer (zero padded
        to 4 KiB); buffered where the filesystem refused O_DIRECT."""
        size = len(data)
        if self._direct_fd is not None:
            if aligned or (size % ALIGN == 0 and _address(data) % ALIGN == 0):
                body = data
            else:  # unaligned source, or a tail that is not a whole number of blocks
                _, bounce = self._buffers()
                padded = -(-size // ALIGN) * ALIGN
                copy_bytes(bounce[:size], data)
                bounce[size:padded] = bytes(padded - size)
                body = bounce[:padded]
            try:
                written = os.pwrite(self._direct_fd, body, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_fd = None  # the filesystem refused O_DIRECT here: buffered
            else:
                self._check_written(written, len(body))
                return
        self._check_written(os.pwrite(self._fd, data, offset), size)

    @staticmethod
    def _check_written(written: int, wanted: int) -> None:
        if written != wanted:  # a short write: the filesystem is full
            raise OSError(errno.ENOSPC, f"short write ({written} of {wanted} bytes)")

    def read(self, slot: int, out: memoryview, pool: ReadPool | None = None
             ) -> tuple[memoryview, int]:
        """(this thread's header block, bytes read) of ``slot``, its payload read into
        ``out[:payload_bytes]``; fewer bytes than a slot's header and payload mean the slot
        is past the file's end. With ``O_DIRECT`` (and ``out`` page-aligned) straight into
        ``out``, its pieces on ``pool`` (:mod:`tierkv.tiers.disk.reads`); else buffered."""
        block, _ = self._buffers()
        offset = slot * self.slot_bytes
        fd = self._direct_read_fd
        if fd is not None and _address(out) % ALIGN == 0:
            try:
                return block, self._read_direct(fd, offset, block, out, pool)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_read_fd = None  # refused here after all: buffered from now on
                refused_direct(self.path, "read")
        return block, os.preadv(self._fd, [block, out[: self.payload_bytes]], offset)

    def _direct_calls(self, fd: int, offset: int, head: memoryview, out: memoryview,
                      piece: int) -> list[tuple[int, Callable[[], int]]]:
        """The ``O_DIRECT`` reads of a slot as ``(bytes, call)``: the header block with the
        payload's first ``piece`` bytes in one ``preadv``, then the rest of its whole 4 KiB
        blocks in ``piece`` pieces (a tail that is no whole block: :meth:`_read_tail`)."""
        whole = self.payload_bytes - self.payload_bytes % ALIGN
        first = min(piece, whole)
        start = offset + HEADER_BLOCK

        def read_at(begin: int, end: int) -> int:
            return os.preadv(fd, [out[begin:end]], start + begin)

        calls: list[tuple[int, Callable[[], int]]] = [
            (HEADER_BLOCK + first, partial(os.preadv, fd, [head, out[:first]], offset))]
        calls += [(min(piece, whole - begin), partial(read_at, begin, min(begin + piece, whole)))
                  for begin in range(first, whole, piece)]
        return calls

    def _read_tail(self, fd: int, offset: int, out: memoryview) -> int:
        """The payload's last bytes that are no whole 4 KiB block (a padded block, whose
        first bytes are the payload's) through this thread's bounce buffer."""
        size = self.payload_bytes
        whole = size - size % ALIGN
        if size == whole:
            return 0
        _, bounce = self._buffers()
        got = os.preadv(fd, [bounce[:ALIGN]], offset + HEADER_BLOCK + whole)
        taken = max(0, min(got, size - whole))
        copy_bytes(out[whole : whole + taken], bounce[:taken])
        return taken

    def _read_direct(self, fd: int, offset: int, block: memoryview, out: memoryview,
                     pool: ReadPool | None) -> int:
        """The payload's whole 4 KiB blocks straight into ``out``, in pieces on ``pool``
        (the first piece with the header block, on this thread), and the tail."""
        whole = self.payload_bytes - self.payload_bytes % ALIGN
        piece = ReadPool.piece_for(self.payload_bytes) if pool is not None else max(whole, ALIGN)
        (_, first), *rest = self._direct_calls(fd, offset, block, out, piece)
        futures = pool.submit(rest) if pool is not None else []
        try:
            count = first()
        finally:
            results = ReadPool.gather(futures) if futures else [call() for _, call in rest]
        return count + sum(results) + self._read_tail(fd, offset, out)

    def start_read(self, slot: int, out: memoryview, head: memoryview, pool: ReadPool,
                   pieces: bool = False) -> PendingRead:
        """Start reading ``slot`` (its header block into ``head``: 4 KiB, page-aligned, the
        caller's; its payload into ``out``) and return at once: with ``O_DIRECT`` every read
        runs on ``pool``, the header block and payload in one call (other chunks fill the
        queue) or, with ``pieces`` (a chunk read alone), in pieces; else one buffered
        ``preadv`` here. :meth:`finish_read` waits for it."""
        offset = slot * self.slot_bytes
        fd = self._direct_read_fd
        if fd is not None and _address(out) % ALIGN == 0:
            size = self.payload_bytes
            piece = ReadPool.piece_for(size) if pieces else max(size - size % ALIGN, ALIGN)
            calls = self._direct_calls(fd, offset, head, out, piece)
            return PendingRead(offset, head, out, fd, pool.submit(calls))
        return PendingRead(offset, head, out, None, [],
                           os.preadv(self._fd, [head, out[: self.payload_bytes]], offset))

    def finish_read(self, pending: PendingRead) -> int:
        """The bytes :meth:`start_read` read, once all its reads finished (as :meth:`read`
        counts them); a filesystem that refused ``O_DIRECT`` on them is read buffered."""
        if pending.fd is None:
            return pending.count
        try:
            count = sum(ReadPool.gather(pending.futures))
            return count + self._read_tail(pending.fd, pending.offset, pending.out)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._direct_read_fd = None  # refused here after all: buffered from now on
            refused_direct(self.path, "read")
        return os.preadv(self._fd, [pending.head, pending.out[: self.payload_bytes]],
                         pending.offset)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    # -- slots -------------------------------------------------------------------------

    def adopt_used(self, used: Iterable[int]) -> None:
        """Seed the allocator: ``used`` slots (from the index) are taken, the rest free (and
        punched: an older tierkv, or a crash between a commit and its punch, left them
        allocated)."""
        taken = set(used)
        with self._lock:
            if self.mapped:  # another thread seeded it first: slots it handed out since
                return  # may be written but not yet in the index (never free them)
            self.slots = self.size() // self.slot_bytes  # another writer may have grown it
            self._high = max(self.slots, max(taken, default=-1) + 1)
            # Punched before any is handed out: a punch after a write would zero it.
            self._punch(slot for slot in range(min(self._high, self.slots))
                        if slot not in taken)
            self._free = sorted((slot for slot in range(self._high) if slot not in taken),
                                reverse=True)  # pop() gives the lowest first
            self.mapped = True

    def allocate(self, count: int, limit: int) -> tuple[list[int], str | None]:
        """Up to ``count`` slots (free ones first, then new ones past the used end, growing
        the file by exactly those); the reason for a shortfall: ``"limit"`` or ``"space"``."""
        with self._lock:
            slots = [self._free.pop() for _ in range(min(count, len(self._free)))]
            want = count - len(slots)
            if not want:
                return slots, None
            room = max(0, max(limit, self.slots) - self._high)  # slots that exist are used
            fresh = min(want, room)
            why: str | None = None if fresh == want else "limit"
            if fresh and self._high + fresh > self.slots:
                grown = self._grow(self._high + fresh)
                if grown < self._high + fresh:
                    fresh, why = max(0, grown - self._high), "space"
            slots += range(self._high, self._high + fresh)
            self._high += fresh
            return slots, why

    def _grow(self, needed: int) -> int:
        """Make the file hold ``needed`` slots, allocating only the new ones (the cap counts
        allocated bytes: no step ahead); returns the slots it holds after."""
        try:
            os.posix_fallocate(self._fd, self.slots * self.slot_bytes,
                               (needed - self.slots) * self.slot_bytes)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            return self.slots
        self.slots = needed
        return needed

    def release(self, slots: Iterable[int]) -> None:
        """Free ``slots``: their disk space is given back first (a hole), then they may be
        handed out again (never punched after: a new write could be in them)."""
        slots = list(slots)
        self._punch(slots)
        with self._lock:
            self._free.extend(slots)
            self._free.sort(reverse=True)

    def _punch(self, slots: Iterable[int]) -> None:
        """Punch a hole over ``slots`` (runs of neighbours in one call); where the filesystem
        cannot, warn once and keep their space (the cap then counts free slots too)."""
        if not self._holes or self.read_only:
            return
        run_start, run_end = -1, -1
        for slot in [*sorted(set(slots)), -2]:
            if slot == run_end:
                run_end += 1
                continue
            if run_end > run_start and not punch_hole(
                    self._fd, run_start * self.slot_bytes, (run_end - run_start) * self.slot_bytes):
                self._holes = False
                logger.warning("tierkv: the filesystem of %s cannot punch holes "
                               "(fallocate PUNCH_HOLE): free slots keep their disk space until "
                               "they are reused, and the files may pass disk.max_bytes",
                               self.path)
                return
            run_start, run_end = slot, slot + 1

    def used_end(self) -> int:
        """One past the highest slot that is not free (0 when none is used)."""
        with self._lock:
            free, end = set(self._free), self._high
        while end and (end - 1) in free:
            end -= 1
        return end

    def shrink_to_used(self) -> None:
        """Give back the file's free tail (at close): the cap counts file bytes."""
        if self.read_only or not self.mapped:
            return
        end = self.used_end()
        if end < self.slots:
            os.ftruncate(self._fd, end * self.slot_bytes)
            with self._lock:
                self.slots = end
                self._free = [slot for slot in self._free if slot < end]
                self._high = min(self._high, end)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for fd in (self._direct_opened, self._fd):
            if fd is not None:
                os.close(fd)
        self._direct_fd = self._direct_read_fd = self._direct_opened = None
