"""The launcher's side channel into a server (a pipe carrying JSON and raw bytes, never pickle), and
the measurements a server reports at the end of a run."""
from __future__ import annotations

import json
import time
from typing import Any

import torch

from psarch.meters import peak_memory


class ServerControl:
    """Mixed into ParameterServer: timeouts that fail the server; the launcher's commands `lost`,
    `stats`, `stop`; the events `failed`, `stats`."""

    def _check_deadlines(self) -> None:
        if self.failure is not None and self.exit_when_done and time.monotonic() - self.failed_at > 10:
            self.stopping = True  # standalone: the workers have had time to hear the error
        if self.failure is not None or self.stopping:
            return
        now = time.monotonic()
        t = self.timeout_s
        # first: a silent worker is a lost one, so the waits below blame no one for a worker that died
        if self.last_seen is not None:
            waiting = {p.worker for p in self.pending}   # a worker waiting on a pull is waiting on us
            for w in sorted(self._live() - self.done - waiting):
                if now - self.last_seen[w] > self.silence_s:
                    self._lose(w, f"no message from it for more than {self.silence_s:g} s (backend.timeout_s"
                                  + (" x backend.k_steps)" if self.mode == "geo" else ")"))
            if self.stopping:
                return
        if self._save_overdue(now):
            return
        if self.barrier and self.round_pushed and now - self.round_since > t:
            missing = sorted(self._live() - self.round_pushed)
            what = "gradients" if self.mode == "sync" else "deltas"
            return self._fail(f"{self.mode} step {self.state.version}: no {what} from worker(s) {missing} within "
                              f"backend.timeout_s = {t:g} s (workers {sorted(self.round_pushed)} pushed)")
        for p in self.pending:
            if now - p.since > t and self.state is None:
                return self._fail(f"worker {p.worker} waited more than backend.timeout_s = {t:g} s "
                                  f"for the initial parameters: no worker sent init")
            if now - p.since > t:
                slow = sorted(w for w in self._live() if self.clock[w] == self._slowest())
                return self._fail(f"worker {p.worker} waited more than backend.timeout_s = {t:g} s "
                                  f"for step {p.step}; waiting on worker(s) {slow} "
                                  f"(at step {self._slowest()})")

    def _fail(self, text: str) -> None:
        self.failure = text
        self.failed_at = time.monotonic()
        for p in self.pending:
            self._error(p.ident, p.op, text)
        self.pending = []
        self._notify({"event": "failed", "server": self.index, "message": f"server {self.index}: {text}"})

    def _notify(self, event: dict[str, Any]) -> None:
        if self.control is not None:
            self.control.send_bytes(json.dumps(event).encode())

    def _control(self, cmd: dict[str, Any]) -> None:
        if cmd.get("cmd") == "lost":
            self._lose(int(cmd["worker"]), "its process died")
        elif cmd.get("cmd") == "stats":
            self._notify({"event": "stats", **self.stats()})
            if self.state is not None:
                self.control.send_bytes(memoryview(self.state.params.detach().numpy()).cast("B"))
            else:
                self.control.send_bytes(b"")
        elif cmd.get("cmd") == "stop":
            self.stopping = True

    def stats(self) -> dict[str, Any]:
        """What this server measured: traffic, memory, staleness, rejected requests, lost workers."""
        st = self.state
        traffic = self.meter.report().to_dict()
        peak, kind = peak_memory(torch.device("cpu"))
        out: dict[str, Any] = {
            "server": self.index, "address": self.address, "range": [self.lo, self.hi],
            "version": st.version if st else 0, "sent": traffic["sent"], "received": traffic["received"],
            "traffic": traffic, "memory": dict(st.memory() if st else {"total": 0}, peak=peak, peak_kind=kind,
                                                   early_pushes_peak=self.round_sum.peak),
            "rejected": self.rejected, "refused_non_finite": self.refused_non_finite, "lost": sorted(self.lost), "failure": self.failure,
            "skipped_updates": st.skipped if st else 0,
            "staleness_histogram": {str(k): v for k, v in sorted(st.staleness.items())} if st else {},
        }
        if self.mode == "ssp":
            out["ssp"] = {"staleness_bound": self.cfg.backend.staleness_bound, "max_ahead": self.max_ahead,
                          "trace": self.trace}
        return out
