#!/usr/bin/env bash
# One online-mode session from a shell (curl and jq): open it, two turns, post its reward.
# RL_URL: the session API (urls[0] of <run.out_dir>/sessions.json); RL_KEY: its key (api_key there).
set -euo pipefail
auth="Authorization: Bearer $RL_KEY"
post() { curl -sSf -H "$auth" -H "Content-Type: application/json" -d "$2" "$1"; }
session=$(post "$RL_URL" "{\"task_id\": \"${TASK_ID:-sums-17}\"}")  # 429: retry after Retry-After
id=$(jq -r .id <<<"$session"); base=$(jq -r .base_url <<<"$session")
messages='[{"role": "user", "content": "What is 9 + 8?"}]'
reply=$(post "$base/chat/completions" "{\"model\": \"policy\", \"messages\": $messages}")
answer=$(jq .choices[0].message <<<"$reply")  # send the answer back as served: the turns stay one sequence
messages=$(jq -c ". + [$answer, {\"role\": \"user\", \"content\": \"Only the number, please.\"}]" <<<"$messages")
reply=$(post "$base/chat/completions" "{\"model\": \"policy\", \"messages\": $messages}")
reward=$(jq -r '.choices[0].message.content' <<<"$reply" | grep -q 17 && echo 1.0 || echo 0.0)
post "$RL_URL/$id/reward" "{\"reward\": $reward}"; echo
