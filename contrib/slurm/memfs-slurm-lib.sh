# shellcheck shell=bash disable=SC2034  # sets variables for the scripts that source it
# memfs-slurm-lib.sh: what memfs-prolog.sh and memfs-epilog.sh share (sourced, not run).
#
# Reads the site configuration, checks it, and works out the job's paths:
#   MNT       the job's mountpoint, $MEMFS_MOUNT_BASE/$SLURM_JOB_ID (canonical)
#   JOB_PATH  the job's directory: MNT, or MNT/$MEMFS_JOB_DIR in cluster mode
#   MODE      embedded | cluster
#   JOB_UID, JOB_GID, JOB_USER   the job's owner
# The variables themselves are described in memfs-prolog.sh and README.md.

# slurmd starts Prolog/Epilog with no PATH and an environment of its own making
# (SLURM_* and SPANK_* only): set both up here.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${PATH:+:$PATH}
export PATH
umask 022

log() { printf '%s: %s\n' "$MEMFS_TAG" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# A path relative to some root, given by a job or the site: no "/..." and no "..".
check_relative() {  # WHAT PATH
    case /$2/ in
        //) die "$1 is empty" ;;
        /./ | */../*) die "$1 '$2' must not contain '..' (and not be '.')" ;;
    esac
    case $2 in /*) die "$1 '$2' must be relative, not absolute" ;; esac
}

# The job's own choice, NAME=VALUE among the words of the Slurm job fields named
# in MEMFS_JOB_FIELDS (--extra and --comment: SLURM_JOB_EXTRA, SLURM_JOB_COMMENT).
# Words are separated by blanks, commas or semicolons. Prints VALUE; fails if absent.
job_option() {  # NAME
    local field text word
    local IFS=$' \t\n,;'
    for field in ${MEMFS_JOB_FIELDS-SLURM_JOB_EXTRA SLURM_JOB_COMMENT}; do
        case $field in SLURM_JOB_[A-Z]*) ;; *) die "MEMFS_JOB_FIELDS: '$field' is not a SLURM_JOB_* variable" ;; esac
        text=${!field:-}
        set -f
        for word in $text; do
            case $word in
                "$1"=*) set +f; printf '%s\n' "${word#*=}"; return 0 ;;
            esac
        done
        set +f
    done
    return 1
}

# The type of the filesystem mounted at $1 (the topmost), or nothing. Reads the
# mount table instead of stat-ing the path: a memfs whose daemon died answers
# ENOTCONN, and that must not look like "not mounted".
mount_type() {  # PATH (canonical, without blanks or backslashes)
    awk -v p="$1" '$2 == p { t = $3 } END { if (t != "") print t }' /proc/self/mounts
}

# Pids of memfs daemons serving mountpoint $1: processes whose arguments hold
# "mount" directly followed by $1 (the daemon is the forked `memfs mount`).
daemon_pids() {  # MOUNTPOINT
    local d i found=()
    local -a argv
    for d in /proc/[0-9]*; do
        [ "${d#/proc/}" != "$$" ] || continue
        mapfile -d '' -t argv 2>/dev/null < "$d/cmdline" || continue
        for ((i = 0; i + 1 < ${#argv[@]}; i++)); do
            if [ "${argv[i]}" = mount ] && [ "${argv[i+1]}" = "$1" ]; then
                found+=("${d#/proc/}")
                break
            fi
        done
    done
    [ "${#found[@]}" -eq 0 ] || printf '%s\n' "${found[*]}"
}

alive() {  # PID: running, and not a zombie waiting for its parent to reap it
    local state
    state=$(awk '{ sub(/^.*\) /, ""); print $1 }' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# Run "$@" with a time limit of $1 seconds (0 or empty: none). Exit 124 on timeout.
with_timeout() {  # SECONDS CMD...
    local t=$1
    shift
    if [ -n "$t" ] && [ "$t" != 0 ]; then
        timeout --kill-after=30 "$t" "$@"
    else
        "$@"
    fi
}

# The stage-out tree's exclusion from write-back (memfs's user.memfs.flush xattr):
# setfattr/getfattr if installed (Debian: attr), else Python (which memfs needs anyway).
flush_off() {  # PATH
    if command -v setfattr >/dev/null 2>&1; then
        setfattr -n user.memfs.flush -v off -- "$1"
    else
        python3 -c 'import os, sys; os.setxattr(sys.argv[1], "user.memfs.flush", b"off")' "$1"
    fi
}

flush_is_off() {  # PATH: succeeds if PATH itself has user.memfs.flush=off
    local v
    if command -v getfattr >/dev/null 2>&1; then
        v=$(getfattr --only-values -n user.memfs.flush -- "$1" 2>/dev/null) || return 1
    else
        v=$(python3 -c 'import os, sys; sys.stdout.write(os.getxattr(sys.argv[1], "user.memfs.flush").decode())' "$1" 2>/dev/null) || return 1
    fi
    [ "$v" = off ]
}

flush_on() {  # PATH: written back file by file again
    if ! flush_is_off "$1"; then
        return 0
    fi
    if command -v setfattr >/dev/null 2>&1; then
        setfattr -x user.memfs.flush -- "$1"
    else
        python3 -c 'import os, sys; os.removexattr(sys.argv[1], "user.memfs.flush")' "$1"
    fi
}

# The stage-out tree named by the job (memfs_stage_out=) or the site (MEMFS_STAGE_OUT),
# without a trailing slash; empty if none.
stage_out_tree() {
    local tree
    tree=$(job_option memfs_stage_out) || tree=${MEMFS_STAGE_OUT:-}
    printf '%s\n' "${tree%/}"
}

# Run "$@" as the job's owner (for reading files the job names: root must not
# read them on the job's behalf).
as_job_user() {
    if [ "$(id -u)" = 0 ] && [ "$JOB_UID" != 0 ]; then
        setpriv --reuid="$JOB_UID" --regid="$JOB_GID" --init-groups -- "$@"
    else
        "$@"
    fi
}

memfs_setup() {
    local conf=${MEMFS_SLURM_ENV:-/etc/memfs/slurm.env}
    if [ -e "$conf" ]; then
        # shellcheck source=/dev/null
        . "$conf" || die "cannot read the configuration $conf"
    fi

    [ -n "${SLURM_JOB_ID:-}" ] || die "SLURM_JOB_ID is not set: run this as a Slurm Prolog/Epilog"
    case $SLURM_JOB_ID in *[!0-9]*) die "bad SLURM_JOB_ID '$SLURM_JOB_ID'" ;; esac
    JOB_UID=${SLURM_JOB_UID:-}
    case $JOB_UID in '' | *[!0-9]*) die "bad or missing SLURM_JOB_UID '$JOB_UID'" ;; esac
    JOB_GID=${SLURM_JOB_GID:-$(id -g -- "$JOB_UID" 2>/dev/null || true)}
    case $JOB_GID in '' | *[!0-9]*) die "no group for uid $JOB_UID (SLURM_JOB_GID unset, id -g failed)" ;; esac
    JOB_USER=${SLURM_JOB_USER:-$JOB_UID}

    MEMFS=${MEMFS:-$(command -v memfs || true)}
    [ -n "$MEMFS" ] || die "no memfs command on PATH ($PATH): set MEMFS"
    [ -x "$MEMFS" ] || die "MEMFS=$MEMFS is not an executable file"

    MEMFS_MOUNT_BASE=${MEMFS_MOUNT_BASE:-/mnt/memfs}
    case $MEMFS_MOUNT_BASE in /*) ;; *) die "MEMFS_MOUNT_BASE '$MEMFS_MOUNT_BASE' must be absolute" ;; esac
    case $MEMFS_MOUNT_BASE in *[[:space:]\\]*) die "MEMFS_MOUNT_BASE must not contain blanks or backslashes" ;; esac

    if [ -n "${MEMFS_MDS:-}" ]; then
        MODE=cluster
        MEMFS_JOB_DIR=${MEMFS_JOB_DIR-$JOB_USER/$SLURM_JOB_ID}
    else
        MODE=embedded
        MEMFS_JOB_DIR=${MEMFS_JOB_DIR:-}
        [ -n "${MEMFS_BACKING:-}" ] || die "set MEMFS_BACKING (the backing directory) or MEMFS_MDS (cluster mode)"
    fi
    if [ -n "$MEMFS_JOB_DIR" ]; then
        MEMFS_JOB_DIR=${MEMFS_JOB_DIR%/}
        check_relative MEMFS_JOB_DIR "$MEMFS_JOB_DIR"
    fi
}

# MNT and JOB_PATH under the canonical base (which must exist by now).
memfs_paths() {
    local base
    base=$(realpath -e -- "$MEMFS_MOUNT_BASE") || die "cannot resolve $MEMFS_MOUNT_BASE"
    case $base in *[[:space:]\\]*) die "$base must not contain blanks or backslashes" ;; esac
    MNT=${base%/}/$SLURM_JOB_ID
    JOB_PATH=$MNT${MEMFS_JOB_DIR:+/$MEMFS_JOB_DIR}
}
