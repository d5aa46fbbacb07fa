"""Local fleet launcher: the whole fleet on one machine, no Kubernetes."""
