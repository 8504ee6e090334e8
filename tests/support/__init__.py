"""The suite's shared helpers (fixtures stay in tests/conftest.py):

- repo: the repository's path and the fields of specs built in tests;
- processes: what a test left running (by GPUFLOW_HOME), and waiting for a condition;
- runs: a flow run read back (Prefect's logs and progress bars, its MLflow runs);
- tiers, cpu_report: the suite's pytest plugins (the tiers and hygiene checks; CPU-seconds by file);
- servers, team_stack, sky_double: real servers for a test, the team stack, the SkyPilot SDK double;
- metadata_double: the clouds' node metadata service (AWS's, GCP's), giving spot notices a test posts;
- shards_driver: a Ray Data driver run as `python -m tests.support.shards_driver`.
"""
