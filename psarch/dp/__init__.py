"""DP, the single-process data parallelism DDP replaced (torch.nn.DataParallel): one process, one thread per
device; each step the master device's module is replicated to the others, the global batch scattered, the
outputs (each replica's loss) gathered on the master, which computes the loss, sums the replicas' gradients
and steps the optimizer. Its traffic is every copy to and from the master, which grows with the devices.

    trainer.py   the `dp` backend, psarch's own replicate / scatter / parallel_apply / gather / reduce
    torch_dp.py  `torch_dp`: torch.nn.DataParallel itself, the peer (CUDA devices only)
    spec.py      both declared (psarch/backend.py), and their theory
"""
