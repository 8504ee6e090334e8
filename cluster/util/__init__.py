"""Small helpers with no gpuflow imports: atomic writes, background imports, processes and sessions, one HTTP probe,
one poll loop."""
