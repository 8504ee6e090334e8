"""`gpuflow rerun RUN`: an MLflow run (or a Prefect flow run) run again as it ran, from what the run recorded.

find.py (the run, from its id or its flow run's), source.py (a checkout of its commit, its uncommitted diff applied),
checks.py (its data, by digest; its packages, against this environment), plan.py (the spec to run and what it says),
links.py (the tags that link a run and its reruns; the comparison of the two), for_flow.py (a rerun the flow is asked
for: the Prefect UI's rerun field, prepared as `gpuflow rerun` prepares it), work_key.py (a digest of what decides what
a run's training produces, recorded on every run, and the lookups of a finished run by it).
"""


class RerunRefused(ValueError):
    """A rerun that cannot run as the run ran: what differs, and the flag or step that goes on anyway."""
