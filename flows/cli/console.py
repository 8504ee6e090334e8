"""What `gpuflow run` shows: provisioning, each epoch, teardown and the summary (`print_summary`). Ray's and MLflow's
own lines from the job stay in the Prefect run's logs and in a log file; `gpuflow run -v` shows them here too.

On a terminal, one live line says where the run is (phase, epoch i/N, ETA, metrics, dollars so far), rewritten in
place; other lines print above it. In a log or a pipe, each epoch is one short line instead."""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

from gpuflow.cluster.run.monitor import JOB_DETAIL, PROGRESS
from gpuflow.flows.run_logs import LOGGER

# The phase of a record from a task run, by the task's name; the flow's own records say theirs (PROGRESS).
TASK_PHASES = {
    "validate": "validating",
    "stage-data": "provisioning",
    "open-mlflow-run": "provisioning",
    "provision": "provisioning",
    "train": "training",
    "teardown": "tearing down",
    "register-model": "registering",
}
SHOWN_METRICS = 3  # of an epoch's metrics, besides perf/*: the line stays short
CLEAR_LINE = "\r\x1b[K"
REDRAW_S = 1.0  # the live line's clock: ETA and dollars move between epochs too
RAY_PREFIX = re.compile(r"^(?:\([^()]*pid=\d+[^()]*\) )+")  # "(RayTrainWorker pid=8380) ": which Ray process said it


class HideJobDetail(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, JOB_DETAIL, False)


class HideHookNotes(logging.Filter):
    """Prefect's notes that a state hook runs and has run (gpuflow's messages are sent from one on every end); a
    hook that fails still says so, at ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (
            message.startswith("Running hook ")
            or (message.startswith("Hook ") and message.endswith(" finished running successfully"))
        )


def clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def key_metrics(metrics: dict, first: str | None = None) -> dict:
    """The few metrics worth a glance: the spec's own metric first, validation ones next, no perf/* figures."""
    keys = [key for key in metrics if not key.startswith("perf/")]
    keys.sort(key=lambda key: (key != first, not key.startswith("val")))
    return {key: metrics[key] for key in keys[:SHOWN_METRICS]}


def as_its_run_says(record: logging.LogRecord) -> logging.LogRecord:
    """A line of gpuflow's module loggers as the run it was logged in says it, `Task run 'teardown-ddf' - ...`
    (and its task's name, for the phase), beside Prefect's own lines; the log file keeps the module's name."""
    if not record.name.startswith(f"{LOGGER}."):
        return record
    from prefect.context import FlowRunContext, TaskRunContext

    task, flow = TaskRunContext.get(), FlowRunContext.get()
    if task is None and flow is None:
        return record
    shown = logging.makeLogRecord(record.__dict__)
    if task is not None:
        shown.name, shown.task_run_name, shown.task_name = "prefect.task_runs", task.task_run.name, task.task.name
    else:
        shown.name, shown.flow_run_name = "prefect.flow_runs", flow.flow_run.name
    return shown


class Progress:
    """The run's progress, read from the flow's records: phase, the latest epoch and how fast epochs go."""

    def __init__(self, metric: str | None = None):
        self.metric = metric
        self.phase = "starting"
        self.started = time.time()
        self.epoch: dict | None = None  # the latest epoch's fields, with `at`, when it arrived
        self._first: tuple[float, int] | None = None  # (when, epoch) of the first epoch seen on this cluster

    def update(self, record: logging.LogRecord) -> dict | None:
        """Takes what `record` says of the run; returns its epoch fields, if it reports an epoch."""
        fields = getattr(record, PROGRESS, None) or {}
        phase = fields.get("phase") or TASK_PHASES.get(getattr(record, "task_name", None))
        if phase:
            self.phase = phase
        if "epoch" not in fields:
            return None
        if self._first is None or fields["epoch"] <= self._first[1]:  # a resumed run starts counting again
            self._first = (record.created, fields["epoch"])
        self.epoch = {**fields, "at": record.created}
        return self.epoch

    def seconds_per_epoch(self) -> float:
        """From the first epoch seen on: that one paid for the start-up. Before a second, the loop's own timing
        of the epoch where it reports one, else the time since the job started."""
        at, first = self._first
        if self.epoch["epoch"] > first:
            return (self.epoch["at"] - at) / (self.epoch["epoch"] - first)
        return self.epoch["metrics"].get("perf/epoch_s") or self.epoch["train_seconds"] / self.epoch["epoch"]

    def eta_s(self, now: float) -> float:
        left = (self.epoch["epochs"] - self.epoch["epoch"]) * self.seconds_per_epoch()
        return max(0.0, left - (now - self.epoch["at"]))

    def cost_usd(self, now: float) -> float:
        return self.epoch["cost_usd"] + self.epoch["hourly_usd"] * (now - self.epoch["at"]) / 3600

    def metrics_text(self) -> str:
        return "  ".join(f"{key} {value:.4g}" for key, value in key_metrics(self.epoch["metrics"], self.metric).items())

    def epoch_line(self) -> str:
        """An epoch for a log: `epoch 3/10  val_accuracy 0.962  train_loss 0.118  2.4 s/epoch  ETA 0:17  $0.00`."""
        epoch = self.epoch
        return "  ".join(
            part
            for part in (
                f"epoch {epoch['epoch']}/{epoch['epochs']}",
                self.metrics_text(),
                f"{self.seconds_per_epoch():.1f} s/epoch",
                f"ETA {clock(self.eta_s(epoch['at']))}",
                f"${epoch['cost_usd']:.2f}",
            )
            if part
        )

    def live_line(self, now: float) -> str:
        """Where the run is now: `training  epoch 3/10  ETA 0:17  val_accuracy 0.962  $0.00  [0:41]`."""
        parts = [self.phase]
        if self.epoch:
            if self.phase == "training":
                parts += [f"epoch {self.epoch['epoch']}/{self.epoch['epochs']}", f"ETA {clock(self.eta_s(now))}"]
            parts += [self.metrics_text(), f"${self.cost_usd(now):.2f}"]
        parts.append(f"[{clock(now - self.started)}]")
        return "  ".join(part for part in parts if part)


def without_ray_prefix(record: logging.LogRecord) -> logging.LogRecord:
    """The record as the console shows it: a job's line without the Ray process it came from (the log keeps it)."""
    if not isinstance(record.msg, str) or not RAY_PREFIX.match(record.msg):
        return record
    shown = logging.makeLogRecord(record.__dict__)
    shown.msg = RAY_PREFIX.sub("", record.msg)
    return shown


class Console(logging.Handler):
    """Prefect's console handler, with the run's progress: a live line on a terminal, a short line per epoch else."""

    def __init__(self, inner: logging.Handler, metric: str | None = None):
        super().__init__(inner.level)
        self.inner = inner
        self.stream = inner.stream
        self.live = self.stream.isatty()
        self.progress = Progress(metric)
        self._drawn = False
        self._ended = threading.Event()
        if self.live:
            threading.Thread(target=self._tick, daemon=True, name="gpuflow-console").start()

    def emit(self, record: logging.LogRecord) -> None:
        record = as_its_run_says(record)
        epoch = self.progress.update(record)
        if epoch and not self.live:
            self._write(self.progress.epoch_line() + "\n")
        elif not epoch and self.inner.filter(record):
            self._clear()
            self.inner.handle(without_ray_prefix(record))
        self._draw()

    def end(self) -> None:
        """The run is over: the live line goes, for the summary printed in its place."""
        with self.lock:
            self._clear()
            self._ended.set()

    def _tick(self) -> None:
        while not self._ended.wait(REDRAW_S):
            with self.lock:
                self._draw()

    def _draw(self) -> None:
        if not self.live or self._ended.is_set():
            return
        width = shutil.get_terminal_size().columns - 1  # a line that wraps cannot be rewritten in place
        self._write(CLEAR_LINE + self.progress.live_line(time.time())[:width])
        self._drawn = True

    def _clear(self) -> None:
        if self._drawn:
            self._write(CLEAR_LINE)
            self._drawn = False

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def end_live_line() -> None:
    """Clears the live line before the run's summary (or its error) is printed."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, Console):
            handler.end()


def quiet_console(log_folder: Path, metric: str | None = None) -> Path:
    """Hides the job's detail lines from Prefect's console handler and shows the run's progress in their place
    (`metric` first among an epoch's metrics); writes every line to a log file, returned."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from gpuflow.flows.prefect_internals import ensure_logging_setup

    ensure_logging_setup()  # Prefect's console handler exists from here on: the filter goes on it, not on nothing
    root = logging.getLogger()
    consoles = [handler for handler in root.handlers if isinstance(handler, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(HideJobDetail())
        handler.addFilter(HideHookNotes())
        root.removeHandler(handler)
        root.addHandler(Console(handler, metric))
    # MLflow's own notes (INFO lines, "View run ... at" links): the summary at the end gives the run and its link.
    # Importing MLflow sets its loggers' levels: quieted after that, not before.
    import mlflow  # noqa: F401

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    log_folder.mkdir(parents=True, exist_ok=True)
    path = log_folder / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    to_file = logging.FileHandler(path)
    to_file.setLevel(logging.INFO)
    if consoles:
        to_file.setFormatter(consoles[0].formatter)
    root.addHandler(to_file)
    return path


def print_summary(spec, summary: dict, seconds: float, log_file: Path | None) -> None:
    """The summary of a run that completed: its MLflow run and how to open it, the metrics, a sweep's best trial,
    the phases, the checkpoint, the log file, what recoveries cost."""
    from gpuflow.cluster.run.record import open_command, run_url
    from gpuflow.tasks.compute import metrics_line

    phases = summary["phases"]
    if summary.get("reused"):
        print(f"\ngpuflow: {spec.name} reused a finished run of the same work in {seconds:.1f}s: nothing trained")
        print("               (its code, data and training fields are this run's; --force trains again)")
    else:
        print(f"\ngpuflow: {spec.name} finished in {seconds:.1f}s")
    print(f"  MLflow run   {summary['run_id']} (experiment {summary['experiment']!r}, {summary['tracking_uri']})")
    if open_command(spec):
        print(f"  open it      {open_command(spec)}")
    print(f"               then {run_url(spec, summary['run_id'])}")
    print("  metrics      " + metrics_line(summary["metrics"]))
    sweep = summary.get("sweep")
    if sweep:
        print(
            f"  sweep        {sweep['trials']} trials, {sweep['stopped_early']} stopped early, "
            f"{sweep['failed_trials']} failed; best: "
            + " ".join(f"{path}={value}" for path, value in sweep["best_values"].items())
            + f" (MLflow run {sweep['best_run_id']}, a child of the run above; metrics above are its)"
        )
    if not summary.get("reused"):
        named = {"wall_seconds": "flow"}  # the flow's own wall time; the headline's is the command's, start-up included
        print(
            "  phases       "
            + "  ".join(f"{named.get(k, k.removesuffix('_seconds'))} {v:.1f}s" for k, v in phases.items())
        )
    print(f"  checkpoint   {summary['checkpoint']}")
    if log_file:
        print(f"  full log     {log_file} (or gpuflow run -v)")
    cost = summary.get("cost") or {}
    if "lost_compute_seconds" in cost:
        print(
            f"  recovered    {cost.get('recoveries', 0):g} relaunch(es): {cost['lost_compute_seconds']:.0f} worker-s "
            f"lost (redone, recovering), {cost.get('recovery_seconds', 0):.0f}s from loss to resumed training"
        )
