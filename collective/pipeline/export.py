"""The consolidated model on rank 0: pipeline 0's stages send their fp32 masters there (the other pipelines
hold replicas), and rank 0 cuts each into parameters by its stage's layout."""
from __future__ import annotations

import torch

from collective.pipeline.p2p import P2P

Layout = list[tuple[str, torch.Size, int]]   # (name, shape, offset in the stage's flat buffer)


def layout_of(shapes: dict[str, tuple[int, ...]], held: set[str]) -> Layout:
    """The flat layout of the parameters named in `held`, in the model's order (`shapes` is in it)."""
    out, offset = [], 0
    for name, shape in shapes.items():
        if name in held:
            out.append((name, torch.Size(shape), offset))
            offset += torch.Size(shape).numel()
    return out


def gather_masters(p2p: P2P, master: torch.Tensor, stage: int, dp_rank: int,
                   layouts: list[Layout]) -> dict[str, torch.Tensor] | None:
    """Every parameter's fp32 value on global rank 0 (stage 0 of pipeline 0), None elsewhere; stage s of
    pipeline 0 is global rank s. A collective call for pipeline 0's ranks; the others return at once."""
    if dp_rank != 0:
        return None
    if stage != 0:
        p2p.send(master, 0, "parameters", 0).wait()
        return None
    flats = [master.detach().cpu()]
    for s in range(1, len(layouts)):
        numel = sum(shape.numel() for _, shape, _ in layouts[s])
        flats.append(p2p.recv((numel,), torch.float32, torch.device("cpu"), s, "parameters", 0).wait())
    return {name: flat[o:o + shape.numel()].view(shape).clone()
            for flat, layout in zip(flats, layouts) for name, shape, o in layout}
