#!/usr/bin/env bash
# Launch a PD deployment described by a recipe as ONE Slurm job, one role per node.
#
#   submit.sh [--job-dir DIR] [--dry-run] [--sbatch-arg ARG]... RECIPE
#
# On the login node: validates the recipe and renders its plan into DIR/plan
# (`python -m pd_deploy.recipe render`, with $PYTHON, default python3), copies
# these scripts into DIR/bin and submits DIR/bin/submit.sh --in-job DIR with sbatch.
# DIR (default ./pd-runs/<recipe>-<UTC time>) must be on a filesystem every node sees.
#
# Inside the job (on the first node), in this order:
#   1. weight conversion, once, on the first decode node (setup_deps.sh convert);
#   2. the decode servers, each an srun step on its node (run_node.sh), in the role's
#      container (pyxis --container-image) when srun has pyxis, else plain; gate: /ready;
#   3. the prefill server (same way), which handshakes with every decode KV endpoint as
#      it starts; gate: /health;
#   4. the router, then its /ready gate (ready only once the KV handshake succeeded);
#   5. a smoke chat completion; DIR/fingerprint.json (every server's build info, read from its
#      /metrics, the recipe and its hash, the exact commands); the benchmark steps (aiperf per
#      scenario and concurrency, with every server's /metrics; lm-eval gsm8k), if any; the
#      results (DIR/results/agg_*.json) and DIR/summary.md (gsm8k below its threshold: failed);
#   6. with hold: serve until the job is cancelled or DIR/STOP appears;
#   then every step is stopped (router first) and the job ends.
# DIR/state holds the current phase (converting, starting, ready, benchmark ID, serving,
# stopping, then done, failed or cancelled); DIR/logs/ one log per step.
set -euo pipefail

log() { echo "[$(date -u +%FT%TZ)] submit.sh: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------- login node
submit() {
    local job_dir="" dry_run=0 recipe="" sbatch_args=()
    while [[ $# -gt 0 ]]; do
        case $1 in
            --job-dir) job_dir=$2; shift 2 ;;
            --dry-run) dry_run=1; shift ;;
            --sbatch-arg) sbatch_args+=("$2"); shift 2 ;;
            -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
            -*) die "unknown option $1" ;;
            *) [[ -z $recipe ]] || die "one recipe only"; recipe=$1; shift ;;
        esac
    done
    [[ -n $recipe ]] || die "usage: submit.sh [--job-dir DIR] [--dry-run] [--sbatch-arg ARG]... RECIPE"
    local py=${PYTHON:-python3}
    if [[ $dry_run -eq 1 ]]; then
        exec "$py" -m pd_deploy.recipe dry-run "$recipe"
    fi
    local name
    name=$("$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["name"])' "$recipe") \
        || die "cannot read the recipe name from $recipe"
    job_dir=${job_dir:-$PWD/pd-runs/$name-$(date -u +%Y%m%dT%H%M%SZ)}
    mkdir -p "$job_dir/bin" "$job_dir/logs"
    job_dir=$(cd "$job_dir" && pwd)
    "$py" -m pd_deploy.recipe render "$recipe" --job-dir "$job_dir" >/dev/null
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    cp "$here/submit.sh" "$here/run_node.sh" "$here/setup_deps.sh" "$job_dir/bin/"
    # shellcheck disable=SC1091
    source "$job_dir/plan/job.env"
    local args=(--parsable --job-name "pd-$RECIPE_NAME" --nodes "$NUM_NODES" --ntasks-per-node 1
                --output "$job_dir/logs/job-%j.out" --time "$SLURM_TIME")
    [[ -z $SLURM_PARTITION ]] || args+=(--partition "$SLURM_PARTITION")
    [[ -z $SLURM_ACCOUNT ]] || args+=(--account "$SLURM_ACCOUNT")
    # shellcheck disable=SC2153  # GPUS_PER_NODE comes from job.env
    [[ $GPUS_PER_NODE -eq 0 ]] || args+=(--gpus-per-node "$GPUS_PER_NODE" --exclusive)
    [[ -z $CPUS_PER_NODE ]] || args+=(--cpus-per-task "$CPUS_PER_NODE")
    local job_id
    job_id=$(sbatch "${args[@]}" "${sbatch_args[@]}" "$job_dir/bin/submit.sh" --in-job "$job_dir")
    echo "${job_id%%;*}" > "$job_dir/job_id"
    echo "submitted job ${job_id%%;*}; job dir $job_dir" >&2
    echo "${job_id%%;*}"
}

# ---------------------------------------------------------------- inside the job
job_dir="" hosts=() use_pyxis=0 service_pids=() service_ids=() cancelled=0

subst_hosts() {
    local text=$1 i
    for i in "${!hosts[@]}"; do text=${text//@HOST$i@/${hosts[$i]}}; done
    printf '%s' "$text"
}

# set_state PHASE: JOB_DIR/state, replaced atomically (readers never see it half-written).
set_state() { echo "$1" > "$job_dir/state.tmp" && mv -f "$job_dir/state.tmp" "$job_dir/state"; log "state: $1"; }

# srun_step STEP_ID NODE IMAGE: srun arguments running STEP_ID on NODE (its container if any).
srun_step() {
    local step=$1 node=$2 image=$3 cmd=(srun --nodes 1 --ntasks 1 --nodelist "${hosts[$2]}" --overlap
                                        --job-name "$1" --kill-on-bad-exit=1)
    if [[ $use_pyxis -eq 1 && $image != - ]]; then
        local mounts="$job_dir:$job_dir"
        [[ -z $CONTAINER_MOUNTS ]] || mounts+=",$CONTAINER_MOUNTS"
        cmd+=(--container-image "$image" --container-mounts "$mounts" --no-container-mount-home)
    fi
    printf '%s\0' "${cmd[@]}"
}

# start_step STEP_ID NODE IMAGE: start the service STEP_ID as a background srun step; remembers its pid.
start_step() {
    local step=$1 node=$2 image=$3 cmd=()
    mapfile -d '' -t cmd < <(srun_step "$step" "$node" "$image")
    "${cmd[@]}" bash "$job_dir/bin/run_node.sh" "$job_dir" "$step" < /dev/null &
    service_pids+=($!)
    service_ids+=("$step")
    log "started $step on ${hosts[$node]} (srun pid $!)"
}

# run_task STEP_ID NODE IMAGE CMD...: run CMD as a foreground step; fails the job if it fails.
run_task() {
    local step=$1 node=$2 image=$3 cmd=()
    shift 3
    mapfile -d '' -t cmd < <(srun_step "$step" "$node" "$image")
    "${cmd[@]}" "$@" < /dev/null || die "step $step failed (see $job_dir/logs/)"
}

http_status() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1" 2>/dev/null || true; }

# gate STEP_ID URL: wait until URL answers 200 while the step is alive.
gate() {
    local step=$1 url=$2 i pid="" deadline=$((SECONDS + GATE_TIMEOUT))
    for i in "${!service_ids[@]}"; do [[ ${service_ids[$i]} != "$step" ]] || pid=${service_pids[$i]}; done
    log "gate: waiting for $url ($step)"
    while [[ $(http_status "$url") != 200 ]]; do
        [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null \
            || die "$step exited before $url was ready; last log lines:$(echo; tail -n 30 "$job_dir/logs/$step.log" 2>/dev/null)"
        [[ $SECONDS -lt $deadline ]] || die "$url not ready after ${GATE_TIMEOUT}s"
        sleep 2
    done
    log "gate: $step ready"
}

# step_ids NAME: Slurm step id(s) of this job's step called NAME.
step_ids() { squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | awk -v n="$1" '$2 == n {print $1}'; }

# stop_step INDEX: SIGTERM the step's server itself (srun would SIGKILL it), wait, then force.
stop_step() {
    local i=$1 id waited pid=${service_pids[$1]}
    kill -0 "$pid" 2>/dev/null || return 0
    for id in $(step_ids "${service_ids[$i]}"); do scancel --signal=TERM "$id" 2>/dev/null || true; done
    for ((waited = 0; waited < 60; waited++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then
        log "${service_ids[$i]} ignored SIGTERM for 30s: cancelling its step"
        kill -TERM "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

stop_services() {
    local i
    [[ ${#service_pids[@]} -gt 0 ]] || return 0
    set_state stopping
    for ((i = ${#service_pids[@]} - 1; i >= 0; i--)); do stop_step "$i"; done  # router first
    service_pids=()
    service_ids=()
}

on_exit() {
    local rc=$?
    trap - EXIT TERM INT
    stop_services
    if [[ $rc -eq 0 ]]; then set_state "done"; elif [[ $cancelled -eq 1 ]]; then set_state cancelled
    else set_state failed; fi
    exit "$rc"
}

smoke_test() {
    local body out
    body=$(printf '{"model": "%s", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}' "$MODEL_NAME")
    out=$(curl -s --max-time 300 -w '\n%{http_code}' -H 'Content-Type: application/json' \
          -d "$body" "$ROUTER_URL/v1/chat/completions") || die "smoke test: router unreachable"
    echo "${out%$'\n'*}" > "$job_dir/smoke.json"
    [[ ${out##*$'\n'} == 200 ]] || die "smoke test: HTTP ${out##*$'\n'}: ${out%$'\n'*}"
    log "smoke test: chat completion ok"
}

in_job() {
    job_dir=$1
    [[ -n ${SLURM_JOB_ID:-} ]] || die "--in-job runs inside a Slurm allocation (use submit.sh RECIPE)"
    # shellcheck disable=SC1091
    source "$job_dir/plan/job.env"
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n "$NUM_NODES")
    [[ ${#hosts[@]} -eq $NUM_NODES ]] || die "allocation has ${#hosts[@]} nodes, the plan needs $NUM_NODES"
    printf '%s\n' "${hosts[@]}" > "$job_dir/hosts"
    # the servers file the router and prefill's connector watch (rewrite it, then rename it
    # over, to add or remove servers while the job runs)
    subst_hosts "$(cat "$job_dir/plan/servers.yaml")" > "$job_dir/servers.yaml.tmp"
    mv -f "$job_dir/servers.yaml.tmp" "$job_dir/servers.yaml"
    ROUTER_URL=$(subst_hosts "$ROUTER_URL")
    case $CONTAINER_MODE in
        pyxis) use_pyxis=1 ;;
        auto) if srun --help 2>/dev/null | grep -q -- --container-image; then use_pyxis=1; fi ;;
    esac
    log "job $SLURM_JOB_ID: nodes ${hosts[*]}; containers: $([[ $use_pyxis -eq 1 ]] && echo pyxis || echo none)"
    trap on_exit EXIT
    trap 'log "signalled: stopping"; cancelled=1; exit 143' TERM INT

    local rows=() row id role node image url
    mapfile -t rows < "$job_dir/plan/steps.tsv"
    set_state converting
    for row in "${rows[@]}"; do
        IFS=$'\t' read -r id role _ node image url <<< "$row"
        if [[ $role == convert ]]; then
            run_task "$id" "$node" "$image" bash "$job_dir/bin/setup_deps.sh" convert "$job_dir"
        fi
    done
    set_state starting
    # Decode first: its KV endpoint listens only once its engine is loaded, and vLLM's
    # connector handshakes with it when vLLM starts (the router is ready only after that
    # handshake). Every decode server starts at once; prefill once they are all ready.
    for phase in decode prefill; do
        for row in "${rows[@]}"; do
            IFS=$'\t' read -r id role _ node image url <<< "$row"
            if [[ $role == "$phase" ]]; then start_step "$id" "$node" "$image"; fi
        done
        for row in "${rows[@]}"; do
            IFS=$'\t' read -r id role _ node image url <<< "$row"
            if [[ $role == "$phase" ]]; then gate "$id" "$(subst_hosts "$url")"; fi
        done
    done
    for row in "${rows[@]}"; do
        IFS=$'\t' read -r id role _ node image url <<< "$row"
        if [[ $role == router ]]; then
            start_step "$id" "$node" "$image"
            gate "$id" "$(subst_hosts "$url")"
        fi
    done
    if [[ $SMOKE_TEST -eq 1 ]]; then smoke_test; fi
    set_state ready
    # fingerprint.json before the benchmarks, summary.md after them
    for phase in fingerprint benchmark summary; do
        for row in "${rows[@]}"; do
            IFS=$'\t' read -r id role _ node image url <<< "$row"
            if [[ $role == "$phase" ]]; then
                [[ $phase != benchmark ]] || set_state "benchmark $id"
                run_task "$id" "$node" "$image" bash "$job_dir/bin/run_node.sh" "$job_dir" "$id"
            fi
        done
    done

    if [[ $HOLD -eq 1 ]]; then
        set_state serving
        log "serving at $ROUTER_URL until the job is cancelled or $job_dir/STOP exists"
        while [[ ! -e $job_dir/STOP ]]; do
            for i in "${!service_pids[@]}"; do
                kill -0 "${service_pids[$i]}" 2>/dev/null || die "${service_ids[$i]} exited while serving"
            done
            sleep 1
        done
        log "STOP file found"
    fi
}

if [[ ${1:-} == --in-job ]]; then
    [[ $# -eq 2 ]] || die "usage: submit.sh --in-job JOB_DIR"
    in_job "$2"
else
    submit "$@"
fi
