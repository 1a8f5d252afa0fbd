"""A worker's exchanges of the flat parameter vector with the servers: server i holds partitions `servers[i]` of
it (psarch/ps/layout.py's server_partitions: a contiguous range, or partitions dealt round robin; one per server
when backend.partition_mb = 0). Each partition travels as its own
request, all sent back to back: a server answers a partition's pull as soon as that partition's round allows,
so the worker receives partition p while it still sends p + 1 (push and pull pipelined over a full-duplex
link). Pulled parameters land in the flat buffer (a GPU worker stages them in host memory: the wire is host
memory); in GEO with compression a pushpull's pull is the compressed change since the model the worker holds,
added to it (`synced`)."""
from __future__ import annotations

import time
from itertools import accumulate
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Required, Sequence, TypedDict

import torch

from psarch.checkpoint.reader import CheckpointError
from psarch.flat import FlatParams
from psarch.ps import wire
from psarch.ps.errors import PSError, RejoinLate, WorkerLost
from psarch.ps.layout import chain, held, held_of, one_range
from psarch.ps.messages import commit_header
from psarch.ps.replication import diverged, homeless
from psarch.ps.sparse import add_delta
from psarch.ps.worker.topk import TopKPushes
from psarch.ps.worker.client import PSClient, Request


class Exchange(TypedDict, total=False):
    """What an exchange's replies said (ServerLink.settle), and what a worker's step adds to it (tables)."""

    comm_s: Required[float]      # seconds waited for the replies
    version: int                 # the oldest model version pulled
    skipped: bool                # a server skipped the update (fp16: inf/nan)
    staleness: int               # the largest a server reported
    ahead: int
    tables: dict[str, int]       # the tables' figures of the step (Tables.exchange)
    rejoined_at: int             # sync: the worker was dropped and taken back at this round (readmit.py)


@dataclass(frozen=True)
class Part:
    """Partition `index` of the flat vector (partitions numbered in flat order): elements [lo, hi), held by server
    `server`."""

    index: int
    server: int
    lo: int
    hi: int
    holders: tuple[int, ...] = ()   # every server that holds it: `server`, then its replicas (partitions.chain)


class ServerLink:
    """The dense part of a worker's traffic: pushpull each step (GEO: each sync), pull, fetch, done, save; and
    what the servers said last (the version each partition sent, the loss scale)."""

    def __init__(self, client: PSClient, flat: FlatParams, servers: list[list[tuple[int, int]]], device: torch.device,
                 dtype: torch.dtype, push_dtype: torch.dtype | None = None, topk: TopKPushes | None = None,
                 replicas: int = 0) -> None:
        """replicas: backend.replicas, the servers after each in the ring that hold its partitions too (each
        partition goes to every live holder, and an exchange settles once each has answered: replication.py)."""
        self.client, self.flat, self.servers, self.replicas = client, flat, servers, replicas
        bounds = sorted((a, b, i) for i, parts in enumerate(servers) for a, b in parts)
        self.parts = [Part(j, i, a, b, tuple(chain(len(servers), replicas, i))) for j, (a, b, i) in enumerate(bounds)]
        self.wire_dtype = wire.DTYPE_NAMES[dtype]
        self.push_dtype = push_dtype or dtype   # train.compression = fp16/bf16: pushes cast to 2 bytes
        self.topk = topk                        # train.compression = topk: pushes as (index, value) pairs
        self.host = flat.data if device.type == "cpu" else torch.empty_like(flat.data, device="cpu")
        self.versions = [0] * len(self.parts)   # the version each partition last sent: a push names it
        self.loss_scale = 1.0           # fp16: the servers' loss scale, sent with every pull
        self.posted: list[Request | None] = [None] * len(self.parts)   # this exchange's requests, by partition
        self.copies: list[list[Request]] = [[] for _ in self.parts]   # ... and those to its replicas
        self.served: dict[int, float] = {}   # each dead server: when an exchange first settled without it
        self.copied: set[int] = set()   # priority on a GPU: partitions already copied from the host stage
        # GEO with compression: the model this worker holds (GeoLocal.synced, fp32), which a pushpull's pulled deltas
        # are added to (psarch/ps/server/deltas.py); None: pulls land whole in the flat buffer
        self.synced: torch.Tensor | None = None
        self.t0 = 0.0

    def server_versions(self) -> list[int | None]:
        """Each server's version as a request for its whole range names it: its partitions' least (None for a
        server holding no dense partition)."""
        out: list[int | None] = [None] * len(self.servers)
        for p, v in zip(self.parts, self.versions):
            least = out[p.server]
            out[p.server] = v if least is None else min(least, v)
        return out

    def post(self, p: Part, pushed: torch.Tensor | None, step: int, header: dict[str, Any]) -> None:
        """Send partition p's request of this exchange now: a pushpull of `pushed` (the whole flat gradient or
        delta; its slice travels), or a pull of `step` when nothing is pushed."""
        if not any(self.posted):
            self.t0 = time.perf_counter()
        into: torch.Tensor | None = self.host[p.lo:p.hi]
        if pushed is None:
            r = Request({"op": "pull", "step": step, "want": self.wire_dtype, "offset": p.lo}, into=into)
        else:   # a compressed delta is decoded beside, then added to `synced` (settle)
            op, into = ("pushpull", into) if self.synced is None else ("pushpulldelta", None)
            r = self._push(p, pushed, dict(header, op=op, step=step - 1, version=self.versions[p.index], offset=p.lo),
                           into)
        # to its replicas first: a worker that dies between the two sends leaves its push with followers only,
        # which drop it as their first holder does (replication.py)
        self.copies[p.index] = [Request(dict(r.header), r.tensor, into=into, keys=r.keys) for _ in p.holders[1:]]
        for h, c in zip(p.holders[1:], self.copies[p.index]):
            self.client.post(h, c)
        self.posted[p.index] = r
        self.client.post(p.server, r)

    def post_push(self, p: Part, pushed: torch.Tensor, step: int) -> Request:
        """Priority (priority.py): push partition p's slice of `pushed`, acknowledged once its server has it, then
        pull p's parameters for `step`, answered once the partition's round allows. Returns the push."""
        if not any(self.posted):
            self.t0 = time.perf_counter()
        push = self._push(p, pushed, {"op": "push", "step": step - 1, "version": self.versions[p.index],
                                      "offset": p.lo})
        pull = Request({"op": "pull", "step": step, "want": self.wire_dtype, "offset": p.lo},
                       into=self.host[p.lo:p.hi])
        self.client.post(p.server, push)
        self.client.post(p.server, pull)
        self.posted[p.index] = pull
        return push

    def _push(self, p: Part, pushed: torch.Tensor, header: dict[str, Any], into: torch.Tensor | None = None) -> Request:
        """The request that pushes partition p's slice of `pushed`: whole (cast to the push dtype), or as top-k's
        (index, value) pairs in a `sparse` push."""
        if self.topk is None:
            return Request(header, pushed[p.lo:p.hi].to(self.push_dtype), into=into)
        keys, values = self.topk.pairs(p.index, pushed[p.lo:p.hi])
        return Request(dict(header, op="sparse" + header["op"]), values.view(-1, 1), into=into, keys=keys)

    def landed(self, j: int) -> None:
        """Wait until partition j's pull of this exchange (if one is posted) is in the flat buffer."""
        r = self.posted[j]
        if r is None or j in self.copied:
            return
        if not r.answered:
            self.client.wait(until=r)
        if self.host is not self.flat.data:
            p = self.parts[j]
            self.flat.data[p.lo:p.hi].copy_(self.host[p.lo:p.hi])
        self.copied.add(j)

    def settle(self, since: float | None = None, acks: Sequence[Request] = ()) -> Exchange:
        """Wait for every posted partition's reply (the parameters land in the flat buffer); what they (and
        `acks`, priority's push acknowledgements) said (comm_s: seconds since `since`, or since the first post)."""
        self._wait_committed()
        reqs = [r for r in self.posted if r is not None]
        if len(reqs) != len(self.parts):
            raise RuntimeError(f"an exchange posted {len(reqs)} of {len(self.parts)} partitions")
        reqs = [self._answered(j, r) for j, r in enumerate(reqs)]
        self.posted, self.copies = [None] * len(self.parts), [[] for _ in self.parts]
        if any(r.header["op"] in wire.DELTA_PULLS for r in reqs):
            for p, r in zip(self.parts, reqs):
                self._add_delta(p, r)
        elif self.host is not self.flat.data:
            self.flat.data.copy_(self.host, non_blocking=False)
        self.copied.clear()
        for i in self.client.dead.keys() - self.served.keys():
            self.served[i] = time.time()
        replies = [r.reply for r in reqs] + [r.reply for r in acks]
        self.versions = [r.reply["version"] for r in reqs]
        self.loss_scale = min(p.get("scale", 1.0) for p in replies)
        out: Exchange = {"comm_s": time.perf_counter() - (self.t0 if since is None else since),
                         "version": min(self.versions),
                         "skipped": any(p.get("skipped", False) for p in replies)}
        staleness = [p["staleness"] for p in replies if "staleness" in p]
        if staleness:
            out["staleness"] = max(staleness)
        ahead = [p["ahead"] for p in replies if "ahead" in p]
        if ahead:
            out["ahead"] = max(ahead)
        return out

    def _add_delta(self, p: Part, r: Request) -> None:
        """Add partition p's pulled delta to the model this worker holds, as the server's mirror of it adds it
        (sparse.add_delta); PSError where the reply does not fit the partition."""
        assert self.synced is not None
        values, keys, size = r.received, r.reply_keys, p.hi - p.lo
        if not values.is_floating_point() or (keys is None and values.numel() != size) or (keys is not None and (
                keys.dtype != torch.int64 or keys.numel() != values.numel() or keys.numel() and (
                    int(keys.min()) < 0 or int(keys.max()) >= size))):
            raise PSError(f"worker {self.client.worker}: partition [{p.lo}, {p.hi}): a delta of {values.numel()} "
                          f"{str(values.dtype).removeprefix('torch.')} values" +
                          ("" if keys is None else f" at {keys.numel()} {str(keys.dtype).removeprefix('torch.')} "
                           f"keys, not one in-range int64 key each"))
        add_delta(self.synced[p.lo:p.hi], keys, values)

    def _wait_committed(self) -> None:
        """Wait for every reply; with replicas, as each pushed partition's first live holder answers, tell its other
        holders which workers that round summed (`commit`: they sum the same, replication.py), and tell a replica
        that became the first live holder (the holders before it died) to decide the partition's rounds."""
        if not self.replicas:
            return self.client.wait()
        told: set[int] = set()
        led: set[tuple[int, int]] = set()
        while True:
            for j, p in enumerate(self.parts):
                r = self.posted[j]
                if j in told or r is None or not r.header["op"].endswith("pushpull"):
                    continue
                live = [(h, q) for h, q in zip(p.holders, (r, *self.copies[j])) if h not in self.client.dead]
                if not live:   # no holder left: _answered says so
                    told.add(j)
                    continue
                (first, q), step = live[0], r.header["step"]
                if first != p.server and (j, first) not in led:
                    led.add((j, first))
                    self.client.post(first, Request(commit_header(step, p.lo)))
                if q.answered:
                    for h, _ in live[1:]:
                        self.client.post(h, Request(commit_header(step, p.lo, q.reply["summed"])))
                    told.add(j)
            if not any(self.client.waiting):
                return
            self.client.wait(once=True)

    def _answered(self, j: int, r: Request) -> Request:
        """Partition j's reply of this exchange: its first live holder's (its server's, or where that server died, a
        replica's); PSError where no holder answered, or where the holders' rounds differ (replication.diverged)."""
        p = self.parts[j]
        got = [(h, c) for h, c in zip(p.holders, (r, *self.copies[j])) if c.answered]
        what = f"worker {self.client.worker}: partition [{p.lo}, {p.hi})"
        if not got:
            raise PSError(homeless(f"{what} has", p.holders))
        split = diverged(what, [(h, c.reply) for h, c in got]) if len(got) > 1 else None
        if split:
            raise PSError(split)
        return got[0][1]

    def failovers(self) -> list[dict[str, float | None]]:
        """Each dead server: when this worker saw its connection drop and when an exchange of its first settled after
        that (time.time(); None where none settled since)."""
        return [{"server": i, "dropped_at": t, "served_at": self.served.get(i)}
                for i, t in sorted(self.client.dead.items())]

    def exchange(self, pushed: torch.Tensor | None, step: int, header: dict[str, Any],
                 before: list[Request] | None = None) -> Exchange:
        """Push `pushed`'s slices (if given) and pull the parameters for `step`, every partition of every server
        back to back, one `pushpull` request per partition (after `before[i]` to server i, if given); the
        parameters land in the flat buffer. Returns what the replies said."""
        if before is not None:
            self.t0 = time.perf_counter()
            for i, r in enumerate(before):
                self.client.post(i, r)
        for p in self.parts:
            self.post(p, pushed, step, header)
        return self.settle()

    def abandon(self, first: WorkerLost) -> list[int]:
        """The exchange in flight was refused (`first`: a server dropped this worker): take every other reply; the
        versions the servers named (in their refusals, or in the parameters they sent)."""
        versions = [first.version]
        while any(self.client.waiting):
            try:
                self.client.wait()
            except WorkerLost as e:
                versions.append(e.version)
        versions += [r.reply["version"] for r in self.posted if r is not None and r.answered]
        self.posted = [None] * len(self.parts)
        self.copied.clear()
        return versions

    def rejoin(self, at: int, tries: int = 3) -> int:
        """Ask every server to take this worker back at round `at` (each answers once its rounds reach it), then
        pull the parameters of that round; returns the round. A server that had passed it refuses ("late", naming
        its newest round): every server is asked again at the round after the newest named, up to `tries` times in
        all (then RejoinLate: the worker is lost)."""
        for attempt in range(tries):
            for i in range(len(self.servers)):
                self.client.post(i, Request({"op": "rejoin", "step": at}))
            late = self._late()
            if not late:
                self.pull(at)
                return at
            if attempt == tries - 1:
                raise late[0]
            at = max(e.version for e in late) + 1
        raise AssertionError("tries < 1")

    def _late(self) -> list[RejoinLate]:
        """Every posted request's reply; the "late" refusals among them."""
        late: list[RejoinLate] = []
        while any(self.client.waiting):
            try:
                self.client.wait()
            except RejoinLate as e:
                late.append(e)
        return late

    def pull(self, step: int) -> None:
        """The parameters for `step`, pushing nothing (start-up, a fork from a checkpoint)."""
        self.exchange(None, step, {})

    def fetch(self, after: list[Request] | None = None) -> torch.Tensor:
        """The servers' fp32 parameters (after[i], if given, is sent to server i after its fetch): each live server
        sends its held vector (held_of: with r = 0 its own partitions), and each partition is taken from the first
        holder of its chain that answered; with replicas the other holders' copies must equal it, bit for bit."""
        final = torch.empty(self.flat.numel, dtype=torch.float32)
        dead = self.client.dead
        layout = held_of(self.servers, self.replicas)
        first = {(p.lo, p.hi): next((h for h in p.holders if h not in dead), None) for p in self.parts}
        # a server's vector lands in place where its partitions are one range, each taken from it; else beside
        into = [final[ps[0][0]:ps[-1][1]] if one_range(ps) and all(first[q] == i for q in ps) else torch.empty(held(ps))
                for i, ps in enumerate(layout)]
        reqs = [Request({"op": "fetch"}, into=t) for t in into]
        self.client.exchange([[r, *([after[i]] if after else [])] for i, r in enumerate(reqs)])
        copies: dict[tuple[int, int], dict[int, torch.Tensor]] = {}   # each partition's copy from each server
        for i, (ps, r) in enumerate(zip(layout, reqs)):
            bounds = list(accumulate((b - a for a, b in ps), initial=0))
            for q, lo, hi in zip(ps, bounds, bounds[1:]):
                if r.answered:
                    copies.setdefault(q, {})[i] = r.received[lo:hi]
        for p in self.parts:
            held_by = copies.get((p.lo, p.hi), {})
            what = f"worker {self.client.worker}: fetch: partition [{p.lo}, {p.hi})"
            if not held_by:
                raise PSError(homeless(f"{what} has", p.holders))
            src = [h for h in p.holders if h in held_by]
            taken = held_by[src[0]]
            if taken.data_ptr() != final[p.lo:p.hi].data_ptr():   # (else it landed in place)
                final[p.lo:p.hi] = taken
            differ = [h for h in src[1:] if not torch.equal(held_by[h].view(torch.int32), taken.view(torch.int32))]
            if differ:
                raise PSError(f"{what}: server {differ[0]}'s copy differs from server {src[0]}'s")
        return final

    def save(self, step: int, folder: Path) -> None:
        """Ask every server to write its part of checkpoint `step` into `folder` (acked once every worker asked);
        CheckpointError naming the checkpoint when a server refuses, or does not answer within the client's
        timeout (a run that goes on without a lost worker stops for it: the checkpoint would be incomplete)."""
        try:
            self.client.exchange([[Request({"op": "save", "step": step, "path": str(folder)})] for _ in self.servers])
        except PSError as e:
            raise CheckpointError(f"checkpoint step {step} not written: {e}") from None

    def done(self) -> None:
        """Tell every server this worker is done."""
        self.client.exchange([[Request({"op": "done"})] for _ in self.servers])
