"""The guard middlewares."""
