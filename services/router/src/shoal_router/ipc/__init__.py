"""IO with the fleet: ZeroMQ to engines, Redis fleet state, gRPC tokenizer."""
