"""Getting a run its clusters: `waiting` (the first launch and each relaunch: the spec's options, the wait when none
has capacity, the spot fallback, a deadline's choice of spot, on-demand or a wait) and `replacement` (a cluster
provisioned beside the one training: on a spot notice, and when a deadline's run on on-demand can go back to spot)."""
