"""verifiers environments shipped with the recipe (``[rollout.workflow_args] env = "recipes.envs.<name>"``)."""
