"""Domain logic free of IO: dispatch policy and per-request output ordering."""
