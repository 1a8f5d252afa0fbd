"""Chain replication of the servers (backend.replicas = r; Li et al., OSDI '14, section 4.3): server i's partitions,
parameters and optimizer state, are also held by servers i + 1, ..., i + r of a ring (partitions.chain).

How it runs (sync only: psarch/ps/spec.py refuses the rest, in one line, before anything starts):
- every holder of a partition starts from the same initial parameters, and a worker sends each partition's
  pushpull to every live holder (replication before aggregation: each replica receives exactly what its primary
  receives, so it costs r x the servers' inbound bytes, and r x their outbound for the pulls it answers);
- each holder sums a round in worker order and applies the same optimizer step, so the copies stay bit for bit
  equal; a worker's round is complete (its exchange settles) only once every live holder has answered it, i.e.
  applied it: no acknowledged update lives on one server only;
- a worker learns that a server died when its connection drops (ZeroMQ's monitor, worker/client.py; no socket
  sends heartbeats with replicas, so only a process's death drops one, not a pause), stops waiting for it and
  never sends to it again; the replica already has the round's pushes (nothing to re-send), so its reply
  completes the round;
- a partition's first live holder (its primary, or once the primary died the next live holder of its chain)
  decides which workers each of its rounds sums, as a server with no replica does (every live worker's push; a
  worker is dropped on that holder's clock, or when the launcher says its process died); the other holders
  follow it. A follower keeps each push of a round unsummed until a worker tells it (`commit`, sent as the first
  live holder's reply arrives, naming the workers that reply says its round summed: `members_text`) which
  pushes the round sums; it then sums exactly those, in worker order, and drops the rest. A follower never drops
  a worker on its own clock, and takes a push from a worker it has lost (the launcher's word may overtake the
  push). So a worker killed or stopped mid-round is dropped from the same round by every holder, and the copies
  stay bit for bit equal. A worker sends each push to the followers first, then to the first holder: where it
  dies between the two, the first holder never had the push, drops it, and the followers drop the copy they
  have. A commit naming a worker that cannot push the round to the follower (out of range; its pushes there stopped
  before the round before; it asked that server to rejoin at a later round) is refused at once, in one line naming
  the worker (server/commits.py). Left: a follower that never received a push its first holder summed (a worker
  killed as ZeroMQ flushed its sockets in another order) cannot agree; it stops the run with one line naming the
  worker and what the follower knows of it (server/deadlines.py: a follower's pull waits up to 2 x
  backend.timeout_s, its first holder's detection, then its own). A worker told that its first holder died tells
  the next live holder to decide (`commit` without members). A paused worker that returns is taken back as without
  replicas (readmit.py): every server takes it back at the same round R or refuses it as late (it then asks again
  at a later round, and a server that took it back drops it again), and from then on a partition's first holder
  sums its pushes and its followers sum what the commits name, so every holder's rounds agree;
- every pull reply names the workers its round summed, and a worker whose holders disagree anyway stops the
  run (`diverged`).

The launcher (services.py) treats a dead server as a lost one where every partition still has a live holder: it
says so on stderr and goes on; `summary.json`'s `replication.dead_servers` lists it, and model.pt comes from the
live holders. With r = 0, or once every holder of some partition is dead, the run stops with one line naming
the server, as before. A server stopped (SIGSTOP) past backend.timeout_s still stops the run: alive, its
connections stay open, so no worker could tell it from a slow one.

Replication's bytes are booked apart by each server ("replica_<op>", state.py's REPLICA): `bytes_summary`
compares them with the formula, r x the bytes of the same ops at the primaries, counted exactly (not applicable
where a server died: its counters died with it). Every holder answers each pull with the whole partition, so a
worker's downlink is (1 + r) x that of r = 0.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from psarch.ps.partitions import chain, held, held_partitions, replicas
from psarch.ps.server.state import REPLICA

REPLICATED_OPS = ("pull", "push", "pushpull", "sparsepush", "sparsepushpull")   # what a replica is sent too


def orphans(servers: int, r: int, dead: set[int]) -> list[int]:
    """The servers whose partitions have no live holder left."""
    return [j for j in range(servers) if all(h in dead for h in chain(servers, r, j))]


def homeless(what: str, holders: Sequence[int]) -> str:
    """The one line for partitions (`what`) whose every holder is dead."""
    return (f"{what} no live holder (servers {', '.join(map(str, holders))} are dead; "
            f"backend.replicas = {len(holders) - 1})")


def death(servers: int, r: int, dead: set[int], i: int, text: str) -> str | None:
    """The run's error once server i has died (`text`: what happened to it), None where the run goes on: r = 0
    keeps `text` as the one line; with replicas, it stops only when some partition lost every holder."""
    if not r:
        return text
    lost = orphans(servers, r, dead | {i})
    if not lost:
        return None
    return homeless(f"{text}: server {lost[0]}'s partitions have", chain(servers, r, lost[0]))


def members_text(workers: Iterable[int]) -> str:
    """The workers a round summed, as a `commit` and a pull reply name them: a hexadecimal bit mask (bit w: worker
    w), so that it stays one short string at any N."""
    return format(sum(1 << w for w in set(workers)), "x")


def members_of(text: str, workers: int) -> frozenset[int]:
    """The workers a `members_text` names; ValueError unless it is one, naming at least one of workers
    0..workers - 1 (a round sums at least one push: an empty one would divide its sum by 0)."""
    mask = int(text, 16) if text and all(c in "0123456789abcdef" for c in text) else -1
    if mask > 0 and mask >> workers:
        raise ValueError(f"members {text!r:.40} name worker {mask.bit_length() - 1}: this run has workers "
                         f"0..{workers - 1}")
    if mask <= 0:
        raise ValueError(f"members {text!r:.40}: expected a hexadecimal bit mask of some of workers "
                         f"0..{workers - 1}")
    return frozenset(w for w in range(workers) if mask >> w & 1)


def diverged(what: str, replies: Sequence[tuple[int, dict[str, Any]]]) -> str | None:
    """Where the holders of one partition (`what`) answered one exchange with different rounds, the one line that
    stops the run (None where they agree). `replies`: each answering holder and its reply's header, whose
    `summed` (the workers its last round summed, servers' pulls.py) and `version` must be its first holder's.
    The followers sum what the first holder summed, so this is a safety net: it fires only where they could not
    (a first holder that died mid-round, having answered some workers and not others)."""
    rounds = [(i, h["version"], h.get("summed")) for i, h in replies]
    if all(x[1:] == rounds[0][1:] for x in rounds):
        return None
    said = "; ".join(f"server {i}: version {v}" + (f", workers {sorted(members_of(n, 4 * len(n)))} summed" if n else "")
                     for i, v, n in rounds)
    return f"{what}: its holders' copies diverged ({said})"


def survivors(servers: int, r: int, i: int, dead: set[int]) -> list[int]:
    """The live servers that now serve server i's partitions."""
    return [h for h in chain(servers, r, i) if h not in dead]


def join_held(cfg: Any, helds: dict[int, torch.Tensor], numel: int) -> tuple[torch.Tensor, bool]:
    """The flat fp32 vector from the live servers' held vectors (server i's `helds[i]`: held_partitions joined),
    and whether every copy of a partition was bit for bit its first copy. ValueError where a partition has no copy."""
    flat = torch.empty(numel, dtype=torch.float32)
    seen = torch.zeros(numel, dtype=torch.bool)
    same = True
    for i, parts in enumerate(held_partitions(cfg, numel)):
        if i not in helds:
            continue
        own = helds[i]
        if own.numel() != held(parts):
            raise ValueError(f"server {i} reported {own.numel()} parameters, its partitions hold {held(parts)}")
        pos = 0
        for a, b in parts:
            copy = own[pos:pos + b - a]
            if bool(seen[a:b].all()):
                same = same and torch.equal(flat[a:b].view(torch.int32), copy.view(torch.int32))
            else:
                flat[a:b], seen[a:b] = copy, True
            pos += b - a
    if not bool(seen.all()):
        raise ValueError("some partitions have no live holder")
    return flat, same


def bytes_summary(cfg: Any, ops: list[dict[str, Any]], dead: dict[int, str]) -> dict[str, Any]:
    """summary.json's `replication` bytes from the live servers' traffic by op (TrafficReport's `ops`): what the
    replicas received and sent, beside theory's formula (psarch/ps/theory.py's `replication`: r x what the
    primaries received and sent on the same ops). Where a server died (`dead`) its counters died with it: the
    live servers' bytes are then no whole run's, and the formula is not applicable (None, `formula_note` says why)."""
    from psarch.ps.theory import replication

    def total(prefix: str, key: str) -> int:
        return sum(per.get(prefix + op, {}).get(key, 0) for per in ops for op in REPLICATED_OPS)
    inbound, outbound = total("", "received"), total("", "sent")
    formula = replication(cfg, inbound, outbound)
    out = {"replicas": replicas(cfg), "received": total(REPLICA, "received"), "sent": total(REPLICA, "sent"),
           "primary_received": inbound, "primary_sent": outbound,
           "formula_received": int(formula.received), "formula_sent": int(formula.sent),
           "dead_servers": [{"server": i, "error": e} for i, e in sorted(dead.items())]}
    if dead:
        out.update(formula_received=None, formula_sent=None,
                   formula_note=f"not applicable: server(s) {', '.join(map(str, sorted(dead)))} died, and their "
                                f"byte counters with them; the bytes above are the live servers' only")
    return out
