"""A Sync batch refused by the per-worker page cap changes nothing: not the index, not the
sequence number the coordinator expects next (issue 14, part 4)."""

from __future__ import annotations

import grpc
import pytest

from bench.scripted_worker import ScriptedWorker
from coordinator.client import AsyncCoordinatorClient
from coordinator.client.outcomes import outcome_of
from coordinator.v1 import coordinator_pb2 as pb
from coordinator.wire import Reason
from tests.coordinator_fixtures import DEV_HASH, running_coordinator, target

PAGE = 16
CAP = 16


def prompt(first: int, pages: int) -> list[int]:
    return list(range(first, first + PAGE * pages))


async def test_batch_over_the_page_cap_is_asked_for_again_after_reconnect() -> None:
    async with running_coordinator(max_pages_per_worker=CAP) as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH)
        await w.start()
        held = w.keys(prompt(1000, 10))
        assert (await w.store(held)).ack.seq == 1

        # Batch 2 removes one page and stores ten: 19 > 16, refused as a whole.
        over = w.keys(prompt(5000, 10))
        refused_seq = await w.send_events([
            pb.PageEvent(kind=pb.PageEvent.KIND_REMOVED, page_keys=held[9]),
            pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(over)),
        ])
        assert refused_seq == 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await w.next_message()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refusal = outcome_of(err.value)
        assert (refusal.reason, refusal.metadata) == (Reason.PAGE_CAP, {"limit": str(CAP)})
        assert refusal.retry_after_ms is None  # retrying the same batch cannot help
        assert "max_pages_per_worker" in (err.value.details() or "")

        async with AsyncCoordinatorClient(target(coord)) as client:
            assert (await client.stats()).index_entries == 10
            # The worker reconnects having seen batch 1 acked: the coordinator must ask for
            # batch 2 again (it was never applied), not claim it.
            await w.disconnect()
            welcome = await w.connect(last_acked_seq=1)
            assert welcome.WhichOneof("body") == "welcome"
            assert welcome.welcome.next_seq == refused_seq
            # Nothing of the refused batch reached the index: the removed page is still held
            # and none of the stored ones is.
            assert (await client.lookup(prompt(1000, 10))).matches == {"w": 10 * PAGE}
            assert (await client.lookup(prompt(5000, 10))).matches == {}

            # The worker resends batch 2 trimmed to fit: applied under the same number.
            fits = over[:6]
            w.seq = 1
            await w.send_events([
                pb.PageEvent(kind=pb.PageEvent.KIND_REMOVED, page_keys=held[9]),
                pb.PageEvent(kind=pb.PageEvent.KIND_STORED, page_keys=b"".join(fits)),
            ])
            assert (await w.next_message()).ack.seq == refused_seq
            assert (await client.lookup(prompt(1000, 10))).matches == {"w": 9 * PAGE}
            assert (await client.lookup(prompt(5000, 10))).matches == {"w": 6 * PAGE}
            assert (await client.stats()).index_entries == 15
        await w.close()


@pytest.mark.parametrize(("host_pages", "refused"), [(40, False), (0, True)])
async def test_the_worker_page_bound_counts_device_and_host_pages(
    host_pages: int, refused: bool
) -> None:
    # 4 device pages: 16 entries at most alone; with 40 host pages, 4 x 44 = 176.
    async with running_coordinator() as coord:
        w = ScriptedWorker(target(coord), "w", hash_config=DEV_HASH, total_pages=4,
                           host_pages=host_pages)
        await w.start()
        keys = w.keys(prompt(1000, 50))
        await w.send_events([pb.PageEvent(kind=pb.PageEvent.KIND_STORED, tier=pb.TIER_CPU,
                                          page_keys=b"".join(keys))])
        async with AsyncCoordinatorClient(target(coord)) as client:
            if refused:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await w.next_message()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert outcome_of(err.value).metadata == {"limit": "16"}
                assert "4x its 4 device and 0 host pages" in (err.value.details() or "")
                assert (await client.stats()).index_entries == 0
            else:
                assert (await w.next_message()).ack.seq == 1
                [info] = await client.workers()
                assert (info.host_pages, info.cached_cpu_pages) == (40, 50)
        await w.close()
