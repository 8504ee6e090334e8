"""Prefect flows: the entry points people run, schedule, trigger from the UI and deploy."""

import os

from gpuflow.flows.run_logs import name_gpuflow_loggers

# Without a Prefect server, each entry point (`gpuflow run`, the reaper) starts a temporary API that migrates its
# database before it answers: on a busy 2-core machine that outlasts Prefect's 20 s wait. Set before Prefect loads.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
name_gpuflow_loggers()  # likewise: Prefect reads its extra-loggers setting when it sets up logging
# A flow run whose process dies before it has a cluster or an MLflow run leaves only its heartbeats to say so: the
# reaper marks it Crashed once they stop. Prefect sends none unless asked (30 s is its shortest period).
os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")
