"""The clean-up watcher of an emulated cluster: `python psarch/cluster/watch.py PREFIX`.

The launcher holds this process's stdin open; when the launcher ends, however it ends (SIGKILL
included), stdin reaches EOF and every namespace named PREFIX* is removed with what runs in it."""
from __future__ import annotations

import signal
import sys

if __package__:
    from psarch.cluster import netns
else:  # started as a script: importing the psarch package would cost a torch import per run
    import netns  # type: ignore[no-redef]   # the same module, imported by its file's name


def main(prefix: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C meant for the launcher is not for the clean-up
    while sys.stdin.buffer.read(4096):
        pass
    for ns in netns.names(prefix):
        netns.remove(ns)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].startswith("psarch-"):
        sys.exit("usage: python watch.py psarch-<pid>-")
    main(sys.argv[1])
