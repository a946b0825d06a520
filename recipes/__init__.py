"""Recipes: runnable programs that compose the RL roles (``python recipes/gsm8k_grpo.py``)."""
