"""Shoal on simulated hardware, apart from the product services.

- ``engine``: ``SimulatedBackend``, an engine backend whose steps take the time a step-time
  model says (continuous batching, KV block accounting, preemption), behind the real engine
  service (``shoal-engine --backend sim``): every other part of the fleet is the real one.
- ``kv_agent``: the simulated engine's KV agent, timing each copy at ``--sim-kv-gbps``.
- ``fleet``: a whole fleet on simulated time, the router's own dispatch, hold line and
  balancer deciding (the fleet benchmarks).
"""
