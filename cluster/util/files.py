"""Files that other processes read while this one writes them."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Readers see the old text or the new, never half; writers at once (runs, threads) each replace it whole."""
    temp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        temp.write_text(text)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)  # only left if the write failed
