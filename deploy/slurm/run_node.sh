#!/usr/bin/env bash
# Run one step of a rendered plan on this node (inside the role's container when there is one).
#
#   run_node.sh JOB_DIR STEP_ID
#
# Reads JOB_DIR/plan/STEP_ID.argv and .env (NUL-separated, written by
# `python -m pd_deploy.recipe render`), replaces @HOSTi@ by the i-th line of
# JOB_DIR/hosts and @JOBDIR@ by JOB_DIR, exports the environment and execs the command,
# appending its output to JOB_DIR/logs/STEP_ID.log. The exec keeps the process tree
# simple: Slurm's signal reaches the server itself.
set -euo pipefail

die() { echo "run_node.sh: $*" >&2; exit 2; }

[[ $# -eq 2 ]] || die "usage: run_node.sh JOB_DIR STEP_ID"
job_dir=$1
step=$2
plan="$job_dir/plan"
[[ -f "$plan/$step.argv" ]] || die "no step '$step' in $plan (see $plan/steps.tsv)"
[[ -f "$job_dir/hosts" ]] || die "$job_dir/hosts is missing (written by submit.sh inside the job)"

mapfile -t hosts < "$job_dir/hosts"

# subst TEXT: replace @HOSTi@ and @JOBDIR@ placeholders; prints the result.
subst() {
    local text=$1 i
    for i in "${!hosts[@]}"; do
        text=${text//@HOST$i@/${hosts[$i]}}
    done
    printf '%s' "${text//@JOBDIR@/$job_dir}"
}

mapfile -d '' -t raw_argv < "$plan/$step.argv"
mapfile -d '' -t raw_env < "$plan/$step.env"
[[ ${#raw_argv[@]} -gt 0 ]] || die "step '$step' has an empty command"

argv=()
for a in "${raw_argv[@]}"; do argv+=("$(subst "$a")"); done
for kv in "${raw_env[@]}"; do
    [[ $kv == *=* ]] || die "bad environment entry '$kv' in $plan/$step.env"
    export "$(subst "$kv")"
done

mkdir -p "$job_dir/logs"
cd "$job_dir"
echo "[$(date -u +%FT%TZ)] $(hostname -s) $step: ${argv[*]}" >> "$job_dir/logs/$step.log"
exec "${argv[@]}" >> "$job_dir/logs/$step.log" 2>&1
