"""`psarch estimate --plan`: for a model, a device and a network, every architecture ranked by its simulated step.

The model is a GPT's shape (GPTShape), or a config file's model (ConfigModel: `--plan --from CONFIG.toml`, e.g.
the DLRM, whose embedding tables add the hybrid: the tables' rows on PS servers beside ddp or ZeRO-3 over the
dense layers, backend.embeddings = "ps"). Each candidate is a real config (the model, the same global batch:
`micro_batch` samples per device), so its memory is its backend's own theory (psarch.theory.predict: model states,
plus the activations a GPT's rank keeps for backward) and its step its backend's own program (BackendSpec.program,
reduced) played by the step simulator on a cluster of equal links. Compute: 6 FLOPs per dense parameter and token
(forward 2, backward 4; attention's own FLOPs left out; a DLRM's sample is one token, its table lookups none) at the
device's peak x mfu. Then the `psarch run` commands that check the best candidates on an emulated cluster at a
scaled-down N (and model, for a GPT): the run prints its measured step beside the prediction for its own config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from psarch import registry, theory
from psarch.activations import block_activation_bytes
from psarch.cluster.device import MEMORY_GB, PROFILES
from psarch.config import Config, ConfigError, from_dict
from psarch.theory.estimate_steps import HYBRID, has_tables
from psarch.theory.estimate_tensor import GPTShape
from psarch.theory.program import Cluster, DataStep, Program, Transfer
from psarch.theory.simulate import StepTime, simulate
from psarch.units import fmt_size, fmt_time

EMULATED_WORLD = 8    # the scaled-down N of the check on an emulated cluster
SHOWN = 3             # candidates the plan prints a check for


@dataclass(frozen=True)
class Hardware:
    """The device every worker is (a PROFILES name), the fraction of its peak attained, each node's link
    (bytes/s each way) and the latency per message."""

    device: str = "h100"
    mfu: float = 0.4
    bandwidth: float = 50e9     # 400 Gbit/s
    alpha: float = 10e-6

    def flops(self, precision: str) -> float:
        if self.device not in PROFILES or precision not in PROFILES[self.device]:
            raise ConfigError(f"--device {self.device}: profiles are {', '.join(PROFILES)} and {self.device!r} has "
                              f"no {precision} rate" if self.device in PROFILES else
                              f"--device {self.device}: profiles are {', '.join(PROFILES)}")
        return PROFILES[self.device][precision] * 1e12 * self.mfu


@dataclass(frozen=True)
class ConfigModel:
    """The model of a config file (`--plan --from`): its [workload] section, `micro_batch` samples per device a step
    (the config's global batch over its world size) and the file, which the check commands run."""

    section: dict[str, Any]
    micro_batch: int
    path: str

    def workload(self) -> dict[str, Any]:
        return self.section

    def params(self) -> int:
        """Φ: the parameters of the model the section builds (psarch.workload.theory_model)."""
        from psarch.workload import theory_model

        return sum(p.numel() for p in theory_model(from_dict({"workload": self.section})).parameters())

    def tables(self) -> bool:
        return has_tables(self.section)


Model = Union[GPTShape, ConfigModel]


def tokens(model: Model) -> int:
    """Tokens a sample carries: a GPT's sequence, a DLRM's one."""
    if isinstance(model, GPTShape):
        return model.seq
    return int(model.section.get("seq_len", 32)) if model.section.get("model", "gpt") != "dlrm" else 1


def dense_params(model: Model, phi: float) -> float:
    """Of Φ = phi, the parameters that compute (a DLRM's embedding tables only look rows up)."""
    if isinstance(model, ConfigModel) and model.tables():
        return phi - theory.table_params(from_dict({"workload": model.section}))
    return phi


@dataclass
class Candidate:
    """One architecture: its label, backend options, and what theory and the simulator say of it."""

    label: str
    backend: dict[str, Any]
    step_s: float = 0.0
    exposed_s: float = 0.0
    idle_s: float = 0.0
    memory: float = 0.0       # bytes per device: model states and activations kept for backward
    link: float = 0.0         # bytes the busiest node sends per step
    bubble: float = 0.0       # idle by design: the pipeline schedule's
    extra_nodes: int = 0      # machines beside the N workers (dedicated PS servers)
    fits: bool = True


def candidates(shape: Model, world: int) -> list[Candidate]:
    """Every architecture for `world` devices: ring DDP, ZeRO 1-3, the PS with a server per worker (dedicated or
    colocated); for a model with embedding tables the hybrid (ddp and ZeRO-3 over the dense layers, the tables'
    rows on a PS server colocated with each worker: estimate's HYBRID); for a GPT's shape, pipelines (1F1B and
    interleaved, p a power of two dividing N and at most the blocks) and tensor parallelism (t a power of two
    dividing N and the heads, at most 8: one machine's devices)."""
    out = [Candidate("ddp ring", {"kind": "ddp"})]
    out += [Candidate(f"zero-{s}", {"kind": "zero", "stage": s}) for s in (1, 2, 3)]
    if world > 1:
        out.append(Candidate("ps/n dedicated", {"kind": "ps", "servers": world}, extra_nodes=world))
        out.append(Candidate("ps/n colocated", {"kind": "ps", "servers": world, "server_placement": "colocated"}))
    hybrid = {k: (world if v == "n" else v) for k, v in HYBRID.items()}
    if isinstance(shape, ConfigModel):
        if shape.tables():
            out.append(Candidate("ddp + tables on ps/n colocated", {"kind": "ddp", **hybrid}))
            out.append(Candidate("zero-3 + tables on ps/n colocated", {"kind": "zero", "stage": 3, **hybrid}))
        return out
    per = next(k for k in (4, 2, 1) if shape.micro_batch % k == 0)
    p = 2
    while p <= min(world, shape.layers):
        if world % p == 0:
            m = p * per
            out.append(Candidate(f"pipeline 1f1b p={p} m={m}", {"kind": "pipeline", "stages": p, "microbatches": m,
                                                                "schedule": "1f1b"}))
            if shape.layers >= 2 * p:
                out.append(Candidate(f"pipeline interleaved p={p} m={m} v=2",
                                     {"kind": "pipeline", "stages": p, "microbatches": m, "schedule": "interleaved",
                                      "virtual_stages": 2}))
        p *= 2
    t = 2
    while t <= min(8, world):
        if world % t == 0 and shape.heads % t == 0:
            out.append(Candidate(f"tensor t={t}", {"kind": "tensor", "tensor_parallel": t}))
        t *= 2
    return out


def config(shape: Model, world: int, precision: str, optimizer: str, backend: dict[str, Any]) -> Config:
    """The candidate's config: the model, `micro_batch` samples per device per step."""
    return from_dict({"workload": shape.workload(),
                      "train": {"precision": precision, "optimizer": optimizer,
                                "global_batch": shape.micro_batch * world},
                      "backend": {"world_size": world, **backend}})


def simulated_step(cfg: Config, phi: float, device_s: float, bandwidth: float,
                   alpha: float) -> tuple[StepTime, Program] | None:
    """`cfg`'s step (reduced program) with every device computing `device_s` per step, on links of `bandwidth`
    bytes/s and `alpha` s per message; None where its backend has no program."""
    program = registry.spec_of(cfg).program(cfg, phi, DataStep.of(device_s), True)
    if program is None:
        return None
    return simulate(program, Cluster.of(program, bandwidth, alpha)), program


def sent_per_node(program: Program) -> list[float]:
    """Bytes each node of a program (one of the alike nodes it stands for) sends."""
    sent = [0.0] * len(program.nodes)
    for op in program.ops:
        if isinstance(op, Transfer):
            sent[op.src] += op.bytes * op.copies / program.nodes[op.src][1]
    return sent


def activations(cfg: Config, prediction: theory.Prediction) -> float:
    """Bytes a rank keeps for backward: its backend's own figure where it predicts one per rank (the
    pipeline's most held, tensor's blocks: the most of any rank), else a GPT's every block's on the rank's sequences
    (another model's left out: a DLRM keeps a few vectors a sample)."""
    from collective.tensor.theory import BLOCK_ACTIVATIONS

    for key in ("activations_held", BLOCK_ACTIVATIONS):
        held = [float(node.figures[key]) for node in prediction.trainers.values() if key in node.figures]
        if held:
            return max(held)
    if cfg.workload.model != "gpt" or cfg.workload.factory:
        return 0.0
    w, g = cfg.workload, cfg.workload.gpt
    b = cfg.train.global_batch // cfg.backend.world_size
    return g.n_layer * block_activation_bytes(w.seq_len, b, g.n_embd, g.n_head, theory.BYTES[cfg.train.precision])


def plan(shape: Model, world: int, hw: Hardware, precision: str = "bf16",
         optimizer: str = "adamw") -> list[Candidate]:
    """Every candidate that can run (a config its backend accepts), timed and sized, ranked: those that fit the
    device's memory first, each group by step time. Memory: the fullest device's model states (a rank's with the
    nodes it hosts: a colocated server, Prediction.device_memory) plus the most
    activations any rank keeps (pipeline stages differ: a bound where the two are different stages)."""
    phi, rate = shape.params(), hw.flops(precision)
    memory = MEMORY_GB[hw.device] * 1e9
    done = []
    for c in candidates(shape, world):
        try:
            cfg = config(shape, world, precision, optimizer, c.backend)
        except ConfigError:
            continue   # e.g. the batch does not split into this pipeline's micro-batches
        device_s = 6 * dense_params(shape, phi) * shape.micro_batch * tokens(shape) / rate
        timed = simulated_step(cfg, phi, device_s, hw.bandwidth, hw.alpha)
        if timed is None:
            continue
        got, program = timed
        p = theory.predict(cfg, phi)
        c.step_s, c.exposed_s, c.idle_s = got.step_s, got.exposed_s, got.idle_s
        c.memory = p.device_memory() + activations(cfg, p)
        c.link = max(sent_per_node(program))
        idle = [float(node.figures["idle_fraction"]) for node in p.trainers.values() if "idle_fraction" in node.figures]
        if idle:
            c.bubble = max(idle)
        c.fits = c.memory <= memory
        done.append(c)
    return sorted(done, key=lambda c: (not c.fits, c.step_s))


def check_overrides(c: Candidate, shape: Model, hw: Hardware, precision: str) -> list[str]:
    """The --set overrides of experiments/quickstart.toml (of a ConfigModel's own file) that check `c` on an emulated
    cluster of EMULATED_WORLD nodes of the same device and link (its links add no latency of their own), with a GPT
    small enough for this machine's cores (as deep as the pipeline's stages need, heads enough for t); a config
    file's model as it is."""
    n = EMULATED_WORLD
    backend = dict(c.backend)
    if backend.get("servers"):
        backend["servers"] = n
    stages = backend.get("stages", 1) * backend.get("virtual_stages", 1)
    small = {} if isinstance(shape, ConfigModel) else {
        "workload.seq_len": min(shape.seq, 128), "workload.gpt.n_layer": max(2, stages), "workload.gpt.n_embd": 128,
        "workload.gpt.n_head": 8}
    sets = {**small, "train.global_batch": shape.micro_batch * n,
            "train.precision": precision, "train.steps": 30, "backend.world_size": n,
            **{f"backend.{k}": v for k, v in backend.items()}, "cluster.emulate": True,
            "cluster.device": hw.device, "cluster.mfu": hw.mfu, "cluster.link_mbps": hw.bandwidth * 8 / 1e6}
    return [f"{k}=" + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else f"{v:g}"
                       if isinstance(v, float) else str(v)) for k, v in sets.items()]


def check_command(c: Candidate, shape: Model, hw: Hardware, precision: str) -> str:
    """`psarch run` with check_overrides."""
    path = shape.path if isinstance(shape, ConfigModel) else "experiments/quickstart.toml"
    return f"psarch run {path} " + " ".join(f"--set '{s}'" for s in check_overrides(c, shape, hw, precision))


def _model_line(shape: Model) -> str:
    """What the plan's header says of its model."""
    phi = shape.params()
    if isinstance(shape, GPTShape):
        return (f"GPT {shape.layers} x {shape.hidden}, {shape.heads} heads (Φ = {phi / 1e9:.3g}B), {shape.seq} tokens "
                f"x {shape.micro_batch} sequences per device per step")
    model = shape.section.get("model", "gpt")
    tables = f", of it {(phi - dense_params(shape, phi)) / 1e9:.3g}B in embedding tables" if shape.tables() else ""
    return f"{shape.path}'s {model} (Φ = {phi / 1e9:.3g}B{tables}), {shape.micro_batch} samples per device per step"


def report(shape: Model, world: int, hw: Hardware, precision: str = "bf16", optimizer: str = "adamw") -> str:
    """What `psarch estimate --plan` prints."""
    rows = plan(shape, world, hw, precision, optimizer)
    out = [f"== plan: {_model_line(shape)}, {precision} + {optimizer}, on "
           f"N = {world} {hw.device} ({MEMORY_GB[hw.device]:g} GB, mfu {hw.mfu:g}), links "
           f"{hw.bandwidth * 8 / 1e9:g} Gbit/s, latency {fmt_time(hw.alpha)}; ranked by simulated step",
           f"{'#':>3} {'architecture':<36} {'step':>9} {'exposed':>9} {'idle':>9} {'memory':>9} {'fits':>4} "
           f"{'sent/link':>10} {'bubble':>6}"]
    for i, c in enumerate(rows, 1):
        note = f"  (+{c.extra_nodes} server nodes)" if c.extra_nodes else ""
        out.append(f"{i:>3} {c.label:<36} {fmt_time(c.step_s):>9} {fmt_time(c.exposed_s):>9} "
                   f"{fmt_time(c.idle_s):>9} {fmt_size(c.memory):>9} {'yes' if c.fits else 'NO':>4} "
                   f"{fmt_size(c.link):>10} {c.bubble:>6.3f}{note}")
    best = [c for c in rows if c.fits][:SHOWN]
    if best:
        small = "" if isinstance(shape, ConfigModel) else " (a GPT small enough for this machine)"
        out += ["", f"== check the best {len(best)} on an emulated cluster at N = {EMULATED_WORLD}{small}; each run "
                    f"prints its measured step beside its own prediction:"]
        out += [check_command(c, shape, hw, precision) for c in best]
    else:
        out += ["", "no candidate fits the device's memory"]
    return "\n".join(out) + "\n"
