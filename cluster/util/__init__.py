"""Small helpers with no gpuflow imports: atomic writes, imports in the background."""
