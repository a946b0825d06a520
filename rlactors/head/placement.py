"""Resource accounting and node choice for actors (cpus, gpus, custom resources).

Resources are plain numbers per node. GPUs are also tracked by index, so an actor given
``{"gpu": 2}`` gets two concrete devices, which its worker sees as CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from rlactors.base.errors import PlacementError

__all__ = ["BundleTable", "NodeResources", "choose_node", "normalise_request", "plan_bundles"]

EPS = 1e-9


def normalise_request(resources: dict[str, Any] | None) -> dict[str, float]:
    """Validate a resource request: names to non-negative numbers; gpu counts are whole."""
    out: dict[str, float] = {}
    for k, v in (resources or {}).items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"resource {k!r}: amount must be a non-negative number, got {v!r}")
        key = {"cpus": "cpu", "gpus": "gpu", "num_cpus": "cpu", "num_gpus": "gpu"}.get(k, k)
        if key == "gpu" and float(v) != int(v):
            raise ValueError(f"gpu requests must be whole numbers, got {v}")
        if v:
            out[key] = float(v)
    return out


@dataclass
class NodeResources:
    """Total and used resources of one node, with GPU indices."""

    total: dict[str, float]
    used: dict[str, float] = field(default_factory=dict)
    free_gpus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.free_gpus:
            self.free_gpus = list(range(int(self.total.get("gpu", 0))))

    def free(self) -> dict[str, float]:
        return {k: v - self.used.get(k, 0.0) for k, v in self.total.items()}

    def fits(self, req: dict[str, float]) -> bool:
        free = self.free()
        return all(free.get(k, 0.0) + EPS >= v for k, v in req.items())

    def acquire(self, req: dict[str, float]) -> list[int]:
        """Take ``req``; returns the GPU indices given (empty if none asked)."""
        if not self.fits(req):
            raise PlacementError(f"cannot acquire {req}: free {self.free()}")
        for k, v in req.items():
            self.used[k] = self.used.get(k, 0.0) + v
        n = int(req.get("gpu", 0))
        gpus, self.free_gpus = self.free_gpus[:n], self.free_gpus[n:]
        return gpus

    def release(self, req: dict[str, float], gpus: list[int]) -> None:
        for k, v in req.items():
            self.used[k] = max(0.0, self.used.get(k, 0.0) - v)
        self.free_gpus = sorted(set(self.free_gpus) | set(gpus))


def choose_node(
    nodes: dict[str, NodeResources],
    req: dict[str, float],
    *,
    strategy: str = "pack",
    node_id: str | None = None,
) -> str:
    """Pick a node for ``req``. ``pack`` fills the busiest fitting node, ``spread`` the idlest."""
    if strategy not in ("pack", "spread"):
        raise ValueError(f"unknown placement strategy {strategy!r} (use 'pack' or 'spread')")
    if node_id is not None:
        if node_id not in nodes:
            raise PlacementError(f"no alive node {node_id!r}; nodes: {sorted(nodes)}")
        if not nodes[node_id].fits(req):
            raise PlacementError(f"node {node_id} cannot fit {req}: free {_fmt(nodes[node_id].free())}")
        return node_id
    fitting = [nid for nid, n in nodes.items() if n.fits(req)]
    if not fitting:
        free = "; ".join(f"{nid}: {_fmt(n.free())}" for nid, n in sorted(nodes.items())) or "no alive nodes"
        raise PlacementError(f"no node can fit {req}. Free resources: {free}")

    def load(nid: str) -> float:
        n = nodes[nid]
        return sum(n.used.get(k, 0.0) / v for k, v in n.total.items() if v > 0)

    if strategy == "pack":
        return max(fitting, key=lambda nid: (load(nid), nid))
    return min(fitting, key=lambda nid: (load(nid), nid))


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}={v:g}" for k, v in sorted(res.items())) + "}"


def plan_bundles(
    nodes: dict[str, NodeResources], bundles: list[dict[str, float]], strategy: str = "pack"
) -> list[str]:
    """Choose a node for every bundle, all or nothing; raises PlacementError naming what did not fit.

    ``pack`` puts bundles together where they fit, ``spread`` prefers different nodes,
    ``strict_spread`` requires a different node for each bundle.
    """
    if strategy not in ("pack", "spread", "strict_spread"):
        raise ValueError(f"unknown bundle strategy {strategy!r} (use 'pack', 'spread' or 'strict_spread')")
    trial = {nid: NodeResources(dict(n.total), dict(n.used), list(n.free_gpus)) for nid, n in nodes.items()}
    chosen: list[str] = []
    # Largest bundles first, so big ones are not crowded out by small ones.
    order = sorted(range(len(bundles)), key=lambda i: -sum(bundles[i].values()))
    placed: dict[int, str] = {}
    for i in order:
        req = bundles[i]
        used_nodes = set(placed.values())
        candidates = [nid for nid, n in trial.items() if n.fits(req)]
        if strategy == "strict_spread":
            candidates = [nid for nid in candidates if nid not in used_nodes]
        if not candidates:
            free = (
                "; ".join(f"{nid}: {_fmt(n.free())}" for nid, n in sorted(nodes.items())) or "no alive nodes"
            )
            raise PlacementError(
                f"cannot reserve {len(bundles)} bundles {bundles} with strategy {strategy}: bundle {i} {req} does not fit. "
                f"Free resources: {free}"
            )
        if strategy == "pack":
            nid = max(candidates, key=lambda c: (c in used_nodes, -len(trial), c))
        else:
            nid = min(candidates, key=lambda c: (c in used_nodes, sum(trial[c].used.values()), c))
        trial[nid].acquire(req)
        placed[i] = nid
    chosen = [placed[i] for i in range(len(bundles))]
    return chosen


class BundleTable:
    """Placement groups: reserved bundles (node, resources, GPUs) and which actor occupies each."""

    def __init__(self) -> None:
        self.groups: dict[str, list[dict[str, Any]]] = {}

    def reserve(
        self, nodes: dict[str, NodeResources], bundles: list[dict[str, Any]], strategy: str
    ) -> tuple[str, list[str]]:
        """Take every bundle's resources from ``nodes`` (all or nothing); returns the group id and nodes."""
        reqs = [normalise_request(b) for b in bundles]
        if not reqs:
            raise ValueError("reserve_bundles needs at least one bundle")
        where = plan_bundles(nodes, reqs, strategy)
        gid = "pg-" + uuid.uuid4().hex[:8]
        self.groups[gid] = [
            {"node_id": nid, "resources": req, "gpus": nodes[nid].acquire(req), "actor": None}
            for nid, req in zip(where, reqs, strict=True)
        ]
        return gid, where

    def free_bundle(self, gid: str, index: int, alive: set[str]) -> dict[str, Any]:
        """Bundle ``index`` of ``gid`` if it exists, is on an alive node and holds no actor."""
        bundles = self.groups.get(gid)
        if bundles is None:
            raise PlacementError(f"no placement group {gid!r} (was it released?)")
        if not 0 <= index < len(bundles):
            raise PlacementError(f"placement group {gid} has {len(bundles)} bundles, no bundle {index}")
        b = bundles[index]
        if b["node_id"] not in alive:
            raise PlacementError(f"bundle {index} of {gid} is on node {b['node_id']}, which is dead")
        if b["actor"] is not None:
            raise PlacementError(f"bundle {index} of {gid} is in use by actor {b['actor']}")
        return b

    def vacate(self, gid: str, index: int, actor_id: str) -> None:
        """The actor in this bundle is gone: the bundle (not its node) gets the resources back."""
        bundles = self.groups.get(gid)
        if bundles is not None and bundles[index].get("actor") == actor_id:
            bundles[index]["actor"] = None
