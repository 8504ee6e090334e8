"""What runs without an orchestrator: the spec, the backends, the on-cluster job and its loop helpers."""
