"""The actor bench/spawn.py starts: it imports at start-up what a trainer rank imports."""

from __future__ import annotations

import rlactors

# imported once by the fork server when bench/spawn.py lets it fork this package's workers
FORK_PRELOAD = ("torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")


class Heavy(rlactors.Actor):
    def __init__(self) -> None:
        import torch
        import transformers.modeling_utils  # noqa: F401

        self.threads = torch.get_num_threads()

    async def ready(self) -> int:
        return self.threads
