"""Write the cluster.toml of a Slurm allocation: the head on the first node, one agent per node
started with srun (``launch = "slurm"``). gsm8k_grpo.sbatch calls it with ``$SLURM_JOB_NODELIST``.

    python scripts/slurm/cluster_toml.py "gpu[07-08]" --out cluster.toml --run-dir runs/slurm-123 \
        --port 26380 --gpus-per-node 8 --cpus-per-node 64

The node list is expanded with ``scontrol show hostnames`` where it works, else here (the same
bracket syntax: ``a,b``, ``n[1-3,5]``, ``r[1-2]-n[01-04]``). Only the standard library: it runs
before anything else of the job.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path


def split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    return [p for p in [*parts, text[start:]] if p]


def _range(spec: str, whole: str) -> list[str]:
    """``01-03`` -> 01 02 03 (zero-padding kept), ``5`` -> 5."""
    lo, _, hi = spec.partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        raise ValueError(f"bad range {spec!r} in node list {whole!r}")
    if not hi:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"range {spec!r} runs backwards in node list {whole!r}")
    return [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]


def expand_local(nodelist: str) -> list[str]:
    """Slurm's host list syntax expanded without Slurm."""
    hosts: list[str] = []
    for part in split_top(nodelist.strip()):
        pieces = re.split(r"\[([^\]]*)\]", part)  # text, bracket, text, bracket, ..., text
        choices = [
            [s] if i % 2 == 0 else [h for r in s.split(",") for h in _range(r, nodelist)]
            for i, s in enumerate(pieces)
        ]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    return hosts


def expand(nodelist: str) -> list[str]:
    """The host names of ``nodelist``: ``scontrol show hostnames`` where it works, else
    :func:`expand_local`."""
    if shutil.which("scontrol"):
        try:
            run = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            run = None
        if run is not None and run.returncode == 0 and run.stdout.split():
            return run.stdout.split()
    return expand_local(nodelist)


def cluster_toml(
    hosts: list[str],
    *,
    port: int,
    run_dir: str,
    python: str,
    workdir: str,
    gpus_per_node: int,
    cpus_per_node: int,
) -> str:
    """The text of the cluster.toml: head on ``hosts[0]``, an srun-started agent on every host.

    Each agent's srun step asks for the node's GPUs, CPUs and memory (``--overlap`` lets it share
    them with the batch step): without them a step gets one CPU and no GPU, and so would every
    trainer rank and server the agent starts.
    """
    q = json.dumps  # a JSON string is a valid TOML basic string
    resources = {k: v for k, v in (("cpu", cpus_per_node), ("gpu", gpus_per_node)) if v}
    srun = ["--mem=0"]  # all of the job's memory on the node
    if cpus_per_node:
        srun.append(f"--cpus-per-task={cpus_per_node}")
    if gpus_per_node:
        srun.append(f"--gres=gpu:{gpus_per_node}")
    res = "{ " + ", ".join(f"{k} = {v}" for k, v in resources.items()) + " }" if resources else "{}"
    lines = [
        f"# Written by scripts/slurm/cluster_toml.py for the nodes {', '.join(hosts)}.",
        "[head]",
        f"host = {q(hosts[0])}   # the batch script runs on the allocation's first node",
        f"port = {port}",
        "",
        "[cluster]",
        f"secret_file = {q(f'{run_dir}/secret')}   # on a file system every node sees",
        f"log_dir = {q(f'{run_dir}/logs')}",
        f"python = {q(python)}",
        "",
    ]
    for host in hosts:
        lines += [
            "[[nodes]]",
            f"host = {q(host)}",
            'launch = "slurm"',
            f"workdir = {q(workdir)}",
            f"resources = {res}",
            f"srun_options = [{', '.join(q(o) for o in srun)}]",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("nodelist", help='Slurm node list, e.g. "$SLURM_JOB_NODELIST" or "gpu[07-08]"')
    ap.add_argument("--out", required=True, help="the cluster.toml to write")
    ap.add_argument("--run-dir", required=True, help="the job's folder (secret, logs), seen by every node")
    ap.add_argument("--port", type=int, default=6380, help="the head's port (default: %(default)s)")
    ap.add_argument(
        "--python", default=sys.executable, help="the interpreter on every node (default: this one)"
    )
    ap.add_argument("--workdir", default=str(Path.cwd()), help="the agents' working folder (default: here)")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="0: each agent counts them")
    ap.add_argument("--cpus-per-node", type=int, default=0, help="0: each agent counts them")
    args = ap.parse_args(argv)
    try:
        hosts = expand(args.nodelist)
    except ValueError as e:
        print(f'error: {e}; pass a Slurm node list such as "gpu[07-08]"', file=sys.stderr)
        return 2
    if not hosts:
        print(
            "error: the node list is empty; run inside an allocation ($SLURM_JOB_NODELIST)", file=sys.stderr
        )
        return 2
    if args.gpus_per_node < 0 or args.cpus_per_node < 0 or not 1 <= args.port <= 65535:
        print("error: --gpus-per-node and --cpus-per-node must be >= 0, --port 1-65535", file=sys.stderr)
        return 2
    text = cluster_toml(
        hosts,
        port=args.port,
        run_dir=str(Path(args.run_dir).resolve()),
        python=args.python,
        workdir=str(Path(args.workdir).resolve()),
        gpus_per_node=args.gpus_per_node,
        cpus_per_node=args.cpus_per_node,
    )
    Path(args.out).write_text(text)
    print(f"{args.out}: head on {hosts[0]}:{args.port}, {len(hosts)} node(s): {' '.join(hosts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
