"""Runnable examples of dramatiq-guard (run them from the repository root)."""
