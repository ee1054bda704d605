"""CpuTransferEngine: the :class:`TransferEngine` for KV tensors in CPU memory (no GPU, CI).

One background worker thread runs the jobs from one FIFO queue, so the asynchrony is
real and testable, and completions come out in submission order.

Primitives (contracts in :mod:`tierkv.transfer.base`):
- ``submit_store`` / ``submit_load``: queue the job (thread-safe); ClosedError after
  ``shutdown``, BrokenError once the worker thread died.
- ``poll_finished``, ``wait(job_ids, timeout=None)``, ``shutdown`` (drains the queue).
- ``before_copy(spec)``: a test hook run in the worker thread before each job's copy, to
  slow a job down (a wide race window) or to raise (a failed copy, reported not raised).

Copies, per copy group of :mod:`tierkv.transfer.layout`: block ids in at most
``MAX_COPY_RUNS`` runs of consecutive ids are copied one run at a time through numpy views
of the same memory (a numpy slice copy costs ~1 us of overhead, a torch ``copy_`` 3-5 us:
that decides speed when a chunk is 32 separate layers). More scattered ids are gathered by
one ``torch.index_select(..., out=slot)`` and scattered by one numpy fancy assignment
(1.5-1.8x faster here than torch ``index_put_`` / ``index_copy_``, which beat a copy per
page). ``docs/benchmarks/copy.md`` has the figures against one raw ``copy_``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

import torch

from tierkv.core.jobs import Completion, JobId, LoadSpec, StoreSpec
from tierkv.errors import BrokenError, ClosedError, ConfigError, short_key
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.base import TransferEngine, check_spec, failed_completion, load_runs
from tierkv.transfer.layout import KVLayout, consecutive_runs
from tierkv.transfer.ledger import REMEMBER_FINISHED, JobLedger

MAX_COPY_RUNS = 2  # see the module docstring


class CpuTransferEngine(TransferEngine):
    """KV tensors on the CPU <-> slab slots, copied by one worker thread."""

    def __init__(
        self,
        layout: KVLayout,
        slab: CpuSlab,
        blocks_per_chunk: int,
        before_copy: Callable[[StoreSpec | LoadSpec], None] | None = None,
        remember_finished: int = REMEMBER_FINISHED,
    ) -> None:
        super().__init__(layout, slab, blocks_per_chunk)
        if layout.device.type != "cpu":
            raise ConfigError(
                f"transfer: CpuTransferEngine copies CPU tensors, the KV cache is on "
                f"{layout.device} (use device='cuda' or 'auto')"
            )
        self._views = layout.chunk_views(slab.tensor, blocks_per_chunk)
        # The same memory as numpy arrays: (pages [G, B, words], rows, chunk pages of slots)
        self._arrays = [(plan.pages.numpy(), plan.rows.numpy(), plan.chunk_pages.numpy())
                        for plan in self._views.plans]
        self._before_copy = before_copy
        self._cond = threading.Condition()
        self._queue: deque[StoreSpec | LoadSpec] = deque()
        self._done: list[Completion] = []
        self._ledger: JobLedger[None] = JobLedger("cpu transfer engine", remember_finished)
        self._closed = False
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="tierkv-transfer-cpu", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submit
    def _submit(self, spec: StoreSpec | LoadSpec) -> None:
        with self._cond:
            if self._closed:
                raise ClosedError(f"cpu transfer engine: job {spec.job_id} submitted after "
                                  f"shutdown")
            if self._broken is not None:
                raise BrokenError(f"cpu transfer engine: the copy thread died ({self._broken}); "
                                  f"restart the worker")
            self._ledger.add(spec.job_id, None)
            self._queue.append(spec)
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._queue or self._closed)
                    if not self._queue:
                        return
                    spec = self._queue[0]
                completion = self._execute(spec)
                with self._cond:
                    self._queue.popleft()
                    self._finish(completion)
        except BaseException as exc:  # a bug or interpreter exit: fail what is left
            with self._cond:
                self._broken = f"{type(exc).__name__}: {exc}"
                while self._queue:
                    self._finish(failed_completion(
                        self._queue.popleft(), f"the copy thread died ({self._broken})"))
            raise

    def _finish(self, completion: Completion) -> None:
        self._done.append(completion)
        self._ledger.finish(completion.job_id)
        self._cond.notify_all()

    def _execute(self, spec: StoreSpec | LoadSpec) -> Completion:
        error = check_spec(spec, self.layout.num_blocks, self.slab.num_slots, self.blocks_per_chunk)
        if error is not None:
            return failed_completion(spec, error)
        if self._before_copy is not None:
            try:
                self._before_copy(spec)
            except Exception as exc:
                return failed_completion(spec, f"{type(exc).__name__}: {exc}")
        is_store = isinstance(spec, StoreSpec)
        moved = 0
        start = time.perf_counter()
        for position, chunk in enumerate(spec.chunks):
            try:
                if is_store:
                    self._gather(chunk.slot, chunk.block_ids)
                    moved += self.chunk_bytes
                else:
                    moved += self._scatter(chunk.slot, chunk.block_ids, load_runs(chunk)) \
                        * self.block_bytes
            except Exception as exc:
                return failed_completion(
                    spec, f"chunk {short_key(chunk.key)} (slot {chunk.slot}): "
                    f"{type(exc).__name__}: {exc}", position, moved, time.perf_counter() - start)
        return Completion(spec.job_id, spec.kind, True, moved, time.perf_counter() - start)

    def _gather(self, slot: int, block_ids: tuple[int, ...]) -> None:
        """Blocks ``block_ids`` into slot ``slot``."""
        runs = consecutive_runs(block_ids)
        if len(runs) > MAX_COPY_RUNS:
            ids = torch.tensor(block_ids, dtype=torch.int64)
            self.layout.gather(self._views, slot, ids)
            return
        for pages, _, chunk_pages in self._arrays:
            out = chunk_pages[slot]
            for position, first, length in runs:
                out[:, position:position + length] = pages[:, first:first + length]

    def _scatter(self, slot: int, block_ids: tuple[int, ...],
                 runs: tuple[tuple[int, int], ...]) -> int:
        """Slot ``slot`` into the blocks at the positions of ``runs`` (see ``load_runs``);
        the others stay untouched. Returns the pages written."""
        written = 0
        for start, end in runs:
            targets = block_ids[start:end]
            id_runs = consecutive_runs(targets)
            if len(id_runs) > MAX_COPY_RUNS:
                ids = torch.tensor(targets, dtype=torch.int64)
                for plan, (_, rows, chunk_pages) in zip(self._views.plans, self._arrays):
                    rows[self.layout.row_index(plan, ids).numpy()] = chunk_pages[slot, :, start:end]
            else:
                for pages, _, chunk_pages in self._arrays:
                    source = chunk_pages[slot]
                    for position, first, length in id_runs:
                        at = start + position
                        pages[:, first:first + length] = source[:, at:at + length]
            written += end - start
        return written

    # ------------------------------------------------------------------ completions
    def poll_finished(self) -> list[Completion]:
        with self._cond:
            finished, self._done = self._done, []
        return finished

    def wait(self, job_ids: Iterable[JobId], timeout: float | None = None) -> None:
        with self._cond:
            self._ledger.wait(self._cond, job_ids, timeout)

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted and not yet finished."""
        with self._cond:
            return len(self._queue)
