"""What losing nodes cost a run in compute: its `lost_compute_seconds` and `recovery_seconds`, as the flow sees them.

`lost_compute_seconds` is the worker-seconds paid for that did not move training on, summed over each loss (a lost
cluster, relaunched; or an elastic run's nodes, trained on without):

    workers × (redone + replacement idle) + workers resumed × recovery

- redone: the loss − the last checkpoint persisted before it, the one the resume starts from (Ray Train resumes
  from its latest; on a spot notice that is the one taken mid-epoch at the last step); from the job's start when
  there is none. Training done twice.
- recovery: the loss → training resumes (the resumed loop's `resuming at` line; else its first report): the
  provision, the job's start, the restore, on the `workers resumed` (all of them on a relaunch, those on the nodes
  left on an elastic run).
- replacement idle: a replacement cluster asked for on a spot notice, from its request to the loss: it bills
  beside the one still training.

The times are the flow's: when it sees the job's lines (a checkpoint's `checkpoint persisted` line, printed once it
is in storage) and the loss (its loss check, else the job's end). `benchmarks/spot_interruption.py` reports this
figure, beside its parts measured from outside (the SIGKILL, each step's time). `recovery_seconds` is the longest
loss → first resumed epoch; `redone_seconds` the sum of the losses' `redone`.
"""

from __future__ import annotations

import time


class LostCompute:
    def __init__(self, workers: int):
        self.workers = workers
        self.seconds = 0.0
        self.redone_seconds = 0.0  # of which training done twice (wall seconds, each loss's `redone`)
        self.losses = 0
        self.recovery_seconds: list[float] = []  # each loss → the first epoch reported after it
        self.checkpoint_at: float | None = None  # the last checkpoint persisted: where a resume starts
        self._lost_at: float | None = None  # the last loss, until an epoch is reported after it
        self._recovering_on: int | None = None  # the workers a recovery runs on, until training resumes

    def checkpointed(self, at: float | None = None) -> None:
        at = at or time.time()
        self.resumed(at)
        self.checkpoint_at = at

    def lost(
        self,
        at: float,
        started_at: float | None,
        workers_after: int | None = None,
        replacements_requested: tuple[float, ...] = (),
    ) -> None:
        """A loss at `at`: training since the last checkpoint (or `started_at`) is done again, and a replacement
        asked for before it idled; `workers_after` train on once it is over (default: all)."""
        self.resumed(at)  # a second loss within a recovery: the first's ends here
        redone = at - (self.checkpoint_at or started_at or at)
        idle = sum(max(0.0, at - requested) for requested in replacements_requested)
        self.seconds += self.workers * (redone + idle)
        self.redone_seconds += redone
        self.losses += 1
        self._lost_at, self._recovering_on = at, self.workers if workers_after is None else workers_after

    def resumed(self, at: float | None = None) -> None:
        """The resumed loop trains again: the recovery's workers stop being lost compute."""
        if self._recovering_on is not None:
            self.seconds += self._recovering_on * ((at or time.time()) - self._lost_at)
            self._recovering_on = None

    def epoch(self, at: float | None = None) -> None:
        at = at or time.time()
        self.resumed(at)
        if self._lost_at is not None:
            self.recovery_seconds.append(at - self._lost_at)
            self._lost_at = None

    def productive_s(self, started_at: float | None, now: float) -> float:
        """The training that moved the run on since `started_at` (the first job's start): its time less the work
        redone and the recoveries, the one in progress too."""
        if started_at is None:
            return 0.0
        recovering = now - self._lost_at if self._lost_at is not None else 0.0
        return max(0.0, now - started_at - self.redone_seconds - sum(self.recovery_seconds) - recovering)

    def metrics(self) -> dict[str, float]:
        if not self.losses:
            return {}
        found = {"lost_compute_seconds": self.seconds, "redone_seconds": self.redone_seconds}
        if self.recovery_seconds:
            found["recovery_seconds"] = max(self.recovery_seconds)
        return found
