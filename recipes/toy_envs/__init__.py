"""verifiers environments shipped with the recipe (``[rollout.workflow_args] env = "recipes.toy_envs.<name>"``)."""
