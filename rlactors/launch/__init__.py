"""Starting a cluster: embedded in the driver (``init``), or standalone from cluster.toml by the
``rlactors`` command (the head and node-agent daemons)."""
