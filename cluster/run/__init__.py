"""How a run ends and is billed, shared by the flow, the job and the reaper: the lifecycle, the limits, the
lease (the dead man's switch), closing the MLflow run."""
