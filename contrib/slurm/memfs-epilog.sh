#!/bin/bash
# memfs-epilog.sh: Slurm Epilog (slurm.conf: Epilog=) ending the job's memfs from
# memfs-prolog.sh: stage out, write everything back, unmount, return the memory.
#
# Steps, one stderr line each:
#   1. stage-out, if asked for: the tree becomes one tar file in the backing
#      filesystem instead of many small files (memfs stage-out --archive);
#   2. write back everything the job wrote (memfs flush --wait: embedded, the whole
#      filesystem; cluster, the job's directory);
#   3. unmount (memfs umount, which drains what is left and waits for the daemon),
#      check that the daemon is gone (embedded: its pool memory is freed with it),
#      remove the mountpoint.
# If stage-out or write-back fails or times out, it exits non-zero (Slurm then drains
# the node) and leaves memfs mounted with the data in memory, saying so and
# showing `memfs status`: nothing is thrown away. Fix the cause (e.g. the backing
# filesystem) and run it again with the same variables, or `memfs umount` by hand.
# The prolog made the stage-out tree and excluded it from write-back
# (user.memfs.flush=off), so nothing of it reached the backing filesystem file by
# file while the job ran. A stage-out that is refused before anything happened
# (the tree is a symlink or leads out of the mount, memfs stage-out says no) is
# logged, the tree's exclusion is lifted, and it is written back file by file
# instead; an empty tree is not archived. Nothing mounted for the job: says so, exit 0.
#
# Cluster mode: the job's data stays in the shared filesystem (and in DIR);
# after the flush it is clean, and the pool evicts clean data when it needs the
# memory. A stage-out tree is never written back file by file and never evicted,
# so after its archive is written it is deleted from the filesystem.
#
# Variables: those of memfs-prolog.sh (from $MEMFS_SLURM_ENV, default
# /etc/memfs/slurm.env), and:
#   MEMFS_STAGE_OUT          a tree to stage out, relative to the job's directory
#                            (the mount root; cluster: MEMFS_JOB_DIR); the job's
#                            memfs_stage_out=PATH (--extra/--comment) wins
#   MEMFS_STAGE_OUT_ARCHIVE  the tar file to write; relative: under MEMFS_BACKING
#                            (default TREE-$SLURM_JOB_ID.tar there, TREE being the
#                            tree's last component); cluster mode: set it, or
#                            MEMFS_BACKING to the backing directory as this node sees it
#   MEMFS_STAGE_OUT_TIMEOUT, MEMFS_FLUSH_TIMEOUT, MEMFS_UMOUNT_TIMEOUT
#                            seconds for each step (default: no limit but Slurm's
#                            PrologEpilogTimeout; set them below it, so that a hung
#                            backing filesystem gets a clear message)

set -eu -o pipefail

MEMFS_TAG=memfs-epilog
# shellcheck source=memfs-slurm-lib.sh source-path=SCRIPTDIR
. "$(dirname -- "${BASH_SOURCE[0]}")/memfs-slurm-lib.sh"
memfs_setup

trap 'rc=$?; [ "$rc" -eq 0 ] || log "failed (exit $rc) for job $SLURM_JOB_ID"' EXIT
trap 'exit 143' TERM INT

# Wait up to $2 seconds (default 30) for the daemons $1 (a list of pids) to exit.
wait_gone() {
    local pid deadline=$((SECONDS + ${2:-30}))
    for pid in $1; do
        while alive "$pid"; do
            [ "$SECONDS" -lt "$deadline" ] || return 1
            sleep 0.2
        done
    done
}

if [ ! -d "$MEMFS_MOUNT_BASE" ]; then
    log "nothing mounted for job $SLURM_JOB_ID ($MEMFS_MOUNT_BASE does not exist): nothing to do"
    exit 0
fi
memfs_paths

fstype=$(mount_type "$MNT")
if [ -z "$fstype" ]; then
    log "nothing mounted at $MNT: nothing to do"
    pids=$(daemon_pids "$MNT")
    if [ -n "$pids" ]; then
        # Unmounted by someone else, still writing back: let it finish.
        log "the memfs daemon of $MNT (pid $pids) is still running (writing back?): waiting"
        wait_gone "$pids" "${MEMFS_UMOUNT_TIMEOUT:-600}" ||
            die "memfs daemon $pids of $MNT still running; it may hold data not yet written back"
    fi
    if [ -d "$MNT" ] && rmdir -- "$MNT" 2>/dev/null; then
        log "removed the empty mountpoint $MNT"
    fi
    exit 0
fi
[ "$fstype" = fuse.memfs ] || die "$MNT is a $fstype mount, not memfs: not touching it"
timeout 30 stat -- "$MNT" >/dev/null 2>&1 ||
    die "memfs at $MNT does not answer (its daemon died?): what it had not written back is lost; remove it with umount -l $MNT"

# 1. stage-out. Refusals (the job's or the site's mistake) fall back to writing
# the tree back file by file: its exclusion (the prolog's) is lifted first. A
# failure of memfs stage-out itself leaves the tree excluded (pinned), so it keeps
# the mount (see the end of step 2).
refuse() {
    log "stage-out of ${tree}: $*; it is written back file by file instead"
    # $src: stage_out's, once it is known to be a path in the mount.
    if [ -n "${src:-}" ] && [ -d "$src" ] && [ ! -L "$src" ]; then
        local err
        err=$(flush_on "$src" 2>&1) || {
            log "cannot lift the exclusion of $src from write-back: $err"
            return 1
        }
    fi
}

stage_out() {
    local src archive real rc=0
    case /$tree/ in
        //) return 0 ;;
        /./ | */../* | //*) refuse "the path must be relative to $JOB_PATH, without '..'"; return 0 ;;
    esac
    if [ ! -e "$JOB_PATH/$tree" ] && [ ! -L "$JOB_PATH/$tree" ]; then
        log "stage-out: $JOB_PATH/$tree does not exist (the job removed it): nothing to stage out"
        return 0
    fi
    # The tree is the job's: it must not lead root out of the job's filesystem.
    if [ -L "$JOB_PATH/$tree" ] || ! real=$(realpath -e -- "$JOB_PATH/$tree") ||
        [ "${real#"$MNT"/}" = "$real" ]; then
        refuse "$JOB_PATH/$tree is a symlink or leads out of $MNT"
        return
    fi
    src=$JOB_PATH/$tree
    if [ -d "$src" ] && [ -z "$(find "$src" -mindepth 1 -print -quit)" ]; then
        log "stage-out: $src is empty (the job wrote nothing there): nothing to stage out"
        return 0
    fi
    archive=${MEMFS_STAGE_OUT_ARCHIVE:-$(basename -- "$tree")-$SLURM_JOB_ID.tar}
    case $archive in
        /*) ;;
        *)
            [ -n "${MEMFS_BACKING:-}" ] || { refuse "archive '$archive' is relative and MEMFS_BACKING is not set"; return; }
            archive=$MEMFS_BACKING/$archive
            ;;
    esac
    if [ -L "$archive" ] || { [ -e "$archive" ] && [ ! -f "$archive" ]; }; then
        refuse "$archive exists and is not a regular file"
        return
    fi
    log "staging out $src to $archive"
    with_timeout "${MEMFS_STAGE_OUT_TIMEOUT:-}" \
        "$MEMFS" stage-out "$src" --archive "$archive" </dev/null >&2 || rc=$?
    if [ "$rc" -eq 2 ]; then  # memfs's usage errors: checked before it touches anything
        refuse "memfs stage-out refused it"
        return
    elif [ "$rc" -ne 0 ]; then
        log "stage-out of $src failed (memfs stage-out exit $rc)"
        return 1
    fi
    chown -- "$JOB_UID:$JOB_GID" "$archive" || log "could not give $archive to user $JOB_USER"
    log "staged out $src: $(stat -c %s -- "$archive") bytes in $archive"
    if [ "$MODE" = cluster ]; then
        # Excluded from write-back and never evicted, it would stay in the shared pool.
        rm -rf -- "$src"
        log "removed $src from the shared pool (it is in $archive)"
    fi
}

stage_out_failed=0
tree=$(stage_out_tree)
stage_out || stage_out_failed=1

# 2. write-back
targets=()
what=everything
if [ "$MODE" = cluster ] && [ -n "$MEMFS_JOB_DIR" ]; then
    targets=("$JOB_PATH")
    what=$JOB_PATH
fi
rc=0
start=$SECONDS
if [ "${#targets[@]}" -gt 0 ] && [ ! -d "$JOB_PATH" ]; then
    log "$JOB_PATH does not exist (the job removed it): nothing of the job's to write back"
    what=nothing
else
    log "writing back $what to the backing directory (memfs flush --wait)"
    with_timeout "${MEMFS_FLUSH_TIMEOUT:-}" \
        "$MEMFS" flush "$MNT" "${targets[@]}" --wait </dev/null >&2 || rc=$?
fi
if [ "$rc" -ne 0 ]; then
    [ "$rc" -ne 124 ] || log "write-back did not finish in ${MEMFS_FLUSH_TIMEOUT}s"
    log "write-back failed (memfs flush exit $rc); memfs status $MNT:"
    "$MEMFS" status "$MNT" </dev/null >&2 || true
    die "$MNT stays mounted with the data not yet written back in memory: fix the backing filesystem, then run this epilog again (or memfs umount $MNT)"
fi
log "wrote back $what in $((SECONDS - start))s"
if [ "$stage_out_failed" = 1 ]; then
    die "stage-out failed: $MNT stays mounted with the tree $JOB_PATH/$tree in memory (it is excluded from write-back); fix the cause and run this epilog again"
fi

# 3. unmount, daemon gone, mountpoint removed
pids=$(daemon_pids "$MNT")
log "unmounting $MNT"
for attempt in 1 2 3 4 5; do
    rc=0
    out=$(with_timeout "${MEMFS_UMOUNT_TIMEOUT:-}" "$MEMFS" umount "$MNT" </dev/null 2>&1) || rc=$?
    if [ "$rc" -eq 0 ]; then
        # e.g. what it loses: the stage-out tree, archived, is not written back.
        [ -z "$out" ] || log "memfs umount: $out"
        break
    fi
    [ "$rc" -ne 124 ] || die "memfs umount did not finish in ${MEMFS_UMOUNT_TIMEOUT}s: the daemon${pids:+ (pid $pids)} is still writing back"
    case $out in
        *busy*) [ "$attempt" -lt 5 ] || die "memfs umount: $out" ;;
        *) die "memfs umount failed: $out" ;;
    esac
    log "$MNT is busy (job processes still exiting?): retrying"
    sleep 2
done
[ -z "$pids" ] || wait_gone "$pids" 30 ||
    die "memfs daemon $pids of $MNT still running after unmount"
if rmdir -- "$MNT" 2>/dev/null; then
    log "done: $MNT unmounted and removed, daemon gone, memory returned"
else
    log "done: $MNT unmounted, daemon gone, memory returned; $MNT not removed (not empty?)"
fi
