"""The warm local stack and Prefect's temporary API: what makes a `gpuflow run` start without waiting."""
