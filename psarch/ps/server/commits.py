"""`commit`: a replica's round follows its first live holder's (backend.replicas, psarch/ps/replication.py).

A worker sends one to each follower of a partition as that partition's first live holder answers its pushpull,
naming the workers that holder's round summed; the first commit of a round decides it (the follower sums those
pushes once it has them all, and drops the others), every later one must name the same workers. A commit whose
round names a worker that can never push it here is refused at once (`absent`); one whose push may still come (a
worker whose process died as it sent, one this server dropped on its own clock that comes back) is waited for, up
to 2 x backend.timeout_s (deadlines.py). A commit without members says that every holder before this one is dead:
the server decides the partition's rounds from then on, as its primary did."""
from __future__ import annotations

from psarch.ps import wire
from psarch.ps.errors import PSError, WorkerLost
from psarch.ps.replication import members_of
from psarch.ps.server.pulls import PullQueue
from psarch.ps.server.pushes import Pushes
from psarch.ps.server.readmit import Readmissions
from psarch.ps.server.replies import Replies
from psarch.ps.server.state import Partition, ServerState


class Commits:
    """The `commit` handler: which pushes a followed round sums."""

    def __init__(self, state: ServerState, replies: Replies, pushes: Pushes, pulls: PullQueue,
                 readmit: Readmissions) -> None:
        self.state, self.replies, self.pushes, self.pulls, self.readmit = state, replies, pushes, pulls, readmit

    def on_commit(self, ident: bytes, msg: wire.Message) -> None:
        s, h = self.state, msg.header
        w = s.sender(msg, lost_ok=True)   # a worker lost here may still be in its first holder's rounds
        if not s.initialised:
            raise PSError("commit before init: no parameters yet")
        part = s.part_at(h["offset"], "commit")
        st, r, step = part.range, part.round, h["step"]
        what = f"commit: partition [{part.lo}, {part.hi}) step {step}"
        if not part.replica:
            raise PSError(f"{what}: the partition is this server's own; its rounds are decided here")
        if step < st.version - 1 and w not in r.last_members:   # stalled past the drop: leave as a lost worker
            raise WorkerLost(f"{what}: worker {w} was dropped from the rounds that went on without it (this server "
                             f"is at step {st.version} of it)", st.version)
        if step > st.version or step < st.version - 1:
            raise PSError(f"{what}: this server is at step {st.version} of it")
        s.changing = True
        if "members" not in h:   # the holders before this one are dead
            part.follows = False
        else:
            try:
                members = members_of(h["members"], s.workers)
            except ValueError as e:
                raise PSError(f"{what}: {e}") from None
            decided = r.last_members if step < st.version else r.members if part.follows else None
            if decided is not None and decided != members:
                raise PSError(f"{what}: its holders' copies diverged (this server's round sums workers "
                              f"{sorted(decided)}, the first live holder's summed workers {sorted(members)})")
            if step == st.version and part.follows:
                gone = self.absent(part, members, step)
                if gone:
                    raise PSError(f"{what}: its first holder's round sums {gone}: the copies cannot agree")
                r.members = members
        self.pushes.complete_round(part)
        self.pulls.serve(part)
        self.replies.send(ident, "commit", {"op": "ack", "version": st.version})

    def absent(self, part: Partition, members: frozenset[int], step: int) -> str | None:
        """Where one of `members` can never push round `step` of `part` here, which and why (None: each has pushed,
        or still may). A worker pushes step s here only once it has pushed s - 1 here or been taken back at s
        (pulls.py: a pull waits for the worker's own push), and sends nothing after a rejoin until it is acked."""
        for w in sorted(members - part.round.pushed):
            if part.clock[w] < step:
                pushed = f"its last push here was of step {part.clock[w] - 1}" if part.clock[w] else \
                    "it never pushed here"
                return (f"worker {w}, which cannot push it here ({pushed}: a round went on without it, and this server "
                        f"has not taken it back)")
            back = self.readmit.held_round(w)
            if back is not None:
                return f"worker {w}, which cannot push it here (it asked this server to rejoin at round {back})"
        return None
