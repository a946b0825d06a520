"""Environments written for other trainers, trained unchanged: ``verifiers`` environments (Prime
Intellect's Environments Hub) and OpenEnv environment servers.

``[rollout] workflow = "nodes.rollout.environments:VerifiersWorkflow"``, ``":VerifiersV1Workflow"``
(verifiers 0.4's tasksets, each in a Python environment of its own) or ``":OpenEnvWorkflow"``;
docs/tutorials/environments.md shows both. Each episode talks to the rollout actor's
OpenAI-compatible endpoint, so its turns are token-exact as an agent's are (nodes/rollout/agents.py).
The packages are the ``envs`` extra, imported only when an environment is used.
"""

from nodes.rollout.environments.episodes import EnvError, EpisodeSettings
from nodes.rollout.environments.openenv_env import OpenEnvConfig, OpenEnvWorkflow
from nodes.rollout.environments.verifiers_env import VerifiersConfig, VerifiersWorkflow
from nodes.rollout.environments.verifiers_v1 import VerifiersV1Config, VerifiersV1Workflow

__all__ = [
    "EnvError",
    "EpisodeSettings",
    "OpenEnvConfig",
    "OpenEnvWorkflow",
    "VerifiersConfig",
    "VerifiersV1Config",
    "VerifiersV1Workflow",
    "VerifiersWorkflow",
]
