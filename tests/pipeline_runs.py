"""The runs every pipeline test looks at, in one spawned process group per world size (start-up is the cost):
N = 2 runs p = 2 with every schedule and m = 1, 2, 4, 8 (SGD; a few under AdamW) and writes the checkpoints
that N = 4 forks; N = 4 runs p = 4 likewise and dp x p = 2 x 2 (ring and native), resumes and forks. The
single-process references run in the test process. Three steps each: a wrong gradient, a missed micro-batch
or a stage that never steps moves a parameter by about one learning rate (1e-2) in the first step."""
from __future__ import annotations

import json
from pathlib import Path

import parity
from parity import OPTIMIZERS, train

STEPS = 3
BASE = json.loads(json.dumps(parity.TINY_GPT))
BASE["train"].update(steps=STEPS, global_batch=16)   # 16 rows: m = 8 micro-batches of 2 at dp = 1, of 1 at dp = 2
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved")
MICROBATCHES = (1, 2, 4, 8)


def layers(p: int, schedule: str) -> int:
    """Blocks of the model a case runs: one per virtual stage (interleaved: two chunks per rank)."""
    return p * (2 if schedule == "interleaved" else 1)


def config(name: str, layer: int, opt: str = "sgd", **backend) -> dict:
    data = parity.config(name, BASE, train=OPTIMIZERS[opt], backend=backend)
    data["workload"]["gpt"]["n_layer"] = layer
    return data


def pipeline(name: str, n: int, p: int, m: int, schedule: str, opt: str = "sgd", **backend) -> dict:
    extra = {"virtual_stages": 2} if schedule == "interleaved" else {}
    return config(name, layers(p, schedule), opt, **{"kind": "pipeline", **backend}, world_size=n, stages=p,
                  microbatches=m, schedule=schedule, **extra)


def cases(n: int, p: int) -> dict[str, dict]:
    """name -> config of every parity case with p stages at world size n (dp = n / p)."""
    out = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            if schedule == "interleaved" and m % p:
                continue   # the interleaved schedule takes micro-batches in groups of p
            if n // p > 1 and (schedule, m) not in (("1f1b", 4), ("gpipe", 2), ("interleaved", 2), ("naive", 8)):
                continue   # dp x p: a few schedules, each reaching the dp all-reduce
            name = f"pp{p}-dp{n // p}-{schedule}-m{m}"
            out[name] = pipeline(name, n, p, m, schedule)
    for schedule, m in (("1f1b", 4), ("interleaved", 4), ("gpipe", 8)):   # AdamW: a few
        if schedule == "interleaved" and m % p:
            continue
        name = f"pp{p}-dp{n // p}-{schedule}-m{m}-adamw"
        out[name] = pipeline(name, n, p, m, schedule, "adamw")
    if n // p > 1:   # the dp all-reduce over torch.distributed's own collective
        out[f"pp{p}-dp{n // p}-1f1b-m4-native"] = pipeline(f"pp{p}-dp{n // p}-1f1b-m4-native", n, p, 4, "1f1b",
                                                          comm="native")
    return out


def peers(n: int, p: int) -> dict[str, dict]:
    """torch.distributed.pipelining on the same data: each schedule it has, SGD, m = 4."""
    schedules = ("gpipe", "1f1b", "interleaved") if n == p else ("1f1b",)
    return {f"torch-pp{p}-dp{n // p}-{s}": pipeline(f"torch-pp{p}-dp{n // p}-{s}", n, p, 4, s, kind="torch_pipeline")
            for s in schedules}


def bf16(data: dict) -> dict:
    data = json.loads(json.dumps(data))
    data["name"] += "-bf16"
    data["train"]["precision"] = "bf16"
    return data


def references() -> dict[str, dict]:
    """The single-process runs the cases are checked against: one per model depth and optimizer, and bf16."""
    refs = {f"single-l{layer}-{opt}": config(f"single-l{layer}-{opt}", layer, opt)
            for layer in (2, 4, 8) for opt in OPTIMIZERS}
    refs["single-l2-sgd-bf16"] = bf16(refs["single-l2-sgd"])
    return refs


def reference_of(data: dict) -> str:
    return f"single-l{data['workload']['gpt']['n_layer']}-{data['train']['optimizer']}"


def _checkpointed(rank: int, n: int, o: Path, name: str, data: dict, start: Path | None = None,
                  resume: bool = False, every: int = 0) -> dict:
    data = json.loads(json.dumps(data))
    data["name"], data["train"]["steps"] = name, 6
    data["train"]["checkpoint_every"] = every
    return train(rank, n, data, {}, str(o), checkpoints=o / name / "checkpoints" if every else None, start=start,
                 resume=resume)


def world2(rank: int, n: int, out: str) -> dict:
    o = Path(out)
    results = {name: train(rank, n, data, {}, out) for name, data in {**cases(n, 2), **peers(n, 2)}.items()}
    low = bf16(pipeline("pp2-dp1-1f1b-m4", n, 2, 4, "1f1b"))
    results[low["name"]] = train(rank, n, low, {}, out)
    # resume: 6 steps straight, a checkpoint every 3; then from step 3, resumed
    ckpt = pipeline("ckpt", n, 2, 4, "1f1b", "adamw")
    results["resume-straight"] = _checkpointed(rank, n, o, "resume-straight", ckpt, every=3)
    results["resume-resumed"] = _checkpointed(rank, n, o, "resume-resumed", ckpt,
                                              o / "resume-straight" / "checkpoints" / "step_000003", resume=True)
    # a ddp checkpoint that N = 4 forks onto dp x p = 2 x 2
    ddp = config("ddp2", 2, "adamw", kind="ddp", world_size=n)
    results["ddp2"] = _checkpointed(rank, n, o, "ddp2", ddp, every=3)
    return results


def world4(rank: int, n: int, out: str) -> dict:
    o = Path(out)
    runs = {**cases(n, 4), **cases(n, 2), **peers(n, 4), **peers(n, 2)}
    results = {name: train(rank, n, data, {}, out) for name, data in runs.items()}
    # dp x p resumed, and forked from ddp N = 2
    ckpt = pipeline("ckpt", n, 2, 4, "1f1b", "adamw")
    results["dp-resume-straight"] = _checkpointed(rank, n, o, "dp-resume-straight", ckpt, every=3)
    results["dp-resume-resumed"] = _checkpointed(rank, n, o, "dp-resume-resumed", ckpt,
                                                 o / "dp-resume-straight" / "checkpoints" / "step_000003", resume=True)
    results["ddp2-to-pp2dp2"] = _checkpointed(rank, n, o, "ddp2-to-pp2dp2", ckpt,
                                              o / "ddp2" / "checkpoints" / "step_000003")
    # p = 4 writes a checkpoint the test process continues as single
    results["pp4"] = _checkpointed(rank, n, o, "pp4", pipeline("pp4", n, 4, 4, "gpipe", "adamw"), every=3)
    return results
