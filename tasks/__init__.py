"""Prefect tasks: one step of an experiment each (validate, stage data, track, provision, train, teardown)."""
