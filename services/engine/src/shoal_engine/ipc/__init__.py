"""ZeroMQ sockets of the engine: requests in, token batches out, each on its own thread."""
