"""Adapters that run AstrAI inside other libraries (each imports its library only when used)."""
