"""Shoal's wire contracts, shared by every service (no service imports another service)."""
