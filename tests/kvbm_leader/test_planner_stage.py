"""A lookup's stage leaves the leader before the rest of its work: ``RequestPlanner.prepare_load``
calls ``on_signed`` once the plan is signed, before it queues the hit counting on the loop, so
the worker's attach stream (woken from there) runs first."""
from __future__ import annotations

import asyncio

from kvbm_leader.metrics import LeaderMetrics
from kvbm_leader.onboard_cost import OnboardCosts
from kvbm_leader.planner import RequestPlanner
from kvbm_leader.sessions import SessionTable
from test_ledger import keys, make_ledger, stored


class NoMoves:
    """The planner's rebalancer: no promotion or demotion is asked of it here."""

    def maybe_promote(self, keys_) -> None:
        pass

    def maybe_demote(self) -> None:
        pass


def test_the_stage_is_sent_before_the_hit_counting_runs() -> None:
    async def scenario() -> tuple[list[int], int, list[int]]:
        ledger, _ = make_ledger(host=8)
        for record in ledger.membership.workers.values():  # every worker's pools ready
            record.ready_epoch = ledger.membership.pools.epoch
        await stored(ledger, 1, 2, 3)
        sessions = SessionTable()
        session = sessions.open("test", 60.0, 0.0)
        planner = RequestPlanner(ledger.placement, ledger.membership, ledger, NoMoves(), sessions, ledger.feed,
                                 LeaderMetrics(), OnboardCosts())
        stream: asyncio.Queue[int] = asyncio.Queue()
        seen: list[int] = []

        async def attach_stream() -> None:  # the worker's stream, as WorkerStreams.serve drains it
            await stream.get()
            seen.extend(ledger.placement.frequency.frequency(k) for k in keys(1, 2, 3))

        drain = asyncio.ensure_future(attach_stream())
        await asyncio.sleep(0)
        before = ledger.placement.frequency.frequency(keys(1)[0])
        plan, signed = await planner.prepare_load(session.session_id, keys(1, 2, 3), True, 16,
                                                  on_signed=lambda p, s: stream.put_nowait(p.job_id))
        assert signed is not None and len(plan.keys) == 3
        await drain
        await asyncio.sleep(0.01)  # the hit counting has run by now
        return seen, before, [ledger.placement.frequency.frequency(k) for k in keys(1, 2, 3)]

    seen, before, after = asyncio.run(scenario())
    assert all(a > before for a in after), "the lookup counted no hit (the check below would prove nothing)"
    assert seen == [before] * 3, "the hit counting ran before the stage left"
