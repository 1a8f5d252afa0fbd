"""Collective communication and the backends built on it: communicators (a hand-written ring over
point-to-point, `ring.py`, beside the plain one, `ring_plain.py`, and torch.distributed's own, `native.py`, by name
in `communicators.py`), DDP (`ddp.py`), pipeline/ and tensor/ parallelism, and each one's spec and theory.

Nothing is imported here: a backend's spec (what `psarch keys` and config checks read) needs no torch."""
