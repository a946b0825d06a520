#!/usr/bin/env bash
# Install the system daemons the launcher tests (tests/cluster/test_launchers.py) run for real:
# openssh-server (sshd) and slurm-wlm (slurmctld + slurmd + srun/salloc, with munge).
# Idempotent and fast: does nothing when they are already installed. Never fails the build:
# without root or apt-get it says why and exits 0, and those tests skip with a reason.
set -uo pipefail

need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
for bin in slurmctld slurmd srun salloc sinfo; do
  if ! command -v "$bin" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$bin" ]; then
    need+=(slurm-wlm)
    break
  fi
done
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)

if [ ${#need[@]} -eq 0 ]; then
  echo "[ci-system-deps] sshd, slurm and munge already installed"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "[ci-system-deps] apt-get not available; not installing ${need[*]} (ssh/slurm launcher tests will skip)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[ci-system-deps] not root; not installing ${need[*]} (ssh/slurm launcher tests will skip)"
  exit 0
fi

echo "[ci-system-deps] installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the packages' postinst must not try to start the daemons (no init system in CI).
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
fi
status=0
apt-get update -qq || status=$?
if [ $status -eq 0 ]; then
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || status=$?
fi
[ $made_policy -eq 1 ] && rm -f "$policy"
if [ $status -ne 0 ]; then
  echo "[ci-system-deps] apt-get failed (exit $status); ssh/slurm launcher tests will skip"
fi
exit 0
