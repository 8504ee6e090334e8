"""What `gpuflow run` shows of a job's log (tasks/compute.py): the line a terminal would show."""

from pathlib import Path

from gpuflow.cluster.protocol import EPOCH_LINE, RESULT_LINE
from gpuflow.cluster.run.monitor import ANSI, visible


def test_a_progress_bar_drawn_on_an_epoch_line_is_not_shown():
    """A raw line of a job's log as Ray forwards it (a Ray Data progress bar, then the controller's epoch line)."""
    epoch = "(TrainController pid=14569) [gpuflow] epoch 3: train_loss=0.2934 val_accuracy=0.95"
    raw = (
        "\r(pid=14686) Running Dataset dataset_4.: 0.00 row [00:00, ? row/s]\r"
        + " " * 40
        + "\r\x1b[A"
        + "\x1b[36m"
        + epoch
        + "\x1b[0m"
    )
    assert visible(raw) == epoch and EPOCH_LINE.search(visible(raw)).group(1) == "3"
    assert visible("plain line  ") == "plain line" and visible("\r \r") == ""


def test_only_the_jobs_own_result_line_ends_the_tail():
    """The job's last line, bare (local) or behind SkyPilot's task prefix, ends the tail; the same text from a Ray
    worker, or drawn after a progress bar, does not."""
    result = '[gpuflow] result {"metrics": {}}'
    assert RESULT_LINE.match(result) and RESULT_LINE.match(f"(digits-mlp, pid=25726) {result}")
    assert RESULT_LINE.match(ANSI.sub("", f"\x1b[36m(digits-mlp, pid=25726)\x1b[0m {result}"))
    assert not RESULT_LINE.match(f"(digits-mlp, pid=25726) (RayTrainWorker pid=26135) {result}")
    assert not RESULT_LINE.match(f"(RayTrainWorker pid=26135) {result}")
    assert not RESULT_LINE.match(f"\r(pid=14686) Running Dataset\r{result}")


def test_an_epoch_record_makes_one_short_line():
    """The train task's record of an epoch (its fields as tasks/compute.py sets them), as a log or a pipe shows it."""
    import logging

    from gpuflow.cluster.protocol import epoch_metrics
    from gpuflow.cluster.run.monitor import progress
    from gpuflow.flows.cli.console import Progress, without_ray_prefix

    line = (
        "(TrainController pid=14569) [gpuflow] epoch 2: train_loss=0.1183 val_accuracy=0.962 perf/epoch_s=0.41 "
        "perf/samples_per_s=5043"
    )
    record = logging.makeLogRecord(
        {
            "msg": line,
            **progress(
                phase="training",
                epoch=3,
                epochs=10,
                metrics=epoch_metrics(line),
                train_seconds=20.0,
                cost_usd=0.004,
                hourly_usd=0.0,
            ),
        }
    )
    shown = Progress()
    assert shown.update(record) and shown.phase == "training"
    assert shown.epoch_line() == "epoch 3/10  val_accuracy 0.962  train_loss 0.1183  0.4 s/epoch  ETA 0:02  $0.00"
    assert without_ray_prefix(logging.makeLogRecord({"msg": line})).msg.startswith("[gpuflow] epoch 2:")


def test_the_summary_counts_no_epoch_of_its_own():
    """The loop's last epoch is its index (9 of a 10-epoch run, as MLflow keeps it): the summary, after a console that
    said `epoch 10/10`, does not say `epoch=9`."""
    from gpuflow.tasks.compute import metrics_line

    final = {"train_loss": 0.07516, "val_accuracy": 0.9861, "perf/epoch_s": 0.27, "epoch": 9}
    assert metrics_line(final) == "train_loss=0.07516 val_accuracy=0.9861 perf/epoch_s=0.27"
    assert metrics_line({**final, "step": 400}, telemetry=False) == "train_loss=0.07516 val_accuracy=0.9861"


def test_prefects_notes_on_hooks_are_hidden_but_a_failing_hook_is_not():
    import logging

    from gpuflow.flows.cli.console import HideHookNotes

    def shown(level: int, message: str) -> bool:
        return HideHookNotes().filter(logging.makeLogRecord({"levelno": level, "msg": message}))

    assert not shown(logging.INFO, "Running hook 'notify_end' in response to entering state 'Completed'")
    assert not shown(logging.INFO, "Hook 'notify_end' finished running successfully")
    assert shown(logging.ERROR, "An error was encountered while running hook 'notify_end'")
    assert shown(logging.INFO, "Hook line of the user's own that says something else")


def test_gpuflow_s_lines_show_as_the_run_they_were_logged_in(prefect_server):
    """The console shows a line of gpuflow's module loggers (the lifecycle's, a backend's) as the task or flow run it
    was logged in says it, beside Prefect's own; a line outside any run stays as it was."""
    import logging

    from prefect import flow, task

    from gpuflow.flows.cli.console import as_its_run_says

    def said(message: str):
        record = logging.getLogger("gpuflow.cluster.run.lifecycle").makeRecord(
            "gpuflow.cluster.run.lifecycle", logging.INFO, __file__, 1, message, None, None
        )
        shown = as_its_run_says(record)
        return shown, getattr(shown, "task_name", None)

    @task(name="teardown")
    def tear_down():
        return said("tearing down cluster gpuflow-x")

    @flow(name="say-where")
    def say_where():
        return said("waiting for 2 GPUs"), tear_down()

    (in_flow, flow_task), (in_task, task_name) = say_where()
    assert (in_task.name, task_name) == ("prefect.task_runs", "teardown") and in_task.task_run_name.startswith(
        "teardown"
    )
    assert (in_flow.name, flow_task) == ("prefect.flow_runs", None) and in_flow.flow_run_name
    outside, _ = said("no run")
    assert outside.name == "gpuflow.cluster.run.lifecycle" and not hasattr(outside, "task_run_name")


REGISTER_TWICE = """
import sys
from pathlib import Path

from gpuflow.flows.cli.console import quiet_console

folder = Path(sys.argv[1])
print("LOG FILE", quiet_console(folder / "logs"), flush=True)  # before MLflow loads, as in `gpuflow run`

import mlflow
import numpy as np
import torch
from prefect import flow

from gpuflow.cluster.spec import parse_spec
from gpuflow.tasks.tracking import register_model

spec = parse_spec({"train": {"loop": "experiments.digits:train_loop"}, "name": "quiet",
                   "tracking": {"uri": f"sqlite:///{folder}/mlflow.db"}})
mlflow.set_tracking_uri(spec.tracking_uri)
with mlflow.start_run() as run:
    mlflow.pytorch.log_model(torch.nn.Linear(2, 1), name="model", input_example=np.zeros((1, 2), dtype=np.float32),
                             pip_requirements=["torch"])


@flow
def register_twice() -> list:
    return [register_model(spec, run.info.run_id) for _ in range(2)]


print("VERSIONS", [str(version) for version in register_twice()])
"""


def test_registering_a_model_prints_nothing_past_the_quiet_console(prefect_server, tmp_path):
    """What `gpuflow run` shows of a registration: gpuflow's line, not MLflow's own notes ("Successfully registered
    model", "already exists. Creating a new version", "Waiting up to 300 seconds", its INFO lines), on the terminal or
    in the log."""
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = subprocess.run(
        [sys.executable, "-c", REGISTER_TWICE, str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown[-3000:]
    log_file = shown.split("LOG FILE ", 1)[1].split("\n", 1)[0]
    shown = shown.split("LOG FILE ", 1)[1]  # what the quiet console shows: after quiet_console
    assert "VERSIONS ['1', '2']" in shown  # the second time, the model exists: a new version
    assert "registered model 'quiet' version 2" in shown  # gpuflow's own line
    for noise in (
        "Successfully registered",
        "already exists",
        "Created version",
        "Waiting up to",
        "INFO mlflow",
    ):  # e.g. "Creating initial MLflow database tables"
        assert noise not in shown and noise not in Path(log_file).read_text(), noise


OUTLIVES_ITS_READER = """
import logging, sys, time
from prefect.logging.configuration import setup_logging
setup_logging()
if sys.argv[1] == "gpuflow":
    from gpuflow.flows.prefect_internals import quiet_on_broken_pipe
    quiet_on_broken_pipe()
print("ready", flush=True)
time.sleep(1)  # its reader goes meanwhile
for i in range(50):
    logging.getLogger("prefect.gpuflow").warning("epoch %d", i)
print("and a print, as MLflow's client makes one", flush=True)
open(sys.argv[2], "w").write("went on")
"""


def test_a_flow_process_whose_console_reader_is_killed_goes_on(tmp_path):
    """A served flow run writes its console to its runner through a pipe: the runner killed -9, the run's next log
    line meets a broken pipe, on which Prefect's console (rich) ends the process. With gpuflow's flow set up, the
    console goes quiet and the process goes on; Prefect's own console still ends it (the check can fail)."""
    import os
    import subprocess
    import sys

    went_on = {}
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}  # Prefect's defaults
    for console in ("gpuflow", "prefect"):
        marker = tmp_path / f"{console}.txt"
        process = subprocess.Popen(
            [sys.executable, "-c", OUTLIVES_ITS_READER, console, str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        assert process.stdout.readline() == b"ready\n"
        process.stdout.close()  # the runner gone
        went_on[console] = (process.wait(timeout=120), marker.exists())
    assert went_on == {"gpuflow": (0, True), "prefect": (1, False)}
