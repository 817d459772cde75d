#!/usr/bin/env bash
# Prepare what the servers need before they start: the converted decode weights.
#
#   setup_deps.sh convert JOB_DIR                       (Slurm: settings from the plan)
#   setup_deps.sh convert-env -- CONVERTER [ARGS...]     (Kubernetes: CONVERT_* variables)
#
# Converts CONVERT_SRC into CONVERT_DST (JOB_DIR/plan/job.env, or the environment) with
# the converter command ({src} and {dst} replaced), exactly once across concurrent jobs
# sharing the filesystem. The result is a complete model directory for the decode server:
# the converted shards plus CONVERT_MODEL_FILES (tokenizer, chat template, configs).
#   * a complete conversion (marker file + shard count + model files) is reused at
#     once, without running anything else: no model hub is contacted on a cache hit;
#   * otherwise, under an flock on DST.lock (shared filesystem), re-check, then convert
#     into a fresh DST.tmp-XXXXXX, copy the model files the converter did not write from the
#     source and check the directory as the CONVERT_ENGINE decode server will read it
#     ($CONVERT_PYTHON -m decode_server.model_dir complete: JSON, tokenizer, stop tokens),
#     validate, write the marker and rename the directory into place (atomic on one filesystem);
#   * on any failure the temporary directory is removed: nothing half-written remains
#     (only the empty lock file, which is never deleted: deleting lock files races);
#   * the converter sees the Hugging Face settings of every role (render puts the
#     prefill, decode and router HF_HOME / HF_TOKEN into the plan's convert.env).
set -euo pipefail

MARKER=.tilert-pd-complete

log() { echo "[$(date -u +%FT%TZ)] setup_deps: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# shard_count DIR: number of files matching CONVERT_SHARD_GLOB directly in DIR.
shard_count() {
    local n=0 f
    for f in "$1"/$CONVERT_SHARD_GLOB; do [[ -f $f ]] && n=$((n + 1)); done
    echo "$n"
}

# check_dir DIR: prints why DIR is not a complete conversion (nothing when it is).
check_dir() {
    local dir=$1 n f
    [[ -d $dir ]] || { echo "missing"; return; }
    n=$(shard_count "$dir")
    [[ $n -eq $CONVERT_SHARDS ]] || { echo "$n shards matching '$CONVERT_SHARD_GLOB', expected $CONVERT_SHARDS"; return; }
    for f in $CONVERT_MODEL_FILES; do
        [[ -s $dir/$f ]] || { echo "model file $f missing or empty"; return; }
    done
}

is_complete() { [[ -f $1/$MARKER && -z "$(check_dir "$1")" ]]; }

# convert_with CMD...: the conversion itself; settings from the CONVERT_* variables,
# {src} / {dst} in CMD replaced by the source and the temporary directory.
convert_with() {
    local tmp reason a
    local dst=${CONVERT_DST%/} lock="${CONVERT_DST%/}.lock"
    if is_complete "$dst"; then
        log "reusing complete conversion $dst (converter not run, no hub contact)"
        return 0
    fi
    mkdir -p "$(dirname "$dst")"
    exec {lock_fd}>>"$lock"
    log "waiting for $lock (up to ${CONVERT_LOCK_TIMEOUT}s)"
    flock -w "$CONVERT_LOCK_TIMEOUT" "$lock_fd" || die "timed out after ${CONVERT_LOCK_TIMEOUT}s waiting for $lock"
    if is_complete "$dst"; then
        log "reusing $dst, converted by another job while this one waited"
        return 0
    fi
    [[ ! -e $dst ]] || die "$dst exists but is not a complete conversion ($(check_dir "$dst"); no $MARKER): remove it"
    rm -rf "$dst".tmp-*  # left by a job that was killed while converting; we hold the lock
    tmp=$(mktemp -d "$dst.tmp-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT

    local cmd=()
    for a in "$@"; do a=${a//\{src\}/$CONVERT_SRC}; cmd+=("${a//\{dst\}/$tmp}"); done
    log "converting $CONVERT_SRC -> $tmp: ${cmd[*]}"
    "${cmd[@]}" || die "converter failed (exit $?); removed $tmp"

    "${CONVERT_PYTHON:-python3}" -m decode_server.model_dir complete --source "$CONVERT_SRC" \
        --engine "$CONVERT_ENGINE" --files "$CONVERT_MODEL_FILES" "$tmp" >&2 \
        || die "the converted directory is not a complete $CONVERT_ENGINE model directory (above); removed $tmp"
    reason=$(check_dir "$tmp")
    [[ -z $reason ]] || die "conversion output is incomplete: $reason; removed $tmp"
    (cd "$tmp" && find . -type f ! -name "$MARKER" -printf '%s %p\n' | sort -k2) > "$tmp/$MARKER"
    mv -T "$tmp" "$dst"
    trap - EXIT
    log "converted into $dst"
}

# convert JOB_DIR: settings from the rendered plan; the converter gets the plan's
# convert.env (every role's Hugging Face settings) on top of the job's environment.
convert() {
    local job_dir=$1 kv argv=() env_entries=()
    # shellcheck disable=SC1091
    source "$job_dir/plan/job.env"
    [[ -n ${CONVERT_DST:-} ]] || { log "recipe has no conversion: nothing to do"; return 0; }
    mapfile -d '' -t argv < "$job_dir/plan/convert.argv"
    mapfile -d '' -t env_entries < "$job_dir/plan/convert.env"
    for kv in "${env_entries[@]}"; do export "${kv?}"; done
    convert_with "${argv[@]}"
}

# convert-env -- CMD...: settings from the environment (Kubernetes init container).
convert_env() {
    local v
    for v in CONVERT_SRC CONVERT_DST CONVERT_SHARDS CONVERT_MODEL_FILES; do
        [[ -n ${!v:-} ]] || die "$v is not set"
    done
    CONVERT_SHARD_GLOB=${CONVERT_SHARD_GLOB:-*.safetensors}
    CONVERT_ENGINE=${CONVERT_ENGINE:-tilert}
    CONVERT_LOCK_TIMEOUT=${CONVERT_LOCK_TIMEOUT:-14400}
    [[ $CONVERT_SHARDS =~ ^[1-9][0-9]*$ ]] || die "CONVERT_SHARDS=$CONVERT_SHARDS: not a positive integer"
    [[ $# -gt 0 ]] || die "usage: setup_deps.sh convert-env -- CONVERTER [ARGS with {src} {dst}]"
    convert_with "$@"
}

USAGE="usage: setup_deps.sh convert JOB_DIR | setup_deps.sh convert-env -- CONVERTER [ARGS...]"
case ${1:-} in
    convert)
        [[ $# -eq 2 ]] || die "$USAGE"
        convert "$2" ;;
    convert-env)
        shift
        [[ ${1:-} != -- ]] || shift
        convert_env "$@" ;;
    *)
        die "$USAGE" ;;
esac
