"""Agents written against the OpenAI SDK, trained by nodes.rollout.agents:AgentWorkflow."""
