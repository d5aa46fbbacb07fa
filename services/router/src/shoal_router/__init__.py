"""Shoal router: the OpenAI-compatible front door of a fleet of engines."""
