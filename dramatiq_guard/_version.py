"""The version of dramatiq-guard, in a module of its own so every module can name it."""

__version__ = "0.2.0.dev0"
