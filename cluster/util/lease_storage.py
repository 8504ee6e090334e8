"""Where a Prefect server keeps its concurrency leases, read from its own `/admin/settings` answer (Prefect 3.8):
what its restart forgets. One reading for the quota's hold and the admin's warning."""

MEMORY_LEASES = "prefect.server.concurrency.lease_storage.memory"


def leases_kept_in_memory(client) -> bool:
    """The Prefect server keeps concurrency leases in memory (its default): a restart forgets them, while the slots
    they held stay counted until a recount. False when it keeps them on disk or in Redis, or will not say."""
    try:
        storage = client.request("GET", "/admin/settings").json()["server"]["concurrency"]["lease_storage"]
    except Exception:  # an older server, or the admin routes closed: nothing to say
        return False
    return storage == MEMORY_LEASES
