"""Helpers shared by tests and benchmarks (bench/ imports them too); the product never imports them.

- :mod:`tests.helpers.cluster`: what a test reads from a running cluster (an actor's worker pid).
- :mod:`tests.helpers.servers`: start and stop reference (or SGLang) servers, wait on their load.
- :mod:`tests.helpers.synthetic`: synthetic GRPO batches with controllable lengths.
"""
