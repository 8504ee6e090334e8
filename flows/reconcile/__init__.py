"""The reconciler: one pass that reads every record of the runs (flow run, MLflow run, cluster, quota slot,
message) and brings them to agreement, whatever died. What each record's death and true end are is data, in
invariants.py; the reaper's flow (flows/reaper.py) runs the pass on its schedule and when a serve starts."""
