"""The [backend] section. Its class is the chosen backend's own (BackendSpec.options): a frozen dataclass of the
core's options below and of the groups of options it includes by name, so a backend reads only what it declares.
Groups that several backends read are declared here, once; an option one backend alone reads is declared in
its spec. The TOML stays one flat [backend] table (every option name is unique across backends), so a sweep
over kinds and `--set backend.x=...` read the same whichever backend a key belongs to."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from psarch import registry
from psarch.config.fields import option


@dataclass(frozen=True)
class CoreBackendConfig:
    """How workers synchronise: the options of every backend; each backend adds its own (`psarch keys`).
    An option set explicitly must apply to the chosen backend (`psarch.config.applies`)."""

    kind: str = option("single", "backend ('torch_*': PyTorch's own implementation, the peer)", choices=registry.kinds)
    world_size: int = option(1, "number of workers", min=1)
    device: str = option("auto", "where ranks compute ('auto': cuda if available)", choices=("auto", "cpu", "cuda"))
    dist_backend: str = option("auto", "torch.distributed backend ('auto': nccl when each rank has its own GPU, else gloo)",
                               choices=("auto", "gloo", "nccl"), per_backend=True)
    embeddings: str = option("dense", "how embedding tables move: as ordinary parameters ('dense'), only the "
                                      "touched rows ('rows'), row-sharded over ranks ('sharded'), or on parameter "
                                      "servers while a collective moves the dense part ('ps', ddp: the hybrid)",
                             choices=("dense", "rows", "sharded", "ps"))
    timeout_s: float = option(60.0, "seconds a rank or server waits for a peer before the run stops with an error",
                              min=0.1, per_backend=True)


# ---------------------------------------------------------------- groups several backends include

@dataclass(frozen=True)
class Communicator:
    """Which collectives carry a backend's all-reduces, reduce-scatters and all-gathers (ddp, zero, pipeline, tensor)."""

    comm: str = option("ring", "communicator", choices=("ring", "native"))


@dataclass(frozen=True)
class Buckets:
    """DDP's gradient buckets (ddp and PyTorch's DDP-style peers)."""

    bucket_cap_mb: float = option(25.0, "gradient bucket size in MiB", min=0.0)


@dataclass(frozen=True)
class Overlap:
    """Communication started from backward's hooks (ddp, zero, ps)."""

    overlap_comm: bool = option(True, "start communication from autograd hooks during backward")


@dataclass(frozen=True)
class PSServers:
    """Parameter servers and their connections (ps; ddp with backend.embeddings = "ps", whose tables' rows live on
    PS servers: collective/ps_tables.py)."""

    servers: int = option(1, "number of server processes", min=1)
    server_placement: str = option("dedicated", "on an emulated cluster: each server on a node of its own "
                                                "('dedicated'), or server i on worker i's node, sharing its link "
                                                "('colocated'; backend.servers <= world_size)",
                                   choices=("dedicated", "colocated"))
    host: str = option("127.0.0.1", "address servers bind to")
    auth: str = option("auto", "who may talk to a server: 'curve' (CurveZMQ keys), 'plain' (a password per worker), "
                               "'auto' (plain on loopback, curve when servers bind an address other machines reach), "
                               "'none' (loopback only)", choices=("auto", "curve", "plain", "none"))
    keys: str = option("", "folder of `psarch keygen` credentials ('': fresh ones per run; `psarch server` needs it)")
    heartbeat_s: float = option(10.0, "ZeroMQ heartbeat interval; 0 turns heartbeats off", min=0.0)
    heartbeat_timeout_s: float = option(30.0, "a peer silent this long after a heartbeat (or mid-message, or "
                                              "mid-handshake) is dropped", min=0.1)
    handshake_timeout_s: float = option(5.0, "a connection still in its handshake after this long is dropped",
                                        min=0.01)
    resend_timeout_s: float = option(0.0, "a worker's request unanswered this long is sent again under its id, which "
                                          "the server applies once, as on every reconnection (0: only on "
                                          "reconnection; a live connection loses nothing, and a server may hold a "
                                          "request on purpose: a sync round waiting for a slow worker)", min=0.0)
    max_connections: int = option(0, "most connections past their handshake per server; handshakes in progress or "
                                     "refused hold none (0: world_size + 16)", min=0)
    max_connections_per_worker: int = option(2, "most connections past their handshake per server that one worker's "
                                                "credentials may hold (a worker needs one; a reconnect briefly two)",
                                             min=1)
    max_pending: int = option(0, "most connections per server that no request has proved yet (handshakes in "
                                 "progress, refused, or silent); past it the oldest is dropped (0: world_size + 16)",
                              min=0)
    inflight_mb: float = option(0.0, "most MiB one connection may have in flight at a server each way (a message not "
                                     "yet complete, replies not yet read); over it, the connection is dropped "
                                     "(0: twice the largest exchange of a worker with that server, every partition "
                                     "in flight, + 0.25)", min=0.0)


def resend_problem(b: Any) -> str | None:
    """Why backend `b`'s resend_timeout_s cannot hold (a PS's servers' keys: PSServers), or None."""
    if b.resend_timeout_s and b.resend_timeout_s >= b.timeout_s:
        return (f"backend.resend_timeout_s = {b.resend_timeout_s:g}: must be shorter than backend.timeout_s = "
                f"{b.timeout_s:g} (a request is sent again before the run gives up on its reply)")
    if b.resend_timeout_s and getattr(b, "replicas", 0):
        return (f"backend.resend_timeout_s = {b.resend_timeout_s:g}: with backend.replicas a worker sends nothing "
                f"again (a dead server's partitions are served by their other holders); use 0")
    return None


@dataclass(frozen=True)
class ModelUnits:
    """The units a backend gathers or cuts the model into (zero stage 3, torch_fsdp, pipeline stages)."""

    zero_units: str = option("blocks", "attribute of the model holding the nn.ModuleList whose children are "
                                       "the units (ZeRO-3 and FSDP gather them one by one, ZeRO checkpoints them "
                                       "one by one, a pipeline cuts its stages between them); '' for the whole "
                                       "model as one unit")


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes counted from the tensors saved for backward (zero, tensor)."""

    measure_activations: bool = option(False, "count the activation bytes kept for backward each step (zero: "
                                              "saved_activation_bytes; tensor: block_activation_bytes, the blocks' "
                                              "alone); off the hot path unless asked for")


def units_attr(backend: CoreBackendConfig) -> str:
    """The attribute naming the model's units: backend.zero_units where the backend includes ModelUnits, else the
    built-in models' "blocks" (torch_pipeline, which reads no such option, cuts psarch's GPT there)."""
    return backend.zero_units if isinstance(backend, ModelUnits) else "blocks"


# ---------------------------------------------------------------- the classes

def backend_class(kind: str) -> type:
    """The [backend] class of backend `kind`: its spec's options, or the core's alone."""
    return registry.spec(kind).options or CoreBackendConfig


def backend_fields() -> dict[str, dataclasses.Field]:
    """Every [backend] option of every registered backend, by name (for `psarch keys`, errors and checks). Two
    backends may share an option only by including the same declaration (a group above, or another's class)."""
    out: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(CoreBackendConfig)}
    owner: dict[str, str] = {name: "the core" for name in out}
    for spec in registry.specs():
        cls = spec.options or CoreBackendConfig
        if not (dataclasses.is_dataclass(cls) and issubclass(cls, CoreBackendConfig)):
            raise TypeError(f"backend.kind = {spec.kind!r}: its options {cls!r} must be a dataclass that includes "
                            f"psarch.config.backend.CoreBackendConfig")
        for f in dataclasses.fields(cls):
            if f.name in out and out[f.name] is not f:
                raise ValueError(f"backend.{f.name} is declared twice: by {owner[f.name]} and by {spec.kind}'s "
                                 f"{cls.__qualname__} (two backends share an option by including one group)")
            out.setdefault(f.name, f)
            owner.setdefault(f.name, f"{spec.kind}'s {cls.__qualname__}")
    return out
