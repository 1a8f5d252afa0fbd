"""The parameter-server backend (`backend.kind = "ps"`).

S server processes each own a contiguous, balanced range of the flat fp32 parameter vector (or, with
backend.partition_assignment = "round_robin", every S-th partition of it) and the optimizer state for it;
N workers compute gradients, push them to every server and pull parameters back, over ZeroMQ (ROUTER on
servers, DEALER on workers) with a msgpack header and raw tensor frames.
Each range moves and is updated in partitions (backend.partition_mb), pipelined: a server answers a partition's
pull as soon as its round allows, while the next partitions still arrive; workers push each partition from
backward's hooks (backend.overlap_comm). On an emulated cluster servers have nodes of their own or sit beside
the workers (backend.server_placement).

    spec.py            the backend declared (psarch/backend.py): options, derived facts (barrier, push_every), rules
    theory.py          what theory predicts for it (traffic, memory, rounds; with embedding rows)
    wire.py            message format and its validation; what each request is answered with
    auth.py            who may connect: ZAP with PLAIN or CURVE, credentials, socket bounds
    errors.py          PSError, ServiceError, NonFinitePush
    replication.py     chain replication (backend.replicas): who holds what, when a dead server stops the run,
                       model.pt from the live holders, replication's bytes beside its formula
    layout.py          server ranges and their partitions, the initial flat vector, model.pt from the flat vector
    rows.py            embedding tables sharded by row over the servers: keys, the dense part, model.pt from shards
    row_optim.py       row-wise optimizers (SGD, Adagrad, lazy AdamW): a server's shard, a GEO worker's cache
    snapshot.py        checkpoints: the protocol (the `save` barrier) and what servers and workers share
    row_snapshot.py    checkpoints of the embedding rows: a server's shard, a GEO worker's cache
    services.py        the launcher's side: starting, watching and stopping the servers of a local run
    servers_summary.py the servers' stats as summary.json's entries (traffic, memory, nodes, staleness, dropped workers)
    servers_outputs.py model.pt from the servers' final parameters, the SSP trace
    standalone.py      `psarch server`: one server as its own process, for runs across machines
    server/            one server, built by composition
        parameter_server.py  ParameterServer: sockets, the serve loop, the handler table, lost workers
        stats.py             the launcher's commands; what a server sends back: its stats, its final parameters
        start.py             a run's server holding its part of the initial model (dense range; rows' shard)
        state.py             ServerState: what the parts share (and the config's facts, as properties); Partition
        replies.py           replies and errors on the socket, events on the launcher's pipe, failing
        connections.py       every connection: who it is, the caps, the watchdog that drops one past its budget
        tcp_bytes.py         what one connection holds in flight, as ZeroMQ holds it; the default budget
        pushes.py            init, push, pushpull, fetch; the end of a barrier round
        pulls.py             the pulls waiting until the mode lets a worker have the parameters
        rounds.py            a barrier round's sum in worker order (bit-identical rounds)
        commits.py           `commit`: a replica's round sums the workers its first live holder's summed
        updates.py           what a server does to its range in each mode (sync mean, async step, DC/lr, geo delta)
        deadlines.py         silent workers lost, overdue rounds and pulls failing the server
        readmit.py           a sync worker dropped from rounds that went on without it, taken back (`rejoin`)
        snapshots.py         the `save` op, a server's checkpoint part, restoring a server
        rows.py              ServerRows: rowpull, rowpush, rowfetch and the shard's part in rounds and checkpoints
        row_shard.py         RowShard: a server's rows of every table, their optimizer, a round's rows
    worker/            one worker, built by composition
        trainer.py           PSWorker, the backend's Trainer: steps, the model, figures
        snapshots.py         a worker's checkpoint part, rank 0's merge, continuing from a checkpoint
        link.py              ServerLink: the flat parameters' pushpull (a request per partition), pull, fetch, save, done
        schedule.py          PushSchedule: each partition pushed from backward's hooks once its gradients are final
        client.py            the worker's sockets: requests to all servers in parallel, replies matched, frames counted
        geo.py               GeoLocal: GEO's local optimizer and last synced model
        tables.py            PSTables: the worker's embedding treatment (psarch/embeddings.py), "dense" and the PS's part
        rows.py              WorkerRows, the "rows" treatment: fetch the batch's rows, push their gradients
        row_cache.py         RowCache: a GEO worker's rows between two syncs
"""
