"""The worker: servicer, tensor store, sessions, config, metrics and CLI."""
