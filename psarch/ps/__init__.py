"""The parameter-server backend (`backend.kind = "ps"`).

S server processes each own a contiguous, balanced range of the flat fp32 parameter vector and the
optimizer state for it; N workers compute gradients, push them to every server and pull parameters
back, over ZeroMQ (ROUTER on servers, DEALER on workers) with a msgpack header and raw tensor frames.

    wire.py        message format and its validation
    server.py      one server: requests, rounds, when a pull is answered (control.py: timeouts, stats)
    updates.py     what a server does to its range in each mode (sync mean, async step, DC/lr, geo delta)
    client.py      the worker's sockets: requests to all servers in parallel, every frame counted
    trainer.py     PSTrainer, the worker (the Trainer protocol)
    worker.py      the backend's trainer class: PSTrainer, or RowPSTrainer with backend.embeddings = "rows"
    rows.py        embedding tables sharded by row over the servers (keys, shards); row_server.py serves
                   them, row_optim.py updates them row-wise, sparse_worker.py / row_cache.py are the worker's side
    snapshot.py    checkpoints: servers write their ranges, workers what they hold; the `save` barrier
    services.py    starting, watching and stopping the servers of a local run
    standalone.py  `psarch server`: one server as its own process, for runs across machines
    layout.py      server ranges, the flat layout, model.pt from the flat vector
    bench.py       `python -m psarch.ps.bench`: wire throughput vs raw pyzmq, step time vs DDP
"""
