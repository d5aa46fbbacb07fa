"""Shoal's tokenizer service: one gRPC server that tokenizes for every served model."""
