"""One interruption of a 2-node local run of the stepped loop (tests/loops/stepped.py), the same way each time, and
what it cost: tests/test_recovery.py asserts on it, benchmarks/spot_interruption.py compares it with and without a
notice and a proactive relaunch.

    killer = Interruption(home, step_log, at_step=3, double=double, lead_s=30)   # or no double: kill at_step
    killer.start(); ...run the flow...; figures = killer.measured(logs)

With a metadata double, the cloud's notice for the worker node comes once the run has done `at_step` steps, and the
node's raylet is SIGKILLed at the notice's deadline, as the cloud takes it; without one, the raylet is SIGKILLed
once `at_step` steps are done. The clusters of the run other than the first (a replacement provisioned on the
notice) are noted as they are at the kill.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

from gpuflow.cluster.backends.local import NODES_FILE, LocalBackend
from tests.loops.stepped import steps_done

NOTICE_RESUME = re.compile(r"resuming at epoch (\d+) step (\d+) from the checkpoint taken on a preemption notice")
RELAUNCHED = re.compile(r"-r\d+$")  # cluster_name_for's name of a relaunch
EPOCH_RESUME = re.compile(r"resuming at epoch (\d+) from the checkpoint of epoch (\d+)")


class Interruption(threading.Thread):
    def __init__(self, home: Path, step_log: Path, at_step: int, double=None, lead_s: float = 30.0):
        super().__init__(daemon=True)
        self.home, self.step_log, self.at_step, self.double, self.lead_s = home, step_log, at_step, double, lead_s
        self.noticed_at = self.killed_at = None
        self.killed_step = 0
        self.others_at_kill: dict[str, dict] = {}  # name -> {"status": ..., "launched_at": ...}

    def run(self):
        give_up = time.monotonic() + 900
        while time.monotonic() < give_up:
            clusters = [s.name for s in LocalBackend().status() if s.status == "UP" and not RELAUNCHED.search(s.name)]
            if clusters and len(steps_done(self.step_log)) >= self.at_step:
                nodes = Path(LocalBackend().record(clusters[0])["temp_dir"]) / NODES_FILE
                [worker] = [node for node in json.loads(nodes.read_text()) if not node["head"]]
                if self.double is not None:
                    self.noticed_at = time.time()
                    time.sleep(max(0.0, self.double.notify(worker["node_id"], in_s=self.lead_s) - time.time()))
                self.others_at_kill = {
                    s.name: {"status": s.status, **(LocalBackend().record(s.name) or {})}
                    for s in LocalBackend().status()
                    if RELAUNCHED.search(s.name)
                }
                os.kill(worker["raylet"], signal.SIGKILL)
                self.killed_at = time.time()
                self.killed_step = len(steps_done(self.step_log))
                return
            time.sleep(0.1)

    def resumed_from(self, logs: str) -> tuple[int | None, int | None, float | None]:
        """(epoch, step within it or None, when its checkpoint was written) of the checkpoint the run resumed from;
        (None, None, None) when it started over."""
        import torch

        if found := NOTICE_RESUME.search(logs):
            epoch, step = int(found[1]), int(found[2])
        elif found := EPOCH_RESUME.search(logs):
            epoch, step = int(found[2]), None
        else:
            return None, None, None
        for path in self.home.glob("checkpoints/*/checkpoint_*/checkpoint.pt"):
            state = torch.load(path, weights_only=False)
            if state["epoch"] == epoch and state.get("within_epoch", {}).get("step") == step:
                return epoch, step, path.stat().st_mtime
        raise AssertionError(f"the checkpoint of epoch {epoch} step {step} the run resumed from is not kept")

    def measured(self, logs: str) -> dict:
        """What the loss cost, seen from outside (benchmarks/spot_interruption.py defines each figure; the run's
        lost_compute_seconds is cluster/run/losses.py's)."""
        steps = steps_done(self.step_log)
        lost_pid = steps[0][1]
        epoch, step, written = self.resumed_from(logs)
        lost_steps = [at for at, pid in steps if pid == lost_pid and at <= self.killed_at]
        redone = [at for at in lost_steps if written is None or at > written]
        first_resumed = min(at for at, pid in steps if pid != lost_pid and at > self.killed_at)
        redone_s = self.killed_at - (written if written is not None else lost_steps[0])
        recovery_s = first_resumed - self.killed_at
        replacement_s = sum(
            max(0.0, self.killed_at - other.get("launched_at", self.killed_at))
            for other in self.others_at_kill.values()
        )
        return {
            "steps_redone": len(redone),
            "redone_s": redone_s,
            "recovery_s": recovery_s,
            "replacement_before_loss_s": replacement_s,
            "killed_step": self.killed_step,
            "resumed_epoch": epoch,
            "resumed_step": step,
            "checkpoint_written_at": written,
        }
