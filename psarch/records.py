"""The records that pass between a run's processes and files, declared once for their writers and readers:
what each step of a rank leaves (StepRecord, a line of ranks/rank<R>.jsonl), what a rank leaves when it is
done (RankRecord, ranks/rank<R>.json), what every rank is told of the services beside it (ServiceInfo), a
line of metrics.jsonl (MetricsRow), and summary.json (Summary) with the sections reports read. The cluster's own
records (a pacer's fields of a step, a virtual device's facts, the emulated nodes) are psarch/cluster/records.py."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

from psarch.cluster.records import ClusterReport, DeviceFacts, PacedFields, VirtualDeviceSummary

if TYPE_CHECKING:   # a model's tensors, named in annotations only: reports and config errors never import torch
    from psarch.timeline import SpanFields
    import torch


class StepRecord(PacedFields):
    """One rank's step: the runner writes it as the step completes (psarch/launch/runner.py), with what a pacer
    adds (PacedFields, not required)."""

    step: int
    rank: int
    loss: float                  # mean loss over this rank's shard of the global batch
    step_time_s: float           # Trainer.step alone, timed by the runner's StepLoop
    comm_s: float                # blocked on communication, where the backend can tell
    sent: int                    # bytes this rank sent in the step (set-up traffic excluded)
    received: int
    skipped: bool                # fp16: the update was skipped for inf/nan gradients
    loss_scale: float | None
    extra: dict[str, float]      # the backend's own figures (StepStats.extra), never a core column


class MemoryFigures(TypedDict):
    """MemoryReport.to_dict(): one rank's model-state bytes by category (psarch/trainer.py), with their total."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    frozen: int
    working: int
    gathered_peak: int
    grad_buffer_peak: int
    peak: int | None
    peak_kind: str | None
    padding: int
    error_feedback: int
    total: int


class OpFigures(TypedDict):
    """One operation's bytes and calls (OpTraffic)."""

    sent: int
    received: int
    calls: int


class TrafficFigures(TypedDict):
    """TrafficReport.to_dict(): one rank's bytes, in all and by operation; `modelled` when not seen on the wire."""

    sent: int
    received: int
    modelled: bool
    ops: dict[str, OpFigures]


class Staleness(TypedDict):
    """summary.json's `staleness` (a PS run's): the histogram of its updates' staleness, by update of one partition."""

    histogram: dict[str, int]    # staleness -> updates
    updates: int
    mean: float
    max: int
    counted: str


class RefusedPushes(TypedDict):
    """summary.json's `refused_pushes` (a PS run's)."""

    non_finite_per_worker: list[int]   # pushes refused for inf/nan, the most any one server refused


class ServerDetail(TypedDict):
    """summary.json's servers_detail[]: what one PS server says of itself beyond its bytes (its stats' own)."""

    server: int
    address: str
    range: list[int]
    partitions: int
    version: int
    rejected: int
    refused_non_finite: list[int]
    lost: list[int]
    drops: list[Any]             # psarch.ps.server.readmit.Drop: each worker it dropped, from which round, re-admitted at
    dropped_connections: dict[str, int]   # connections it shut down, by why (psarch/ps/server/connections.py)
    applied_pushes: int          # pushes it applied, a partition's each; repeats answered without applying them
    repeats: int                 # (psarch/ps/server/repeats.py)
    skipped_updates: int
    failure: str | None


class SSPSummary(TypedDict):
    """summary.json's `ssp`: the bound, the most a worker ran ahead, and the trace (written apart: trace_file)."""

    staleness_bound: int
    max_ahead: int
    trace: NotRequired[list[list[int]]]
    trace_file: NotRequired[str]


class Predicted(TypedDict):
    """summary.json's `predicted`: theory.Prediction.to_dict(). Each serving role (a node with no rank) adds
    ROLE_sent and ROLE_received to traffic_per_step and ROLE_memory here, under the name its backend gives it: a
    PS's and the hybrid's are `server_sent`, `server_received` and `server_memory`."""

    memory_per_rank: dict[str, float]    # the fullest rank's params, grads, optimizer, buffers and their total
    traffic_per_step: dict[str, float]   # worker_sent, worker_received: the busiest rank's (and each serving role's)
    rounds_per_step: float
    messages_per_step: float
    server_memory: NotRequired[float]    # a serving role's memory (ROLE_memory), here the PS's servers'
    per_rank: NotRequired[list[dict[str, Any]]]   # where ranks are told apart: NodePrediction.to_dict() of each
    # each role's node by name: NodePrediction.to_dict() with its ranks, its count of nodes and its host
    nodes: NotRequired[dict[str, dict[str, Any]]]


class LostWorker(TypedDict):
    """A worker a mode went on without (summary.json's lost_workers)."""

    rank: int
    error: str                   # its error's first line


class MetricsRow(TypedDict):
    """A line of metrics.jsonl: one step merged over the ranks that finished it (psarch/launch/outputs.py)."""

    step: int
    loss: float                  # mean over the ranks
    step_time_s: float           # the slowest rank's
    workers_sent: int            # bytes all workers together sent in the step
    workers_received: int
    skipped: bool                # some rank skipped its update
    loss_scale: NotRequired[float]           # fp16: rank 0's scale this step
    workers: NotRequired[list[StepRecord]]   # each rank's own record, where several ranks finished the step
    extra: NotRequired[dict[str, float]]     # one rank alone: its StepRecord's extra


@dataclass
class RankRecord:
    """What one rank leaves when its steps are done (psarch.launch.runner.run_rank returns it; outputs saves it)."""

    rank: int
    steps: list[StepRecord]              # None in ranks/rank<R>.json where they are in ranks/rank<R>.jsonl
    memory: MemoryFigures
    traffic: TrafficFigures
    extra: dict[str, Any]                # Trainer.summary_extra()
    device: str
    dist_backend: str | None
    entropy_floor: float | None
    params: int                          # parameter count Φ (those that train), before the backend sharded the model
    workload: str
    model_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)   # rank 0: the model
    virtual_device: DeviceFacts | None = None   # a virtual device's FLOPs and nominal times (VirtualDevice.facts)
    frozen_params: int = 0               # parameters that do not train (train.trainable, LoRA's base weights)
    timeline: list[SpanFields] = field(default_factory=list)   # train.trace_steps' spans (psarch.timeline)

    def to_json(self) -> dict[str, Any]:
        """Everything but the model (saved apart, as model.pt): JSON-able."""
        out = asdict(self)
        out.pop("model_state")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RankRecord":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"rank record: unknown field(s) {sorted(unknown)}")
        return cls(**data)


class ServiceFields(TypedDict, total=False):
    """ServiceInfo as JSON (to_dict): what is left out takes its default."""

    addresses: list[str]
    auth: dict[str, str] | None
    restored: bool


@dataclass
class ServiceInfo:
    """What every rank needs to reach the services a backend started (BackendSpec.start_services): the
    servers' addresses, the credentials folder and mechanism, and whether they start from a checkpoint.
    JSON-able: it crosses to spawned ranks and, under torchrun, over the process group."""

    addresses: list[str] = field(default_factory=list)
    auth: dict[str, str] | None = None   # Credentials.to_dict(): mechanism and folder
    restored: bool = False

    def to_dict(self) -> ServiceFields:
        return cast(ServiceFields, asdict(self))

    @classmethod
    def from_dict(cls, data: ServiceFields | None) -> "ServiceInfo":
        return cls(**(data or {}))


class RestartCost(TypedDict):
    """failure_cost.restarts[]: one restart's time lost, measured (seconds in the cluster's time, as Struck's at_s)
    beside psarch.theory.failures' prediction, made from what the first world measured before any failure (its
    start-up and step time) and the launcher's waits."""

    kill_step: int           # the step the world's first kill struck as it began
    detection_s: float | None   # the kill's at_s to the launcher finding the world stopped (Restart.stopped_at_s)
    detection_predicted_s: float   # the launcher's poll interval (lifecycle.TICK_S) in the cluster's time
    relaunch_s: float | None    # stopped_at_s to the next world's launch (Restart.at_s): teardown, checkpoint
                                # found (not predicted)
    startup_s: float | None     # the next world's launch to its first step (World)
    startup_predicted_s: float | None   # faults.startup_s where set, else the first world's launch to its first step
    steps_lost: int          # measured: Restart.steps_lost (steps done past the checkpoint, done again)
    steps_lost_predicted: int   # theory.failures.steps_lost(kill_step, checkpoint_every)
    recompute_s: float       # the steps done again, their measured step times summed
    world_size: int          # the restarted world's (N, or N - 1 after a shrink)
    step_predicted_s: float | None   # its predicted step: the first world's median, times the step simulator's
                                     # ratio at its size where that differs (theory.world_step)
    recompute_predicted_s: float | None   # steps_lost_predicted x step_predicted_s
    time_lost_s: float | None   # detection + relaunch + start-up + recompute, measured
    time_lost_predicted_s: float | None   # theory.failures.time_lost of the predicted parts


class FailureCost(TypedDict):
    """summary.json's `failure_cost` (faults.restart = "replace" or "shrink"): goodput over the whole run and each
    restart's cost; the mean steps and time a failure at a uniformly random step loses, by theory."""

    wall_s: float            # the launch of the first world to the end of the last (cluster's time)
    goodput_steps_per_s: float   # steps completed / wall_s
    goodput_predicted_steps_per_s: float | None   # steps / the predicted wall: start-ups, detections, each world's
                                                  # steps (recomputed ones too) at its predicted step
    ideal_steps_per_s: float     # 1 / median step time: the run without failures or start-ups
    checkpoint_every: int
    mean_steps_lost_predicted: float   # theory.failures.mean_steps_lost(checkpoint_every)
    mean_time_lost_predicted_s: float | None   # the same, as time: detection + start-up + its recompute (at the
                                               # restarted world's step)
    restarts: list[RestartCost]


class Summary(TypedDict, total=False):
    """summary.json's top-level figures every run has (a stopped run: status, error and those it had);
    backends and services add sections (`extra`, `cluster`, `staleness`, ...)."""

    name: str
    status: str                  # "finished", "failed" or "interrupted"
    error: str
    backend: str                 # backend.kind
    variant: str                 # BackendSpec.variant
    label: str                   # BackendSpec.label: the architecture, as every report names it
    lockstep: bool               # BackendSpec.lockstep
    world_size: int
    servers: int                 # PS servers (0 elsewhere)
    workload: str
    precision: str
    optimizer: str
    params: int                  # parameters that train (Φ of every formula)
    frozen_params: int           # parameters that do not (train.trainable, LoRA's base weights)
    steps: int
    steps_planned: int
    global_batch: int
    final_loss: float | None
    entropy_floor: float | None
    gap: float | None
    step_time_s: float           # median after warm-up
    samples_per_s: float
    comm_s: float
    skipped_steps: int
    device: str
    dist_backend: str | None
    memory: dict[str, Any]       # per_rank[]: MemoryReport dicts with their rank; servers[] for PS
    traffic: dict[str, Any]      # per_rank[]: TrafficReport dicts with per-step means; servers[] for PS
    predicted: Predicted
    # each role's nodes as measured, by the names the prediction's nodes have (psarch.report.nodes): a node's
    # memory by category and its bytes sent and received, over the run and per step, with its rank or index
    nodes: dict[str, list[dict[str, Any]]]
    samples_per_s_is: str        # throughput.definition: what samples_per_s means for this run
    lost_workers: list[LostWorker]
    dropped_workers: list[Any]      # ps: each drop of a worker from the rounds (psarch.ps.servers_summary.dropped_workers)
    extra: dict[str, list[Any]]  # each rank's summary_extra, key by key
    virtual_device: VirtualDeviceSummary
    # what the services measured (BackendSpec.start_services' extra), where a backend has them
    cluster: ClusterReport
    staleness: Staleness
    refused_pushes: RefusedPushes
    auth: str                    # the PS's mechanism ("none" where backend.auth is)
    servers_detail: list[ServerDetail]
    ssp: SSPSummary
    model_from_servers_error: str   # why the servers' parameters could not be written as model.pt
    started_from: dict[str, Any]    # Config.started_from: the checkpoint a fork started from
    faults: list[Any]               # [faults] struck: psarch.launch.faults.Struck (node, action, step, signal, at_s)
    restarts: list[Any]             # worlds started again (faults.restart): psarch.launch.faults.Restart
    replication: dict[str, Any]     # backend.replicas: replication's bytes beside its formula, dead servers
    stopped_at_s: float             # a faulted run that stopped: when the launcher found it stopped (as faults' at_s)
    ended_at_s: float               # a run that finished: when its last world ended (as faults' at_s)
    worlds: list[Any]               # each world started: launched, first step began (psarch.launch.worlds.World)
    dilation: float                 # the emulation's D: every time above is the wall clock / D (1 but on virtual devices)
    failure_cost: FailureCost       # faults.restart = "replace": psarch.launch.failure_cost
    startup: dict[str, Any]         # faults.startup_s: the paced start-up and its overrun worlds (psarch.cluster.startup)
    timeline: list[SpanFields]      # the services' spans of train.trace_steps: into trace.json, not summary.json
