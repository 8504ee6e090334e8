"""Prefect flows: the entry points people run, schedule, trigger from the UI and deploy."""
