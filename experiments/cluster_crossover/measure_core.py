"""This CPU's measured speed on cluster_crossover.toml's model, per N (a worker's batch is global_batch / N):
psarch.cluster.core.flops_per_s, what the default device measures at each run's start."""
from psarch.config import load_config
from psarch.cluster import core
for n in (2, 4, 8):
    cfg = load_config("experiments/cluster_crossover/cluster_crossover.toml", [f"backend.world_size={n}"])
    rates = [core.flops_per_s(cfg) for _ in range(3)]
    print(n, " ".join(f"{r / 1e12:.6f}" for r in rates), flush=True)
