"""Where to find a running cluster, and (later) cluster.toml parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlactors.errors import ClusterError

STATE_DIR = Path(os.environ.get("RLACTORS_STATE_DIR", "~/.rlactors")).expanduser()
STATE_FILE = STATE_DIR / "cluster.json"


def resolve_connect(address: str | None, secret_file: str | None) -> tuple[str, str | None]:
    """The head address and secret file for ``connect()``: arguments, then env, then ``rlactors up``'s state."""
    addr = address or os.environ.get("RLACTORS_ADDRESS")
    secret = secret_file or os.environ.get("RLACTORS_SECRET_FILE")
    if addr is None and STATE_FILE.exists():
        state = json.loads(STATE_FILE.read_text())
        addr = state.get("address")
        secret = secret or state.get("secret_file")
    if addr is None:
        raise ClusterError(
            "no cluster address: pass one to connect(), set RLACTORS_ADDRESS, or start a cluster with `rlactors up cluster.toml`"
        )
    if addr.startswith("tcp://") and not secret:
        raise ClusterError(
            f"connecting to {addr} needs the cluster's secret file (secret_file= or RLACTORS_SECRET_FILE)"
        )
    return addr, secret
