"""gpuflow's module loggers (`gpuflow.<room>`) write into the Prefect run that is current: its flow or task run's
logs in the UI, and the console, as Prefect's own run loggers do. Prefect's extra-loggers setting attaches them."""

from __future__ import annotations

import logging
import os

LOGGER = "gpuflow"
EXTRA_LOGGERS = "PREFECT_LOGGING_EXTRA_LOGGERS"


def name_gpuflow_loggers() -> None:
    """Names gpuflow's loggers in Prefect's extra-loggers setting, in this process and the ones it starts (a served
    flow run's, a worker's); at INFO, where the root's WARNING would hide a run's progress."""
    names = [name.strip() for name in os.environ.get(EXTRA_LOGGERS, "").split(",") if name.strip()]
    if LOGGER not in names:
        os.environ[EXTRA_LOGGERS] = ",".join([*names, LOGGER])
    # gpuflow's lines outside any run (the CLI's own, a listing of clusters) belong to none: the console has them,
    # and Prefect need not warn that it cannot send them to a run
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    logging.getLogger(LOGGER).setLevel(logging.INFO)


def attach_gpuflow_loggers() -> None:
    """In a process that set up Prefect's logging before it imported gpuflow (a flow run started by Prefect from
    the deployment's entrypoint), the setting came too late: Prefect's API handler is added here, as Prefect adds
    it to each extra logger. Idempotent."""
    from prefect.logging.handlers import APILogHandler

    from gpuflow.flows.prefect_internals import extra_logger_handlers

    logger = logging.getLogger(LOGGER)
    handlers = extra_logger_handlers()  # first: it sets up Prefect's logging, which may attach them itself
    if not any(isinstance(handler, APILogHandler) for handler in logger.handlers):
        for handler in handlers:
            logger.addHandler(handler)
