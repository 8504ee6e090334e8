"""Small helpers with no gpuflow imports: atomic writes, background imports, processes and sessions, one HTTP probe,
one poll loop, the local MLflow store made once, and Ray's private APIs behind one module (ray_internals)."""
