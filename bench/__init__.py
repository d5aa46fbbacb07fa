"""Shoal's benchmarks, one module each, run from the repository root as ``python -m bench.<name>``
(``make bench*``); ``bench.harness`` holds what they share."""
