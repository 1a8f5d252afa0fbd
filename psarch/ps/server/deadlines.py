"""The clocks of a server: a worker silent too long is lost (standalone servers), so is a worker a barrier round
has waited more than `backend.timeout_s` for (the round goes on without it), and a pull that waits more than
`backend.timeout_s` fails the server with an error naming the workers it waits for."""
from __future__ import annotations

from psarch.ps.server.readmit import Readmissions
from psarch.ps.server.replies import Replies
from psarch.ps.server.state import ServerState


class Deadlines:
    """Checked by the serve loop between requests (ParameterServer.check_deadlines)."""

    def __init__(self, state: ServerState, replies: Replies, readmit: Readmissions) -> None:
        self.state, self.replies, self.readmit = state, replies, readmit

    def silent(self, now: float) -> list[tuple[int, str]]:
        """(worker, why) of each live worker silent for more than silence_s, with no pull waiting on us."""
        s = self.state
        if s.last_seen is None:
            return []
        waiting = {p.worker for p in s.pending.values()}   # a worker waiting on a pull is waiting on us
        return [(w, f"no message from it for more than {s.silence_s:g} s ({s.silence_text})")
                for w in sorted(s.live - s.done - waiting) if now - s.last_seen[w] > s.silence_s]

    def overdue(self, now: float) -> list[tuple[int, str]]:
        """(worker, why) of each live worker a barrier round has waited more than timeout_s for: dead, hung or
        stopped, it is lost, and the round goes on without it (ParameterServer.lose)."""
        s = self.state
        t = s.timeout_s
        for part in s.parts if s.barrier else []:
            if part.follows:   # its first holder drops workers from its rounds (psarch/ps/replication.py)
                continue
            r = part.round
            if r.pushed and now - r.since > t:
                what = "gradients" if s.mode == "sync" else "deltas"
                where = f" of partition [{part.lo}, {part.hi})" if len(s.parts) > 1 else ""
                return [(w, f"no {what}{where} for {s.mode} step {part.range.version} within backend.timeout_s = "
                            f"{t:g} s (workers {sorted(r.pushed)} pushed)") for w in sorted(s.live - r.pushed)]
        return []

    def check_waits(self, now: float) -> None:
        """Fail the server when a pull has waited more than timeout_s (a replica's that follows its first holder: twice
        that, since its first holder may wait timeout_s for a worker before it decides the round)."""
        s = self.state
        t = s.timeout_s
        for p in s.pending.values():
            follows = p.part is not None and p.part.follows
            if now - p.since <= (2 * t if follows else t):
                continue
            if not s.initialised:
                return self.replies.fail(f"worker {p.worker} waited more than backend.timeout_s = {t:g} s "
                                         f"for the initial parameters: no worker sent init")
            part = p.part if p.part is not None else s.parts[0]   # asked before init: the first (pulls.ready)
            if follows and part.round.members is not None:
                missing = "; ".join(f"worker {w}: {self.readmit.why_absent(w)}"
                                    for w in sorted(part.round.members - part.round.pushed))
                return self.replies.fail(f"partition [{part.lo}, {part.hi}) step {part.range.version}: its first "
                                         f"holder summed pushes that never reached this replica within 2 x "
                                         f"backend.timeout_s = {2 * t:g} s ({missing}): the copies cannot agree")
            if follows:
                return self.replies.fail(f"partition [{part.lo}, {part.hi}) step {part.range.version}: no worker said "
                                         f"which pushes its first holder summed within 2 x backend.timeout_s = "
                                         f"{2 * t:g} s (worker {p.worker} waits for step {p.step})")
            slowest = part.slowest(s.live)
            slow = sorted(w for w in s.live if part.clock[w] == slowest)
            return self.replies.fail(f"worker {p.worker} waited more than backend.timeout_s = {t:g} s "
                                     f"for step {p.step}; waiting on worker(s) {slow} (at step {slowest})")
