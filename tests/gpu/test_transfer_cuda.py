"""CudaTransferEngine on a real GPU beyond the contract every engine keeps
(tests/integration/test_transfer_contract.py): byte-exact round trips for the four layouts
through staging smaller than a job and padded slots, stream ordering against the compute
stream. Skipped without CUDA, with the reason printed (see tests/conftest.py). The
reference for bytes is offset arithmetic on raw buffers, as in tests/unit/test_layout.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tierkv.core.jobs import ChunkCopy, JobId, LoadSpec, SlotId, StoreSpec
from tierkv.testing import LayoutKV
from tierkv.transfer.cuda import CudaTransferEngine

pytestmark = pytest.mark.cuda

LAYERS, BLOCKS, BPC = 4, 64, 8
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: widens every race window


def KV(kind: str, separate: bool = False) -> LayoutKV:
    """Per layer a logical [B, H, N, C] bfloat16 CUDA tensor in one of the four layouts."""
    return LayoutKV(kind, LAYERS, BLOCKS, (16, 4, 64), torch.bfloat16, separate, device="cuda")


def chunk(key: int, slot: int, blocks: tuple[int, ...], skip: int = 0) -> ChunkCopy:
    return ChunkCopy(bytes([key]) * 32, SlotId(slot), blocks, skip_blocks=skip)


def blocks_of(index: int) -> tuple[int, ...]:
    return tuple((index * 5 + step * 3) % BLOCKS for step in range(BPC))  # scattered ids


def make_engine(kv: LayoutKV, num_slots: int = 16, staging_chunks: float = 4,
                pad: int = 0) -> CudaTransferEngine:
    engine: CudaTransferEngine = kv.engine(BPC, num_slots, staging_chunks, pad)
    return engine


KINDS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LBHNC-separate"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("staging_chunks", "pad"), [(4, 0), (1.5, 0), (8, 512)],
                         ids=["batched", "one-chunk-staging", "padded-slots"])
def test_round_trip_through_staging_batches_is_byte_exact(kind: str, staging_chunks: float,
                                                          pad: int) -> None:
    kv = KV(kind.split("-")[0], separate=kind.endswith("separate"))
    engine = make_engine(kv, staging_chunks=staging_chunks, pad=pad)
    slots = [3, 4, 5, 0, 9, 10]  # runs of consecutive slots: 3-5, 0, 9-10
    engine.submit_store(StoreSpec.of(JobId(1), tuple(
        chunk(i, slot, blocks_of(i)) for i, slot in enumerate(slots))))
    engine.wait([JobId(1)])
    [done] = engine.poll_finished()
    assert done.ok and done.num_bytes == len(slots) * engine.chunk_bytes and done.seconds > 0
    expected = {slot: kv.chunk(blocks_of(i)) for i, slot in enumerate(slots)}
    for slot, reference in expected.items():
        assert torch.equal(engine.slab.view(slot)[:reference.numel()], reference), slot

    targets = [tuple(range(i * BPC, (i + 1) * BPC))[::-1] for i in range(len(slots))]
    before = kv.chunk(targets[0])
    engine.submit_load(LoadSpec(JobId(2), tuple(
        chunk(i, slot, targets[i], skip=2 if i == 0 else 0) for i, slot in enumerate(slots))))
    engine.make_compute_wait([JobId(2)])
    landed = [kv.chunk(t) for t in targets]
    for i, slot in enumerate(slots):
        if i == 0:  # skip_blocks=2: the first two blocks of the chunk are not written
            per_layer = BPC * kv.page
            for layer in range(LAYERS):
                got = landed[0][layer * per_layer:(layer + 1) * per_layer]
                want = expected[slot][layer * per_layer:(layer + 1) * per_layer]
                assert torch.equal(got[2 * kv.page:], want[2 * kv.page:])
                kept = before[layer * per_layer:(layer + 1) * per_layer]
                assert torch.equal(got[:2 * kv.page], kept[:2 * kv.page])
        else:
            assert torch.equal(landed[i], expected[slot]), slot
    engine.shutdown()


def test_store_waits_for_the_compute_stream() -> None:
    kv = KV("BLNHC")
    engine = make_engine(kv)
    # On the compute stream: a long kernel, then the "forward" writes the blocks.
    torch.cuda._sleep(SLEEP_CYCLES)
    for step, block in enumerate(blocks_of(1)):
        for layer in range(LAYERS):
            kv.page_at(layer, block).fill_(step + 1)
    engine.submit_store(StoreSpec.of(JobId(1), (chunk(1, 0, blocks_of(1)),)))
    engine.wait([JobId(1)])  # no explicit sync between the forward and the store
    slot = engine.slab.view(0).view(LAYERS, BPC, kv.page)
    for step in range(BPC):
        assert bool((slot[:, step] == step + 1).all()), step
    engine.shutdown()


def test_make_compute_wait_orders_the_forward_after_a_load() -> None:
    kv = KV("LBHNC")
    engine = make_engine(kv)
    engine.slab.view(0).fill_(7)
    with torch.cuda.stream(engine._load.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the load runs late
    engine.submit_load(LoadSpec(JobId(1), (chunk(1, 0, blocks_of(2)),)))
    engine.make_compute_wait([JobId(1)])
    # read on the compute stream right away: ordered after the late load
    seen = torch.stack([kv.page_at(l, b) for l in range(LAYERS) for b in blocks_of(2)])
    assert bool((seen == 7).all())
    engine.shutdown()


@pytest.fixture(autouse=True)
def _no_leaked_errors() -> Iterator[None]:
    yield
    torch.cuda.synchronize()
