"""What runs on the cluster's head: the job (`python -m gpuflow.cluster.job`), its trainer, sweep, guard,
tracking and data split. Nothing here imports Prefect; the flow never imports this room."""
