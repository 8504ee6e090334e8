"""What goes on beside the chaos soak's runs: reconciler passes on a schedule, several at once (as several serves run
them, each its own process), a user's `gpuflow status` and `gpuflow quota list` now and then, and a sampler that
reads the quota's invariants every second:

- active slots: no quota holds more slots than its limit;
- clusters alive under a quota: no more of the runs' clusters are up than the quota's size (one slot each here).

A run's own cluster is named for its flow run (cluster/backends/base.py); a warm one started before its run had a
slot holds none and is not counted.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from tests.support.servers import BIN

RUN_CLUSTER = re.compile(r"^gpuflow-[0-9a-f]{32}(-r\d+)?$")  # a run's (and its relaunches'), not a warm spare
PASSES = """
import sys, time
from gpuflow.flows.reaper import reap_clusters
while True:
    try:
        reap_clusters(backends=["local"])
        print("[pass] done", flush=True)
    except Exception as exc:  # a server restarting: the next pass
        print(f"[pass] failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    time.sleep(float(sys.argv[1]))
"""


@dataclass
class Beside:
    """Starts with `with`: `passes` pass processes, each a pass every `every_s`; the user's commands every
    `users_every_s` (0: none); the sampler. Stops them all at the end of the block."""

    stack: object
    quota: int
    passes: int = 0
    every_s: float = 20.0
    users_every_s: float = 0.0
    samples: int = 0
    violations: list[str] = field(default_factory=list)
    user_commands: int = 0
    _runners: list[subprocess.Popen] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Beside:
        for index in range(self.passes):
            log = open(self.stack.root / f"passes-{index}.log", "ab")
            self._runners.append(
                subprocess.Popen(
                    [sys.executable, "-c", PASSES, str(self.every_s)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.stack.root,
                    env=self.stack.client_env(),
                    start_new_session=True,
                )
            )
            log.close()
        self._threads = [threading.Thread(target=self._sample, daemon=True)]
        if self.users_every_s:
            self._threads.append(threading.Thread(target=self._use, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for runner in self._runners:
            with contextlib.suppress(OSError):
                os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(timeout=30)
        for thread in self._threads:
            thread.join(timeout=120)

    def pass_lines(self) -> tuple[int, int]:
        """(passes done, passes failed) by all the pass processes."""
        text = "".join(
            path.read_text(errors="replace") for path in sorted(self.stack.root.glob("passes-*.log")) if path.exists()
        )
        return text.count("[pass] done"), text.count("[pass] failed")

    def _sample(self) -> None:
        from gpuflow.cluster.backends.local import LocalBackend
        from gpuflow.flows.quota.pools import LIMIT_PREFIX

        backend = LocalBackend(root=self.stack.home / "clusters")
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):  # the Prefect server restarting: the next second
                with self.stack.client() as client:
                    limits = client.read_global_concurrency_limits(limit=200)
                up = [c.name for c in backend.status() if c.status == "UP" and RUN_CLUSTER.match(c.name)]
                self.samples += 1
                for limit in limits:
                    if limit.name.startswith(LIMIT_PREFIX) and limit.active_slots > limit.limit:
                        self.violate(f"active slots ≤ limit: {limit.name} {limit.active_slots} of {limit.limit}")
                if len(up) > self.quota:
                    self.violate(f"clusters alive ≤ quota: {len(up)} up under a quota of {self.quota}: {up}")

    def _use(self) -> None:
        """A user's look now and then: `gpuflow status` and `gpuflow quota list` (which recounts the quota)."""
        while not self._stop.wait(self.users_every_s):
            for command in (["status"], ["quota", "list"]):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(
                        [str(BIN / "gpuflow"), *command],
                        capture_output=True,
                        cwd=self.stack.root,
                        env=self.stack.client_env(),
                        timeout=120,
                    )
                    self.user_commands += 1

    def violate(self, violation: str) -> None:
        stamped = f"{violation} (at {time.strftime('%H:%M:%S')})"
        if not any(v.split(" (at ")[0] == violation for v in self.violations):  # once per kind of breach
            self.violations.append(stamped)
