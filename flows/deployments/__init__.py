"""gpuflow's Prefect deployments: declared in prefect.yaml, served from a machine or registered with a work pool."""

REAPER = "reap-clusters"  # the reconciler's flow and its deployment (prefect.yaml): served, and asked for when overdue
