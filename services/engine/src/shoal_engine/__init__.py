"""Shoal's engine service: one vLLM engine, fed and drained over ZeroMQ."""
