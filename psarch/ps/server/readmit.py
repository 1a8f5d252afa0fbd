"""Sync workers dropped and re-admitted. A sync round that waits `backend.timeout_s` for a worker's push goes on
without it (deadlines.py: dead, hung or paused, it is lost); a worker whose process died stays lost, but one that
comes back (continued after a pause, or slow) is taken back, as the parameter server of Li et al. (OSDI '14)
takes a returning node:

1. its next request is refused as a lost worker's (`error`, code "lost"), with the server's version V;
2. it asks every server to `rejoin` at round R = 1 + the newest V its servers named; a server that had not dropped
   it drops it now (so no round of any server waits for it meanwhile), holds the request until its rounds reach
   R, and then takes it back: its clock is R, it is live again, and the `ack` says R;
3. it pulls the parameters of version R and pushes round R with the others.

Every round's mean is over the pushes it gets (pushes.py): a round the worker missed is the others' mean; from R
on it is in every round again. With replicas (psarch/ps/replication.py) every server, each partition's first
holder and its followers alike, takes the worker back at R: a first holder's round R sums its push, and a follower's
sums what the commits name (commits.py), so the copies stay equal.
A request to rejoin at a round the server has passed is refused (code "late"); so
is one from a worker whose process died, or in a mode other than sync (their workers go on alone, or leave); a
"late" refusal names the newest round the server has reached, and the worker asks again at the round after it
(a few times: psarch/ps/worker/link.py's rejoin).
What a server records of each drop, `drops` in its stats: the worker, the round it was dropped from (the server's
version when it was lost), and the round it was re-admitted at (None: not re-admitted)."""
from __future__ import annotations

from typing import Callable, TypedDict

from psarch.ps import wire
from psarch.ps.errors import PSError, RejoinLate
from psarch.ps.server.replies import Replies
from psarch.ps.server.state import ServerState


class Drop(TypedDict):
    """One drop of a worker from a server's rounds (ServerStats.drops)."""

    worker: int
    from_round: int
    died: bool                   # its process died (the launcher said so, maybe after a round went on without it)
    readmitted_at: int | None


class Readmissions:
    """A server's drops, and the `rejoin` requests it holds until its rounds reach theirs."""

    def __init__(self, state: ServerState, replies: Replies) -> None:
        self.state, self.replies = state, replies
        self.dead: set[int] = set()     # workers whose process died: never taken back
        self.drops: list[Drop] = []
        self.held: list[tuple[bytes, int, int]] = []   # (connection, worker, round) of each waiting rejoin

    def dropped(self, w: int, died: bool) -> None:
        """Worker w was lost (its process `died`, or a round went on without it)."""
        if died:
            self.dead.add(w)
        self.drops.append({"worker": w, "from_round": self.state.version, "died": died, "readmitted_at": None})

    def died(self, w: int) -> None:
        """Worker w, already dropped, died: never take it back (its held rejoins are refused, its drop says so)."""
        self.dead.add(w)
        last = max((i for i, d in enumerate(self.drops) if d["worker"] == w), default=None)
        if last is not None:
            self.drops[last]["died"] = True
        for held in [h for h in self.held if h[1] == w]:
            self.held.remove(held)
            self.replies.error(held[0], "rejoin", f"rejoin: worker {w} at round {held[2]}: its process died")

    def on_rejoin(self, ident: bytes, msg: wire.Message, lose: Callable[[int, str], None]) -> None:
        """Hold worker w's request to take part again from round `step` (dropping it first, where it is not)."""
        s = self.state
        w, step = msg.header["worker"], msg.header["step"]
        if w >= s.workers:
            raise PSError(f"worker {w}: this run has workers 0..{s.workers - 1}")
        if s.mode != "sync" or s.cfg.backend.embeddings == "rows" or w in self.dead:
            raise PSError(f"rejoin: worker {w} was declared lost" + (
                "" if w in self.dead else f" (a worker is taken back in sync runs of dense tables only, not "
                                          f"backend.mode = \"{s.mode}\", backend.embeddings = "
                                          f"\"{s.cfg.backend.embeddings}\")"))
        if not s.initialised or step > s.cfg.train.steps or any(p.range.version > step for p in s.parts):
            raise RejoinLate(f"rejoin: worker {w} asked to rejoin at round {step}; this server is at round "
                             f"{s.version} of {s.cfg.train.steps}: too late", self.newest())
        if w not in s.lost:
            lose(w, f"it asked to rejoin at round {step}")
        self.held.append((ident, w, step))
        self.serve()

    def serve(self) -> None:
        """Take back every held worker whose round every partition has reached (refuse those it has passed)."""
        s = self.state
        for held in list(self.held):
            ident, w, step = held
            if any(p.range.version < step for p in s.parts):
                continue
            self.held.remove(held)
            if any(p.range.version > step for p in s.parts):
                self.replies.error(ident, "rejoin", f"rejoin: worker {w} asked to rejoin at round {step}; this "
                                                    f"server is at round {s.version}: too late", RejoinLate.code,
                                   self.newest())
                continue
            s.lost.discard(w)
            for p in s.parts:
                p.clock[w] = step
            self.drops[max(i for i, d in enumerate(self.drops) if d["worker"] == w)]["readmitted_at"] = step
            self.replies.send(ident, "rejoin", {"op": "ack", "version": step})

    def held_round(self, w: int) -> int | None:
        """The round worker w's held rejoin asks for (None: none held): every request it sent before is handled."""
        return next((step for _, v, step in self.held if v == w), None)

    def why_absent(self, w: int) -> str:
        """What this server knows of worker w, whose push a follower's round waits for in vain (deadlines.py)."""
        if w in self.dead:
            return "its process died (the launcher said so)"
        last = next((d for d in reversed(self.drops) if d["worker"] == w), None)
        if w in self.state.lost and last is not None:
            return f"this server dropped it from its own rounds at round {last['from_round']} (dead, hung or stopped)"
        return "it is live here, its push of the round not sent or still on its way"

    def newest(self) -> int:
        """The newest round any partition has reached: a refused rejoin may ask again at the round after it."""
        return max((p.range.version for p in self.state.parts), default=0)

    def refuse_all(self, why: str) -> None:
        """The run is over for this server: no held worker can be taken back."""
        for ident, w, step in self.held:
            self.replies.error(ident, "rejoin", f"rejoin: worker {w} at round {step}: {why}")
        self.held = []
