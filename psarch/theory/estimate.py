"""`psarch estimate`: the analytic model, no processes.

Memory per device for DDP and ZeRO 1-3 (the ZeRO paper's Tables 1 and 2), traffic per step for every
architecture, and step times from 1 to 1,024 workers by the step simulator (theory/estimate_steps.py). Sizes are decimal (a GB is 1e9
bytes, as the paper's), each table in the unit its largest figure reads in, to 3 significant figures.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from psarch import registry, theory
from psarch.config import Config, ConfigError
from psarch.records import Summary
from psarch.theory.estimate_steps import Network, accepted, config, crossover, scaling_table, simulated
from psarch.units import TIMES, fmt_size, fmt_time, in_unit, size_unit, unit_for

if TYPE_CHECKING:   # imported where used: it needs torch (the GPT's own parameter count), the tables do not
    from psarch.theory.estimate_tensor import GPTShape

STAGES = (("ddp", 0), ("zero-1", 1), ("zero-2", 2), ("zero-3", 3))


def _setup(stage: int, n: int, precision: str, optimizer: str) -> Config:
    """DDP (stage 0) or ZeRO-`stage` at world size n."""
    return theory.config_for("zero", n, precision, optimizer, stage=stage) if stage else \
        theory.config_for("ddp", n, precision, optimizer)


def memory_table(phi: float, worlds: list[int], precision: str = "bf16", optimizer: str = "adamw") -> list[dict]:
    """Model-state bytes per device for DDP and ZeRO stages 1-3 at each world size (ZeRO paper Table 1)."""
    return [{"world": n, **{name: theory.predict(_setup(stage, n, precision, optimizer), phi).memory_per_rank.total
                            for name, stage in STAGES}} for n in worlds]


def max_params(budget_bytes: float, world: int, stage: int, precision: str = "bf16", optimizer: str = "adamw") -> float:
    """The largest Φ whose model states fit in `budget_bytes` per device at data-parallel degree `world`."""
    return budget_bytes / theory.predict(_setup(stage, world, precision, optimizer), 1.0).memory_per_rank.total


def table2(budget_bytes: float = 32e9, gpus: tuple[int, ...] = (64, 128, 256, 512, 1024), dp: int = 64) -> list[dict]:
    """ZeRO paper Table 2: the largest model for a per-GPU budget, model parallelism MP = gpus / dp.

    As the paper does, the MP = 1 size is cut to 0.1 B parameters and scaled by MP (model parallelism
    splits each layer evenly over MP devices)."""
    rows = []
    for g in gpus:
        mp = g // dp
        row: dict[str, float] = {"mp": mp, "gpus": g}
        for name, stage in STAGES:
            row[name] = math.floor(max_params(budget_bytes, dp, stage) / 1e8) * 1e8 * mp
        rows.append(row)
    return rows


def measured_compute(summary: Summary) -> float:
    """A run's compute time per step: its median step time less the time it waited on communication."""
    return max(summary["step_time_s"] - summary.get("comm_s", 0.0), 0.0)


# ---------------------------------------------------------------- printing

WORLDS = [1, 4, 16, 64, 256, 1024]


def _params(x: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.4g}{suffix}"
    return f"{x:.0f}"


def backend_rows(phi: float, world: int, precision: str, optimizer: str, options: dict) -> list[str]:
    """The rows backends add from Φ alone for the command line's options (BackendSpec.estimate_rows)."""
    rows = [r for spec in registry.specs() for r in spec.estimate_rows(phi, world, precision, optimizer, options)]
    if not rows:
        return []
    unit, scale = size_unit([x for r in rows for x in (r["states"], r["sent"])])
    out = ["", f"== model parallelism at N = {world}: model states per device, gradient all-reduce per device, "
               f"idle fraction", f"{'architecture':>40} {'states ' + unit:>10} {'sends ' + unit:>10} {'bubble':>7}"]
    return out + [f"{r['label']:>40} {in_unit(r['states'], scale):>10} {in_unit(r['sent'], scale):>10} {r['bubble']:>7.3f}"
                  for r in rows]


def report(phi: float, world: int, precision: str = "bf16", optimizer: str = "adamw", servers: int = 1,
           network: Network | None = None, budget: float | None = None, measured: tuple[Summary, Config] | None = None,
           compute_from: str | None = None, options: dict | None = None,
           tensor: tuple[GPTShape, int] | None = None, extra: dict | None = None, gpt: GPTShape | None = None,
           model: GPTShape | None = None, asked: Config | None = None) -> str:
    """Everything `psarch estimate` prints; `measured` is a run's (summary, config), compared with the model
    at the end; `compute_from` names the run the cluster's compute time was measured in, if any; `options`
    the backend options asked for on the command line (a pipeline's stages and micro-batches: the rows
    BackendSpec.estimate_rows adds from Φ alone); `tensor` (a GPT's shape, the degree asked for): tensor
    parallelism's rows, which need the shape (psarch.theory.estimate_tensor); `extra`: backend options for the step
    times, each for the backends that read it (--partition-mb: the PS's partition_mb); `gpt`: the GPT whose
    pipeline (`options`) and tensor-parallel (`tensor`) steps are simulated beside the ring's; `model`: the GPT asked
    about, whose units (its root and blocks) ZeRO-3's simulated step gathers one by one, scaled to Φ (None: a measured
    run's own model, else a standard GPT of about Φ, standard_shape, named in the output); `asked`: the config of the
    model asked about (a config file's; default a measured run's): its model and samples per worker, and with
    embedding tables the hybrid's steps (the tables on PS servers). The ZeRO paper's Table 2 (the largest
    model a device `budget` holds, default 32 GB) is about models of billions of parameters: it is shown for a
    Φ asked about, and for a measured run only when a budget is given."""
    c = network or Network()
    out = _memory_lines(phi, world, precision, optimizer)
    if budget is not None or measured is None:
        out += _table2_lines(32e9 if budget is None else budget)
    out += _traffic_lines(phi, world, precision, optimizer, servers)
    out += backend_rows(phi, world, precision, optimizer, options or {})
    asked = asked or (measured[1] if measured else None)
    per_rank = max(1, asked.train.global_batch // asked.backend.world_size) if asked else 1
    workload, units = _units(phi, model, asked)
    out += _scaling_lines(phi, precision, servers, c, compute_from, extra, workload, units, per_rank, optimizer)
    out += _ranked_lines(phi, world, precision, optimizer, servers, c, extra, workload, per_rank)
    if tensor:
        from psarch.theory.estimate_tensor import tensor_report

        out += [""] + tensor_report(tensor[0], world, tensor[1], precision, optimizer)
    if gpt and (tensor or (options or {}).get("stages")):
        out += _model_parallel_steps(gpt, world, precision, optimizer, options or {}, tensor[1] if tensor else 0, c)
    if measured:
        out += ["", measured_vs_model(*measured, c)]
    return "\n".join(out) + "\n"


def _model_parallel_steps(gpt: GPTShape, world: int, precision: str, optimizer: str, options: dict, t: int,
                          c: Network) -> list[str]:
    """The simulated steps of the GPT's pipelines (--pipeline, every schedule) and tensor parallelism
    (--tensor-parallel) at --world, beside ring DDP's, every device computing c.compute_s."""
    from psarch.theory.plan import config, simulated_step

    phi = gpt.params()
    cells: list[tuple[str, dict]] = [(RING_LABEL, {"kind": "ddp"})]
    if options.get("stages"):
        p, m = options["stages"], options.get("microbatches", 8)
        cells += [(f"pipeline/{s} p={p} m={m}" + (" v=2" if s == "interleaved" else ""),
                   {"kind": "pipeline", "stages": p, "microbatches": m, "schedule": s, "virtual_stages": 2})
                  for s in ("gpipe", "1f1b", "interleaved")]
    if t:
        cells.append((f"tensor/t={t}", {"kind": "tensor", "tensor_parallel": t}))
    out = ["", f"== model parallelism's step simulated at N = {world}: GPT {gpt.layers} x {gpt.hidden} "
               f"(Φ = {_params(phi)}), {gpt.micro_batch} sequences per device, compute {fmt_time(c.compute_s)} per "
               f"device, link {fmt_size(c.bandwidth)}/s, latency {fmt_time(c.alpha)}",
           f"{'architecture':>36} {'step':>9} {'exposed':>9} {'idle':>9}"]
    for label, backend in cells:
        try:
            timed = simulated_step(config(gpt, world, precision, optimizer, backend), phi, c.compute_s,
                                   c.bandwidth, c.alpha)
        except ConfigError as e:
            out.append(f"{label:>36} none: {e}")
            continue
        assert timed is not None, "ddp, pipeline and tensor write programs"
        st = timed[0]
        out.append(f"{label:>36} {fmt_time(st.step_s):>9} {fmt_time(st.exposed_s):>9} {fmt_time(st.idle_s):>9}")
    return out


RING_LABEL = "ddp ring"


def _memory_lines(phi: float, world: int, precision: str, optimizer: str) -> list[str]:
    rows = memory_table(phi, sorted(set(WORLDS + [world])), precision, optimizer)
    unit, scale = size_unit([r[name] for r in rows for name, _ in STAGES])
    out = [f"== model states per device, {unit}: Φ = {_params(phi)}, {precision} + {optimizer} "
           f"(K = {theory.optimizer_bytes_per_param(optimizer, precision)})",
           f"{'N':>6} " + " ".join(f"{name:>10}" for name, _ in STAGES)]
    for row in rows:
        mark = "  <- --world" if row["world"] == world else ""
        out.append(f"{row['world']:>6} " + " ".join(f"{in_unit(row[name], scale):>10}" for name, _ in STAGES) + mark)
    return out


def _table2_lines(budget: float) -> list[str]:
    out = ["", f"== largest model per device budget {fmt_size(budget)}, DP = 64 (ZeRO paper Table 2)",
           f"{'MP':>4} {'GPUs':>6} " + " ".join(f"{name:>10}" for name, _ in STAGES)]
    for row in table2(budget):
        out.append(f"{row['mp']:>4} {row['gpus']:>6} " + " ".join(f"{_params(row[name]):>10}" for name, _ in STAGES))
    return out


def _traffic_lines(phi: float, world: int, precision: str, optimizer: str, servers: int) -> list[str]:
    rows = []
    for label, cfg in (("ddp (ring)", _setup(0, world, precision, optimizer)),
                       ("zero-1/2", _setup(1, world, precision, optimizer)),
                       ("zero-3", _setup(3, world, precision, optimizer)),
                       (f"ps, {servers} server(s)", theory.config_for("ps", world, precision, optimizer, servers=servers))):
        p = theory.predict(cfg, phi)   # the busiest rank's link, then each serving node's, by the role's own name
        links = [(p.busiest, p.link)] + [(role, node.link) for role, node in p.services.items()]
        rows += [(label if i == 0 else "", role, (link.sent, link.received)) for i, (role, link) in enumerate(links)]
    payload = phi * theory.BYTES[precision]
    unit, scale = size_unit([payload] + [x for _, _, xs in rows for x in xs])
    out = ["", f"== traffic per step at N = {world}, {unit} (S = {fmt_size(payload)} of {precision} gradients)",
           f"{'architecture':>16} {'node':>8} {'sends':>13} {'receives':>13}"]
    return out + [f"{label:>16} {role:>8} " + " ".join(f"{in_unit(x, scale):>13}" for x in xs)
                  for label, role, xs in rows]


def _units(phi: float, model: GPTShape | None, asked: Config | None) -> tuple[dict, str]:
    """The model whose units ZeRO-3's step gathers (a config's [workload] section) and a line that says which: the
    config's own (a measured run's, a config file's), the GPT given, or a standard one of about Φ (standard_shape)."""
    from psarch.theory.estimate_tensor import standard_shape

    if asked and model is None:
        return asked.to_dict()["workload"], "zero-3 gathers the asked config's own model's units (its root and blocks)"
    shape = model or standard_shape(phi)
    what = "the GPT given" if model else ("a GPT assumed for Φ (GPT-3's width nearest it, blocks to match; "
                                          "--layers, --hidden, --heads, --seq-len, --vocab give another)")
    return shape.workload(), (f"zero-3 gathers {shape.layers + 1} units, the root (embeddings, head) and {shape.layers} "
                              f"blocks of {what}: GPT {shape.layers} x {shape.hidden}, {shape.heads} heads, "
                              f"{shape.seq} tokens, vocabulary {shape.vocab} (Φ = {_params(shape.params())}), "
                              f"scaled to Φ = {_params(phi)}")


def _scaling_lines(phi: float, precision: str, servers: int, c: Network, compute_from: str | None,
                   extra: dict | None, workload: dict | None = None, units: str = "", per_rank: int = 1,
                   optimizer: str = "adamw") -> list[str]:
    worlds = [2**k for k in range(11)]
    rows = scaling_table(phi, precision, c, worlds, servers, extra, workload, per_rank, optimizer)
    cells, refused = accepted(precision, c, servers, extra, workload, per_rank, optimizer)
    keys = list(cells)
    unit, scale = unit_for([r[k] for r in rows for k in keys], TIMES)
    source = f" (measured in {compute_from})" if compute_from else ""
    sent = "from backward's hooks" if c.overlap else "after backward"
    out = ["", f"== step time ({unit}) simulated: compute {fmt_time(c.compute_s)}/step/worker{source} (weak scaling), "
               f"link {fmt_size(c.bandwidth)}/s each way, latency {fmt_time(c.alpha)}, gradients sent {sent}",
           *([units] if units else []),
           *(["the hybrid (+ps/n): the tables' rows on a PS server beside each worker, "
              f"{per_rank} samples per worker"] if any(k.endswith("+ps/n") for k in keys) else []),
           *[f"{k} left out: {why}" for k, why in refused.items()],
           f"{'N':>6} " + " ".join(f"{k:>9}" for k in keys) + "   (ps/n: one server per worker; col: beside it)"]
    for row in rows:
        out.append(f"{row['world']:>6} " + " ".join(f"{row[k] / scale:>9.3g}" for k in keys))
    for k in keys[1:]:
        n = crossover(rows, k)
        out.append(f"{k} overtakes ring all-reduce at N = {n}" if n else
                   f"{k} does not overtake ring all-reduce up to N = {worlds[-1]}")
    return out


def ranked(phi: float, world: int, precision: str, optimizer: str, servers: int, c: Network,
           extra: dict | None = None, workload: dict | None = None, per_rank: int = 1) -> list[dict]:
    """Every architecture of the step-time table at N = world, ranked by its simulated step: its step, model states
    per device (with a colocated server's share: the PS's, the hybrid's tables) and the bytes the busiest node
    sends a step (psarch.theory.plan.sent_per_node)."""
    from psarch.theory.plan import sent_per_node, simulated_step

    rows = []
    for label, (kind, opts) in accepted(precision, c, servers, extra, workload, per_rank, optimizer)[0].items():
        cfg = config(kind, opts, world, precision, c, extra, workload, per_rank, optimizer)
        timed = simulated_step(cfg, phi, c.compute_s, c.bandwidth, c.alpha)
        if timed is None:
            continue
        rows.append({"label": label, "step": timed[0].step_s, "memory": theory.predict(cfg, phi).device_memory(),
                     "link": max(sent_per_node(timed[1]))})
    return sorted(rows, key=lambda r: r["step"])


def _ranked_lines(phi: float, world: int, precision: str, optimizer: str, servers: int, c: Network,
                  extra: dict | None, workload: dict | None, per_rank: int) -> list[str]:
    rows = ranked(phi, world, precision, optimizer, servers, c, extra, workload, per_rank)
    out = ["", f"== at N = {world}, ranked by simulated step: model states per device (a colocated server's "
               f"included) and the bytes the busiest node sends a step",
           f"{'#':>3} {'architecture':>12} {'step':>10} {'memory':>10} {'sent/link':>10}"]
    return out + [f"{i:>3} {r['label']:>12} {fmt_time(r['step']):>10} {fmt_size(r['memory']):>10} "
                  f"{fmt_size(r['link']):>10}" for i, r in enumerate(rows, 1)]


def measured_vs_model(summary: Summary, cfg: Config, c: Network) -> str:
    """A run's measured step time and traffic against the simulator's for the run's own config (in full), with
    compute taken from the run, on the network asked about."""
    compute = measured_compute(summary)
    p = theory.predict(cfg, summary["params"])
    try:
        net = Network(c.bandwidth, c.alpha, compute, c.overlap)
        model = f"{simulated(cfg, summary['params'], net, reduced=False).step_s * 1e3:.2f} ms"
    except ConfigError as e:   # a backend whose step has no program yet: say so where the figure would be
        model = f"none ({e})"
    sent = [r["sent_per_step"] for r in summary["traffic"]["per_rank"]]
    label = summary.get("label") or " ".join(filter(None, (summary["backend"], summary.get("variant"))))
    return (f"== measured run {summary['name']} ({label}, N = {summary['world_size']}): "
            f"compute {compute * 1e3:.2f} ms\n"
            f"step time  measured {summary['step_time_s'] * 1e3:.2f} ms   model {model}\n"
            f"sent/step  measured {fmt_size(sum(sent) / len(sent))}   model {fmt_size(p.link.sent)}")
