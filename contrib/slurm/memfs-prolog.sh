#!/bin/bash
# memfs-prolog.sh: Slurm Prolog (slurm.conf: Prolog=) giving each job its own memfs
# burst buffer at $MEMFS_MOUNT_BASE/$SLURM_JOB_ID, backed by a directory on the
# parallel filesystem, with the job's input staged into memory before it starts.
# Pair it with memfs-epilog.sh; both need memfs-slurm-lib.sh next to them.
#
# What it does: mount memfs (embedded pool, or a client of a memfs mds), give the
# job's directory to the job's owner, make the job's stage-out tree (if it names
# one) and exclude it from write-back, stage in the files a manifest names, log one
# line per step on stderr. Exits non-zero (Slurm then drains the node and requeues
# the job, held) if any of it fails, after undoing what it did; never starts a job
# without its input. Run twice for one job, it does not mount twice.
#
# From slurmd: SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_GID (else `id -g`),
# SLURM_JOB_USER, SLURM_JOB_WORK_DIR, and the job's --extra/--comment as
# SLURM_JOB_EXTRA/SLURM_JOB_COMMENT.
#
# Site settings: environment variables, normally set in the file
# $MEMFS_SLURM_ENV (default /etc/memfs/slurm.env), which is sourced (shell syntax;
# it may use the SLURM_JOB_* variables, e.g. MEMFS_BACKING=/lustre/$SLURM_JOB_USER):
#   MEMFS                 the memfs command (default: memfs on PATH)
#   MEMFS_MOUNT_BASE      where job mountpoints go (default /mnt/memfs)
#   MEMFS_BACKING         embedded mode: the backing directory (required)
#   MEMFS_BACKING_MKDIR   1: create MEMFS_BACKING if missing, owned by the job's user
#   MEMFS_SIZE            embedded pool size (memfs mount --size; memfs's default if unset)
#   MEMFS_FLUSH_DELAY     seconds after a file's last change before write-back (--flush-delay)
#   MEMFS_DIRTY_MAX       cap on not-yet-written-back bytes (--dirty-max)
#   MEMFS_ROOT_MODE       embedded: mode of the job's mount root (default 0700; empty: leave)
#   MEMFS_MDS             cluster mode: HOST:PORT of the memfs mds (started with --backing)
#   MEMFS_SECRET_FILE     cluster mode: the shared secret file (--secret-file)
#   MEMFS_JOB_DIR         cluster mode: the job's directory inside the shared filesystem
#                         (default $SLURM_JOB_USER/$SLURM_JOB_ID)
#   MEMFS_MOUNT_ARGS      more `memfs mount` arguments (split on blanks), e.g. "--volumes 8"
#   MEMFS_STAGE_IN_MANIFEST  a manifest for every job (the job's own choice wins)
#   MEMFS_STAGE_OUT       a stage-out tree for every job (the job's own choice wins)
#   MEMFS_STAGE_IN_TIMEOUT   seconds for stage-in (default: no limit but Slurm's
#                         PrologEpilogTimeout)
#   MEMFS_JOB_FIELDS      job fields searched for the job's choices
#                         (default "SLURM_JOB_EXTRA SLURM_JOB_COMMENT"; empty: none)
#
# The job's choices: words in `sbatch --extra=...` or `--comment=...`:
#   memfs_manifest=PATH   stage in the files listed in PATH (relative to the job's
#                         working directory); read as the job's user. A manifest
#                         that cannot be read fails the prolog.
#   memfs_stage_out=PATH  a tree (relative to the job's directory) that the epilog
#                         archives as one tar file (see memfs-epilog.sh). Made here,
#                         owned by the job's user, with user.memfs.flush=off, so that
#                         it is never written back file by file, however long the
#                         job runs. A PATH with '..', or one that is a symlink or not a
#                         directory, is logged and left alone (the epilog then writes
#                         it back file by file).

set -eu -o pipefail

MEMFS_TAG=memfs-prolog
# shellcheck source=memfs-slurm-lib.sh source-path=SCRIPTDIR
. "$(dirname -- "${BASH_SOURCE[0]}")/memfs-slurm-lib.sh"
memfs_setup

created_base=0 created_mnt=0 mounted=0 tmp_manifest=

cleanup() {
    local rc=$?
    trap - EXIT
    [ -z "$tmp_manifest" ] || rm -f -- "$tmp_manifest"
    if [ "$rc" -ne 0 ]; then
        if [ "$mounted" = 1 ]; then
            log "cleaning up: unmounting $MNT"
            local pids
            pids=$(daemon_pids "$MNT")
            if ! timeout --kill-after=10 60 "$MEMFS" umount "$MNT" </dev/null >&2; then
                fusermount3 -u -z "$MNT" || true
                # The job never ran: the daemon holds nothing of the job's.
                # shellcheck disable=SC2086 # a list of pids
                [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
            fi
        fi
        [ "$created_mnt" = 0 ] || rmdir -- "$MNT" 2>/dev/null || log "could not remove $MNT"
        [ "$created_base" = 0 ] || rmdir -- "$MEMFS_MOUNT_BASE" 2>/dev/null || true
        log "failed (exit $rc): no memfs for job $SLURM_JOB_ID"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# The manifest first: a job whose input cannot be named must not get a node.
manifest=$(job_option memfs_manifest) || manifest=${MEMFS_STAGE_IN_MANIFEST:-}
if [ -n "$manifest" ]; then
    case $manifest in
        /*) ;;
        *)
            [ -n "${SLURM_JOB_WORK_DIR:-}" ] ||
                die "manifest '$manifest' is relative but SLURM_JOB_WORK_DIR is not set"
            manifest=${SLURM_JOB_WORK_DIR%/}/$manifest
            ;;
    esac
    # Looked at and read as the job's user: root must not read files for the job.
    as_job_user test -f "$manifest" ||
        die "stage-in manifest $manifest does not exist (or is not a file user $JOB_USER can see)"
    tmp_manifest=$(mktemp "${TMPDIR:-/tmp}/memfs-manifest.$SLURM_JOB_ID.XXXXXX")
    err=$(as_job_user cat -- "$manifest" 2>&1 >"$tmp_manifest") ||
        die "stage-in manifest $manifest cannot be read by user $JOB_USER: $err"
    # As memfs stage-in reads it: blank lines and # comments are no entries.
    entries=$(grep -c -v -e '^[[:space:]]*$' -e '^[[:space:]]*#' "$tmp_manifest" || true)
    log "stage-in manifest: $manifest ($entries entries)"
fi

if [ "$MODE" = embedded ] && [ ! -d "$MEMFS_BACKING" ]; then
    [ "${MEMFS_BACKING_MKDIR:-0}" = 1 ] || die "backing directory $MEMFS_BACKING does not exist"
    mkdir -p -- "$MEMFS_BACKING"
    chown -- "$JOB_UID:$JOB_GID" "$MEMFS_BACKING"
    log "created the backing directory $MEMFS_BACKING for user $JOB_USER"
fi

if [ ! -d "$MEMFS_MOUNT_BASE" ]; then
    mkdir -p -- "$MEMFS_MOUNT_BASE"
    created_base=1
fi
memfs_paths

fstype=$(mount_type "$MNT")
if [ "$fstype" = fuse.memfs ]; then
    timeout 30 stat -- "$MNT" >/dev/null 2>&1 ||
        die "$MNT is a memfs mount whose daemon is gone: run memfs-epilog.sh for job $SLURM_JOB_ID or umount -l it"
    log "memfs already mounted at $MNT (prolog run again for job $SLURM_JOB_ID): not mounting twice"
elif [ -n "$fstype" ]; then
    die "$MNT is already a $fstype mount"
else
    if [ ! -d "$MNT" ]; then
        mkdir -m 0755 -- "$MNT"
        created_mnt=1
    fi
    args=(mount "$MNT")
    if [ "$MODE" = cluster ]; then
        args+=(--mds "$MEMFS_MDS")
        [ -z "${MEMFS_SECRET_FILE:-}" ] || args+=(--secret-file "$MEMFS_SECRET_FILE")
        what="cluster client of $MEMFS_MDS"
    else
        args+=(--backing "$MEMFS_BACKING")
        [ -z "${MEMFS_SIZE:-}" ] || args+=(--size "$MEMFS_SIZE")
        [ -z "${MEMFS_FLUSH_DELAY:-}" ] || args+=(--flush-delay "$MEMFS_FLUSH_DELAY")
        [ -z "${MEMFS_DIRTY_MAX:-}" ] || args+=(--dirty-max "$MEMFS_DIRTY_MAX")
        what="embedded pool ${MEMFS_SIZE:-of the default size}, backing $MEMFS_BACKING"
    fi
    read -r -a extra <<<"${MEMFS_MOUNT_ARGS:-}"
    args+=("${extra[@]}")
    if ! out=$("$MEMFS" "${args[@]}" </dev/null 2>&1); then
        die "memfs mount failed: $out"
    fi
    mounted=1
    log "mounted memfs at $MNT ($what)"
fi

if [ "$MODE" = embedded ]; then
    chown -- "$JOB_UID:$JOB_GID" "$MNT"
    [ -z "${MEMFS_ROOT_MODE-0700}" ] || chmod -- "${MEMFS_ROOT_MODE-0700}" "$MNT"
    log "gave $MNT to user $JOB_USER ($JOB_UID:$JOB_GID)"
elif [ -z "$MEMFS_JOB_DIR" ]; then
    log "MEMFS_JOB_DIR is empty: the job gets no directory of its own in the shared filesystem"
else
    # The filesystem is shared by every job: give the job its own directory,
    # creating (and giving away) each missing component of it.
    path=$MNT
    IFS=/ read -r -a parts <<<"$MEMFS_JOB_DIR"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        path=$path/$part
        if [ ! -d "$path" ]; then
            mkdir -m 0700 -- "$path"
            chown -- "$JOB_UID:$JOB_GID" "$path"
        fi
    done
    chown -- "$JOB_UID:$JOB_GID" "$JOB_PATH"
    log "gave $JOB_PATH to user $JOB_USER ($JOB_UID:$JOB_GID)"
fi

# The stage-out tree: made now and excluded from write-back, not only at the end
# by memfs stage-out: a job that runs longer than the flush delay would otherwise
# have it written back file by file (the many small files it is meant to spare
# the backing filesystem).
tree=$(stage_out_tree)
if [ -n "$tree" ]; then
    case /$tree/ in
        /./ | */../* | //*)
            log "stage-out tree '$tree' must be relative to $JOB_PATH, without '..': not made (the epilog writes it back file by file)"
            tree=
            ;;
    esac
fi
if [ -n "$tree" ]; then
    path=$JOB_PATH
    IFS=/ read -r -a parts <<<"$tree"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        path=$path/$part
        if [ -L "$path" ] || { [ -e "$path" ] && [ ! -d "$path" ]; }; then
            log "stage-out tree: $path is a symlink or not a directory: not excluded from write-back"
            tree=
            break
        fi
        if [ ! -e "$path" ]; then
            mkdir -- "$path"
            chown -- "$JOB_UID:$JOB_GID" "$path"
        fi
    done
    if [ -n "$tree" ]; then
        err=$(flush_off "$path" 2>&1) || die "cannot exclude $path from write-back (user.memfs.flush=off): $err"
        log "made $path for the job's stage-out: excluded from write-back, archived by the epilog"
    fi
fi

if [ -n "$manifest" ]; then
    if [ "$entries" = 0 ]; then
        log "manifest $manifest names nothing: no stage-in"
    else
        log "staging in what $manifest names (memfs stage-in)"
        start=$SECONDS
        rc=0
        with_timeout "${MEMFS_STAGE_IN_TIMEOUT:-}" \
            "$MEMFS" stage-in "$MNT" --manifest "$tmp_manifest" </dev/null >&2 || rc=$?
        [ "$rc" -ne 124 ] || die "stage-in did not finish in ${MEMFS_STAGE_IN_TIMEOUT}s"
        [ "$rc" -eq 0 ] || die "stage-in from $manifest failed (memfs stage-in exit $rc)"
        log "staged in what $manifest names in $((SECONDS - start))s"
    fi
fi

log "ready: job $SLURM_JOB_ID of $JOB_USER uses $JOB_PATH"
