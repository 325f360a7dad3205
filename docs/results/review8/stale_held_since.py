"""Risk (patch 9's held_since, which patch 11's state 2 now reads): held_since
is reset only when _held_at_share runs, and it runs only while some prefill is
stalled. A request held once, then waiting for memory with nothing in transfer,
keeps its old held_since; when memory comes back and its (healthy) prefill
reaches its share with the requests ahead of it, the waiting timeout ends it at
once, counting the time it waited for memory."""
from decode_sim import Prefill
from test_decode_admission_edges import HEALTHY, STUCK, SimTestCase


class TestStaleHeldSinceAbort(SimTestCase):
    def test_ended_at_once_when_held_again(self):
        rank = self.sim(
            [Prefill(HEALTHY, 0.5), Prefill(STUCK, None, acks=False)],
            tokens=8192, slots=64, waiting_timeout=30.0, decode_s=1e6,
        )
        P = self.world.prefills[STUCK]

        def phase1(t):
            if abs(t * 4 - round(t * 4)) < 1e-9:  # 4/s to the stuck one
                self.add(STUCK)
            if abs(t - round(t)) < 1e-9:
                self.add(HEALTHY)

        self.run_for(8, phase1)
        held = [r for r in rank.prealloc.queue if r.held_since is not None]
        print("t=%.1f held at its share: %d, free tokens %d" % (
            self.world.now, len(held), rank.allocator.free_tokens))
        P.transfer_s = 0.5  # recovers: its transfers land and decode (for long)
        self.run_for(40)
        stale = [r for r in rank.prealloc.queue if r.held_since is not None]
        print("t=%.1f queued with held_since (oldest %.1f): %d; in transfer %d; free %d" % (
            self.world.now, min(r.held_since for r in stale), len(stale),
            len(rank.transfer.queue), rank.allocator.free_tokens))
        # Memory comes back: the long decodes end.
        rank.running = [(self.world.now, req) for _, req in rank.running]
        self.run_for(1.0)
        ended = {r.req.bootstrap_room: rank.ended.get(r.req.bootstrap_room) for r in stale}
        ended = {k: v for k, v in ended.items() if v}
        print("ended at once:", len(ended), next(iter(ended.values()), "")[:160])
        self.assertEqual(ended, {})

