"""ZeRO data parallelism (stages 1, 2, 3) on psarch's communicators, and PyTorch's peers for comparison."""
