"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): each GPT block's matrices split over t ranks, the
activations all-reduced twice per block forward and twice backward; with data parallelism beside it over
dp = world_size / t replicas. `backend.kind = "tensor"` (psarch's, over the ring or native communicator) and
`"torch_tensor"` (torch.distributed.tensor.parallel, the peer).

    mesh.py      the dp x t grid of ranks, its groups and communicators
    layers.py    the f / g / gather autograd functions; column-, row- and vocabulary-parallel layers
    split.py     which part of each GPT parameter a rank holds, and the cut of a GPT into those parts
    state.py     the shards as checkpoint fragments, and gathered into the full model
    trainer.py   the backend's Trainer
    theory.py    bytes, memory and activations predicted
    torch_peer.py   PyTorch's own tensor parallelism, the peer (its benchmark: `psarch bench tensor`)
"""
