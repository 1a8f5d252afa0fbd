"""The multi-machine path over a real network stack: two emulated nodes, each running
`torchrun --nnodes 2 --node_rank i --master_addr <node 0's address>`, train one model together."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from cluster_setup import needs_root
from psarch.cluster.emulated import IFNAME, EmulatedCluster
from test_launch import TINY
from timing import scaled


@needs_root
def test_torchrun_across_emulated_nodes(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", PSARCH_THREADS="1")
    c = EmulatedCluster(2, 0, 200.0, 200.0)
    try:
        before = c.counters()
        procs = [subprocess.Popen(["ip", "netns", "exec", n.ns, sys.executable, "-m", "torch.distributed.run",
                                   "--nnodes", "2", "--node_rank", str(i), "--nproc_per_node", "1",
                                   "--master_addr", c.nodes[0].address, "--master_port", "29500",  # node 0 is all ours
                                   "-m", "psarch.cli", "run", "tiny.toml", "--out", "torchrun", "--quiet"],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, n in enumerate(c.nodes)]
        outs = [p.communicate(timeout=scaled(240))[0] for p in procs]
        after = c.counters()
    finally:
        c.close()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    s = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert s["world_size"] == 2 and s["steps"] == 4 and (tmp_path / "torchrun" / "model.pt").exists()
    ring = s["traffic"]["per_rank"][1]["sent"]      # what rank 1's ring sent to rank 0 crossed both links
    for ns, (sent, received) in after.items():
        assert sent - before[ns][0] >= ring and received - before[ns][1] >= ring, (ns, after, ring)
