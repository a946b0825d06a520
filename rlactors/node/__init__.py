"""A host: its node agent, the fork server, and the worker process each actor runs in."""
