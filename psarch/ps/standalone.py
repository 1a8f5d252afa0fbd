"""`psarch server CONFIG --index I --port P`: one parameter server as its own process, for runs across
machines.

On each server machine (the same config everywhere; `--port 0` picks a free port and prints it):

    psarch server exp.toml --index 0 --port 5555 --host 0.0.0.0
    psarch server exp.toml --index 1 --port 5555 --host 0.0.0.0

then start the workers with the servers listed in the config, e.g. under torchrun on each worker machine

    [backend]
    kind = "ps"
    servers = 2
    server_addresses = ["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"]

(or `psarch run exp.toml` to start every worker on one machine). Each server builds the initial
parameters from the config (the workload must be importable there too, as on the workers).
A server prints `psarch server I: listening on ADDRESS`, serves until every worker has said it is done
or is lost (or 10 s after a failure such as a sync timeout, which it reports), then prints its
measurements as one JSON line (traffic, memory, staleness) and exits: 0 after a clean run, 1 after a
failure. No launcher tells it that a worker died: in async, geo and ssp a worker it has not heard from
for backend.timeout_s (while no pull of it waits), counted from the first message of any worker, is
lost (printed on stderr) and the others go on; in sync the round's timeout fails the run instead.
Servers bind to 127.0.0.1 unless `--host` (or backend.host) says otherwise.

Every connection authenticates (backend.auth, see psarch/ps/auth.py): make the credentials once with
`psarch keygen KEYS --workers N --servers S`, copy KEYS to every machine and set backend.keys = "KEYS".
A server without keys refuses to start (on loopback, backend.auth = "none" runs without any).
"""
from __future__ import annotations

import json
import sys

from psarch.config import ConfigError, load_config


def serve(config: str, index: int, port: int, host: str | None = None, overrides: list[str] | None = None) -> int:
    """Run server `index` of the config's ps backend until the run is over; returns the exit code."""
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        print(f"psarch server: config error: {e}", file=sys.stderr)
        return 2
    b = cfg.backend
    problem = (f"backend.kind = {b.kind!r}: a server needs \"ps\"" if b.kind != "ps" else
               f"--index {index}: must be in 0..{b.servers - 1} (backend.servers = {b.servers})"
               if not 0 <= index < b.servers else
               f"--port {port}: must be in 0..65535 (0: any free port)" if not 0 <= port < 65536 else
               "backend.embeddings = \"rows\": a standalone server holds no rows yet; use `psarch run`"
               if b.embeddings == "rows" else None)
    if problem:
        print(f"psarch server: {problem}", file=sys.stderr)
        return 2
    from psarch.ps.auth import AuthError
    from psarch.ps.server.start import build_server
    from psarch.ps.server.stats import server_stats

    try:
        server = build_server(index, cfg, host or b.host, port, exit_when_done=True)
    except AuthError as e:
        print(f"psarch server: {e}", file=sys.stderr)
        return 2
    print(f"psarch server {index}: listening on {server.address}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        server.close()
        print(f"psarch server {index}: interrupted", file=sys.stderr)
    stats = server_stats(server)
    if "ssp" in stats:
        stats["ssp"]["trace"] = stats["ssp"]["trace"][:1000]
    print(json.dumps(stats), flush=True)
    if server.state.failure:
        print(f"psarch server {index}: {server.state.failure}", file=sys.stderr)
        return 1
    return 0
