"""The head process: the cluster's control plane (registry, placement, sessions)."""
