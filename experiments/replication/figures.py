"""The replication study's figures from its three run folders (README.md): replication's bytes beside the formula,
the killed run's model against the plain run's, and the time from the kill to the first round served without
the dead server.

    python experiments/replication/figures.py runs/replication_r0 runs/replication runs/replication_kill
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from psarch.report.nodes import serving


def predicted_replica_bytes(s: dict) -> float:
    """Theory's bytes the replicas receive per step: of every serving node's (every server's (1 + r) x N x S / k),
    the r copies."""
    r = s["replication"]["replicas"]
    return sum(role.total("received")[1] for role in serving(s)) * r / (1 + r)


def main(r0: str, r1: str, killed: str) -> None:
    s0, s1, sk = (json.loads((Path(d) / "summary.json").read_text()) for d in (r0, r1, killed))
    rep = s1["replication"]
    print(f"replication bytes (r = 1, no fault): received {rep['received']} = formula {rep['formula_received']} "
          f"({rep['received'] == rep['formula_received']}); sent {rep['sent']} = formula {rep['formula_sent']} "
          f"({rep['sent'] == rep['formula_sent']})")
    per_step = rep["received"] / s1["steps"]
    print(f"  per step: {per_step:.0f} B received by the replicas; theory r x N x S = "
          f"{predicted_replica_bytes(s1):.0f} B (payload only)")
    same = {k: torch.equal(v, torch.load(Path(r0) / "model.pt", weights_only=True)[k])
            for k, v in torch.load(Path(r1) / "model.pt", weights_only=True).items()}
    print(f"r = 1 model == r = 0 model, bit for bit: {all(same.values())}")
    killed_model = torch.load(Path(killed) / "model.pt", weights_only=True)
    plain = torch.load(Path(r1) / "model.pt", weights_only=True)
    print(f"killed run: status {sk['status']}, steps {sk['steps']}, dead {sk['replication']['dead_servers']}; "
          f"model == plain r = 1 run, bit for bit: {all(torch.equal(killed_model[k], plain[k]) for k in plain)}")
    kill = sk["faults"][0]["at_unix"]
    for rank, f in enumerate(sk["extra"]["failovers"]):
        for x in f:
            print(f"  worker {rank}: connection to server {x['server']} dropped {1e3 * (x['dropped_at'] - kill):.1f} ms "
                  f"after the kill; first round served without it {1e3 * (x['served_at'] - kill):.1f} ms after")
    print(f"median step time: r = 0 {1e3 * s0['step_time_s']:.1f} ms, r = 1 {1e3 * s1['step_time_s']:.1f} ms, "
          f"killed {1e3 * sk['step_time_s']:.1f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:4])
