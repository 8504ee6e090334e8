"""What `gpuflow run` shows: provisioning, each epoch, teardown and the summary. Ray's and MLflow's own lines
from the job stay in the Prefect run's logs and in a log file; `gpuflow run -v` shows them here too."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from gpuflow.cluster.run.monitor import JOB_DETAIL


class HideJobDetail(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, JOB_DETAIL, False)


def quiet_console(log_folder: Path) -> Path:
    """Hides the job's detail lines from Prefect's console handler; writes every line to a log file, returned."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()  # Prefect's console handler exists from here on: the filter goes on it, not on nothing
    root = logging.getLogger()
    consoles = [handler for handler in root.handlers if isinstance(handler, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(HideJobDetail())
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
