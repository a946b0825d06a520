"""Write docs/reference/metrics.md: every metric a run's metrics.jsonl can hold, and what it means.

    .venv/bin/python scripts/gen-metrics-reference.py           # (re)write it
    .venv/bin/python scripts/gen-metrics-reference.py --check   # exit 1 when it is stale

The meanings are written here (GLOSSARY). tests/docs/test_metrics_glossary.py finds the names the
code emits (the recipe's step metrics, the evaluator's, the trainer's and the weight push's
statistics, the workflows' counters) and fails when one is missing here: add it, then run this.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # generated_page, beside this file
from generated_page import write_or_check  # noqa: E402

OUT = ROOT / "docs" / "reference" / "metrics.md"

# (section, what it says about its metrics, [(name, meaning)]). A name with <...> is a family: the
# code makes its members from data (a loss's own statistics, an agent's return values).
GLOSSARY: list[tuple[str, str, list[tuple[str, str]]]] = [
    (
        "Every line",
        "",
        [
            ("step", "the training step the line belongs to (1 = the first step's end)"),
            ("time", "when the line was written (Unix seconds)"),
            ("version", "the policy version after this step's update (the trainer's; 0 before any)"),
        ],
    ),
    (
        "The batch and the loop",
        "Written by the recipe at each step (`recipes/gsm8k_plane.py`, `step_metrics`).",
        [
            (
                "reward/mean",
                "mean reward of the batch's trajectories, as the reward function gave it (before shaping)",
            ),
            (
                "staleness/max",
                "the largest staleness in the batch: trainer version minus the oldest token's policy version",
            ),
            ("staleness/mean", "mean staleness over the batch's loss tokens, as the trainer measured it"),
            ("staleness/bound", "the bound the governor keeps, `async.max_staleness` (η)"),
            (
                "throughput/samples_per_s",
                "trajectories trained per second of this step's wall time (its phases' seconds, summed)",
            ),
            (
                "throughput/tokens_per_s",
                "tokens generated per second by all rollout actors, since their start",
            ),
            ("time/<phase>_s", "seconds this step spent in each phase of the loop"),
            ("time/wait_s", "waiting for the buffer to hand over a batch (0 when generation keeps ahead)"),
            ("time/train_s", "rewards shaped, advantages computed, and the trainer ranks' update"),
            (
                "time/eval_s",
                "the first step only, when the first evaluation is still running: the wait for it to end, so "
                "that it measures the weights the run started with before the first push moves them",
            ),
            (
                "time/push_s",
                "the publish: rollout paused, weights pushed to the servers, new version handed out, resumed",
            ),
            ("data/groups", "the ids of the groups trained at this step, comma-separated (a string)"),
            (
                "buffer/dropped_no_signal",
                "groups dropped so far because every reward in them was equal (`[buffer] drop_no_signal`)",
            ),
        ],
    ),
    (
        "Rollout and servers",
        "Summed over the rollout actors, counted since the run started.",
        [
            ("rollout/aborts", "generate requests cut off by a pause and resumed with their tokens"),
            ("rollout/cached_tokens", "prompt tokens the servers served from their prefix cache"),
            (
                "rollout/failovers",
                "requests moved to another server, with their tokens, after a server failed",
            ),
            ("rollout/restarts", "rollout actors restarted after dying (their episodes re-queued)"),
            (
                "rollout/<counter>",
                "a workflow's own counters (its `counters` dict), summed over the rollout actors",
            ),
            ("rollout/agent_runs", "`AgentWorkflow`: agent runs started"),
            ("rollout/agent_errors", "`AgentWorkflow`: runs that raised; the item's group was dropped"),
            (
                "rollout/agent_timeouts",
                "`AgentWorkflow`: runs past `episode_timeout_s`; the item's group was dropped",
            ),
            (
                "rollout/history_edits",
                "agents and environments: requests that did not continue the episode's earlier completion (a new sample started)",
            ),
            ("rollout/env_episodes", "environments (`nodes.rollout.environments`): episodes started"),
            (
                "rollout/env_errors",
                "environments: episodes whose environment or rubric raised, or scored a non-number; the item's group was dropped",
            ),
            (
                "rollout/env_timeouts",
                "environments: episodes past `episode_timeout_s`; the item's group was dropped",
            ),
            ("rollout/sessions_opened", "online mode (`nodes.rollout.sessions`): sessions opened by clients"),
            ("rollout/sessions_rewarded", "online mode: sessions ended by their reward"),
            (
                "rollout/sessions_timed_out",
                "online mode: sessions not rewarded within `session_timeout_s`, dropped (their group went on without them)",
            ),
            (
                "rollout/sessions_refused",
                "online mode: session opens answered 429 (nothing admitted, or the servers paused for a weight push)",
            ),
            (
                "rollout/groups_partial",
                "online mode: groups not filled within `group_timeout_s` (trained as they were, or dropped)",
            ),
            ("rollout/groups_dropped", 'online mode: partial groups dropped (`partial_groups = "drop"`)'),
            (
                "rollout/http_slow_clients",
                "online mode's API server: connections closed (408) because a request's head or body arrived slower than `http.head_timeout_s` / `http.body_timeout_s` allow",
            ),
            (
                "rollout/http_refused_connections",
                "online mode's API server: connections refused (503) past `http.max_connections`",
            ),
            (
                "rollout/http_bad_requests",
                "online mode's API server: requests refused and their connections closed: malformed or smuggling-shaped HTTP, a head or body over its limit (400, 413, 414, 431, 501, 505)",
            ),
            (
                "rollout/http_unauthorized",
                "online mode's API server: requests refused 401 from their headers (a missing or wrong key), their bodies unread",
            ),
            (
                "rollout/http_stalled_readers",
                "online mode's API server: connections reset because their client took nothing of an answer (a stream or a whole one) for `http.send_timeout_s`",
            ),
            ("servers/live", "inference servers in routing after this step's publish"),
            ("servers/joined", "servers that joined routing since the previous step"),
            ("servers/left", "servers that left routing since the previous step (removed or dead)"),
            (
                "servers/min_weight_version",
                "the oldest weight version any live server reports (-1: none answered)",
            ),
        ],
    ),
    (
        "Episodes",
        "",
        [
            (
                "episode/<name>",
                'the mean over the batch of a number a workflow put in a trajectory\'s `meta["info"]`: an agent\'s extra return values (`{"reward": r, "turns": 2}` gives `episode/turns`); each function of an environment rubric',
            ),
        ],
    ),
    (
        "Teachers and judges",
        "Written by the recipe when another model takes part (`[models.<name>]`): a teacher "
        '(`[distill] teacher`), an LLM judge (`[reward] fn = "nodes.rollout.judge:judge"`) or a reward model '
        '(`[reward] fn = "nodes.rollout.judge:reward_model"`).',
        [
            (
                "distill/reverse_kl",
                "mean log π_prox - log π_teacher over the batch's loss tokens: the sampled estimate of the "
                "reverse KL to the teacher that distillation lowers (0 when the teacher is the policy)",
            ),
            (
                "distill/teacher_time_s",
                "mean seconds of a trajectory's teacher call (its prefill), over the batch",
            ),
            (
                "reward/judge_errors",
                "judgements (a judge's or a reward model's) that failed or could not be read, since "
                "the start (scored as `reward.fn_args.on_error` says)",
            ),
            (
                "reward/judge_calls",
                "batched calls to the judge's (or reward model's) servers, since the start",
            ),
            (
                "reward/judge_cache_hits",
                "judgements answered from the judge's cache (the same completion of the same item), since the start",
            ),
            (
                "reward/judge_time_s",
                "mean seconds of one judgement asked of the judge (or reward model), from its queueing for a "
                "batch to its answer, since the start: what a judge adds to a sample's reward",
            ),
        ],
    ),
    (
        "Trainer",
        "Rank 0's statistics of the step's update (`[trainer.loss] fn` and the FSDP2 engine). The loss's "
        "sums are divided by the loss tokens; its maxima and minima are over every rank and micro-batch.",
        [
            (
                "train/<stat>",
                "any statistic the loss returns in its `LossSums` (a loss of your own adds its own)",
            ),
            ("train/loss", "the objective minimised, averaged over the step's optimizer steps"),
            (
                "train/token_loss",
                "the per-token policy loss (with the KL term when `kl_coef > 0`), per loss token",
            ),
            ("train/clip_frac", "share of loss tokens whose ratio was clipped"),
            ("train/dual_clip_frac", "share of loss tokens bound by the dual clip (`c_clip`)"),
            ("train/ratio", "mean ratio π / π_prox over loss tokens (GSPO: the sequence ratio)"),
            ("train/ratio_max", "largest ratio π / π_prox"),
            ("train/ratio_min", "smallest ratio π / π_prox"),
            ("train/approx_kl", "mean log π - log π_prox over loss tokens"),
            (
                "train/behave_imp_weight",
                "mean behaviour weight π_prox / π_behave as applied (capped, masked tokens 0)",
            ),
            ("train/behave_imp_weight_max", "largest behaviour weight, before any cap"),
            ("train/behave_approx_kl", "mean log π_prox - log π_behave over the kept tokens"),
            (
                "train/behave_masked_frac",
                "share of loss tokens masked by the behaviour-weight cap, MIS or the sequence mask",
            ),
            ("train/advantage", "mean advantage over loss tokens"),
            ("train/entropy", "mean entropy of the policy over loss tokens"),
            ("train/ref_kl", "mean k3 KL to the reference model over loss tokens (`kl_coef > 0`)"),
            (
                "train/tis_truncated_frac",
                "share of loss tokens whose behaviour weight was truncated at `tis_cap`",
            ),
            ("train/mis_masked_frac", "share of loss tokens masked by token MIS (`mis_low`, `mis_high`)"),
            ("train/geo_masked_frac", "share of loss tokens in sequences masked by the geometric-mean mask"),
            ("train/geo_ratio_max", "largest per-sequence geometric-mean behaviour weight"),
            ("train/geo_ratio_min", "smallest per-sequence geometric-mean behaviour weight"),
            ("train/seq_ratio_max", "GSPO: largest sequence ratio"),
            ("train/seq_ratio_min", "GSPO: smallest sequence ratio"),
            ("train/staleness_mean", "mean staleness of the loss tokens, in versions"),
            ("train/staleness_max", "largest staleness of a loss token"),
            ("train/grad_norm", "gradient norm before clipping, averaged over the step's optimizer steps"),
            ("train/lr", "the learning rate this step used"),
            ("train/n_seqs", "trajectories in the batch"),
            ("train/n_tokens", "tokens in the batch (prompts and completions)"),
            ("train/n_loss_tokens", "tokens the loss covers (the model's own)"),
            ("train/n_microbatches", "micro-batches over all ranks"),
            ("train/tokens_per_s", "batch tokens per second of the step on the trainer"),
            ("train/prox_time_s", "seconds recomputing the proximal log-probs"),
            ("train/step_time_s", "seconds of the whole train step on the trainer"),
            ("train/version", "the policy version after the update (as `version`)"),
        ],
    ),
    (
        "Weight push",
        "Rank 0's statistics of the step's push to the servers (`[trainer.push]`).",
        [
            ("push/<stat>", "any statistic the weight push returns"),
            ("push/push_time_s", "seconds of the whole push"),
            ("push/push_bytes", "bytes sent"),
            ("push/pause_s", "until every server was paused and in a weight-update session"),
            ("push/transfer_s", "sending the weights"),
            ("push/resume_s", "closing the sessions and resuming"),
            ("push/gather_s", "assembling buckets from the FSDP shards on rank 0"),
            ("push/wait_s", "waiting for broadcasts and the servers' replies"),
            (
                "push/left_paused",
                "servers left paused for the driver to continue once the rollout actors re-posted",
            ),
        ],
    ),
    (
        "Evaluation",
        "On the lines of the steps where a held-out evaluation finished (`run.eval_every`, and after the "
        "last step); the version-0 evaluation is on step 1's line. Accuracy is greedy unless "
        "`run.eval_temperature` says otherwise; intervals are 95% Wilson intervals over items.",
        [
            ("eval/accuracy", "share of held-out items answered right (NaN when the evaluation failed)"),
            ("eval/ci_low", "lower end of its 95% interval"),
            ("eval/ci_high", "upper end of its 95% interval"),
            ("eval/n", "held-out items evaluated (those whose episode failed are left out)"),
            (
                "eval/failed",
                "held-out items whose episode failed (an environment's error, a server lost): counted, logged, "
                "left out of the accuracy",
            ),
            ("eval/version", "the policy version evaluated"),
            ("eval/tool_call_rate", "agents: share of held-out episodes that called a tool"),
            ("eval/tool_call_ci_low", "lower end of its 95% interval"),
            ("eval/tool_call_ci_high", "upper end of its 95% interval"),
        ],
    ),
]

INTRO = """\
<!-- Generated by scripts/gen-metrics-reference.py: do not edit by hand. -->

# Metrics

Each step appends one JSON object to `<run.out_dir>/metrics.jsonl`; the same numbers go to
TensorBoard (`<run.out_dir>/tensorboard`) and to W&B when `[metrics.wandb]` is set
([Monitoring](../operate/monitoring.md)). A value that is not finite is written as `null`.
`nodes.driver.metrics.read_metrics(path)` reads the file back, one dict per step.
A name with `<...>` stands for a family whose members come from data; the known members follow it.
"""


def reference() -> str:
    """The whole glossary, as written to docs/reference/metrics.md."""
    out = [INTRO]
    for section, about, rows in GLOSSARY:
        out += [f"## {section}", ""]
        if about:
            out += [about, ""]
        out += ["| metric | meaning |", "| --- | --- |"]
        out += [f"| `{name}` | {meaning} |" for name, meaning in rows]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def names() -> set[str]:
    """Every name the glossary holds (families as written, ``train/<stat>``)."""
    return {name for _, _, rows in GLOSSARY for name, _ in rows}


def main(argv: list[str] | None = None) -> int:
    return write_or_check(argv, __doc__, OUT, reference, "gen-metrics-reference.py")


if __name__ == "__main__":
    sys.exit(main())
