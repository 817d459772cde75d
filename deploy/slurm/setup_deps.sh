#!/usr/bin/env bash
# Prepare what the servers need before they start: the converted decode weights.
#
#   setup_deps.sh convert JOB_DIR
#
# Converts CONVERT_SRC into CONVERT_DST (JOB_DIR/plan/job.env) with the plan's `convert`
# command, exactly once across concurrent jobs sharing the filesystem:
#   * a complete conversion (marker file + shard count + tokenizer files) is reused at
#     once, without running anything else: no model hub is contacted on a cache hit;
#   * otherwise, under an flock on DST.lock (shared filesystem), re-check, then convert
#     into a fresh DST.tmp-XXXXXX, copy missing tokenizer files from the source, validate,
#     write the marker and rename the directory into place (atomic on one filesystem);
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
    for f in $CONVERT_TOKENIZER_FILES; do
        [[ -s $dir/$f ]] || { echo "tokenizer file $f missing or empty"; return; }
    done
}

is_complete() { [[ -f $1/$MARKER && -z "$(check_dir "$1")" ]]; }

convert() {
    local job_dir=$1 tmp reason a kv
    # shellcheck disable=SC1091
    source "$job_dir/plan/job.env"
    [[ -n ${CONVERT_DST:-} ]] || { log "recipe has no conversion: nothing to do"; return 0; }
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

    local argv=() env_entries=()
    mapfile -d '' -t argv < "$job_dir/plan/convert.argv"
    mapfile -d '' -t env_entries < "$job_dir/plan/convert.env"
    local cmd=()
    for a in "${argv[@]}"; do cmd+=("${a//\{dst\}/$tmp}"); done
    log "converting $CONVERT_SRC -> $tmp: ${cmd[*]}"
    (
        for kv in "${env_entries[@]}"; do export "$kv"; done
        exec "${cmd[@]}"
    ) || die "converter failed (exit $?); removed $tmp"

    for a in $CONVERT_TOKENIZER_FILES; do
        [[ -e $tmp/$a || ! -f $CONVERT_SRC/$a ]] || cp "$CONVERT_SRC/$a" "$tmp/$a"
    done
    reason=$(check_dir "$tmp")
    [[ -z $reason ]] || die "conversion output is incomplete: $reason; removed $tmp"
    (cd "$tmp" && find . -type f ! -name "$MARKER" -printf '%s %p\n' | sort -k2) > "$tmp/$MARKER"
    mv -T "$tmp" "$dst"
    trap - EXIT
    log "converted into $dst"
}

case ${1:-} in
    convert)
        [[ $# -eq 2 ]] || die "usage: setup_deps.sh convert JOB_DIR"
        convert "$2" ;;
    *)
        die "usage: setup_deps.sh convert JOB_DIR" ;;
esac
