"""Code that runs inside the job's processes: the agent, its hooks, the sitecustomize shim (stdlib only at import)."""
