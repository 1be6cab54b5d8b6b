"""The Python client for a coliworker."""
