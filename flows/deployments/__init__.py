"""gpuflow's Prefect deployments: declared in prefect.yaml, served from a machine or registered with a work pool."""
