#!/bin/sh
# Builds this pod's TF_CONFIG from its role and StatefulSet ordinal, then runs the training application.
#   ROLE         chief | worker | ps
#   NAME         job name prefix (default ctr); pods are $NAME-$ROLE-<i> behind headless services $NAME-$ROLE
#   NUM_WORKERS, NUM_PS, PORT (defaults 2, 2, 2222)
#   TRAIN_ARGS   extra flags for `python -m tf_sharded train`
#   DRY_RUN=1    print TF_CONFIG and exit (used by the tests)
# TensorFlow's servers run whatever graph a listed task sends them, so TF_CONFIG names only this job's own
# services, in this pod's namespace (relative names resolve there first): a value that would make it name
# anything else is refused with one line on stderr and exit code 2.
set -eu
NAME="${NAME:-ctr}"
PORT="${PORT:-2222}"
NUM_WORKERS="${NUM_WORKERS:-2}"
NUM_PS="${NUM_PS:-2}"
ROLE="${ROLE:-}"
HOSTNAME="${HOSTNAME:-}"

die() {  # one line, whatever the received values hold
  printf 'error: %s\n' "$(printf '%s' "$*" | tr '\n\r' '  ')" >&2
  exit 2
}

count() {  # variable value: a positive integer, without a leading zero (it goes into JSON)
  case "$2" in '' | 0* | *[!0-9]*) die "$1 must be a positive integer; received $1=$2" ;; esac
  [ "${#2}" -le 5 ] || die "$1 must be at most 99999; received $1=$2"
}

case "$ROLE" in chief | worker | ps) ;; *) die "ROLE must be chief, worker or ps; received ROLE=$ROLE" ;; esac
# A DNS label without dots: the addresses below stay names of this namespace's services.
case "$NAME" in
  [a-z]*[!a-z0-9-]* | [!a-z]* | *-) die "NAME must be a DNS label (a-z, 0-9, '-'; a letter first); received NAME=$NAME" ;;
esac
count NUM_WORKERS "$NUM_WORKERS"
count NUM_PS "$NUM_PS"
count PORT "$PORT"
[ "$PORT" -le 65535 ] || die "PORT must be at most 65535; received PORT=$PORT"
case "$ROLE" in chief) TASKS=1 ;; worker) TASKS="$NUM_WORKERS" ;; ps) TASKS="$NUM_PS" ;; esac
INDEX="${HOSTNAME#"$NAME-$ROLE-"}"
case "$INDEX" in
  "$HOSTNAME" | '' | *[!0-9]* | 0?*) die "HOSTNAME must be $NAME-$ROLE-<ordinal> (the pod of a $ROLE); received HOSTNAME=$HOSTNAME" ;;
esac
[ "${#INDEX}" -le 5 ] && [ "$INDEX" -lt "$TASKS" ] ||
  die "HOSTNAME's ordinal must be below the $TASKS $ROLE task(s) TF_CONFIG lists; received HOSTNAME=$HOSTNAME"

addresses() {  # role count
  i=0; out=""
  while [ "$i" -lt "$2" ]; do
    out="$out${out:+, }\"$NAME-$1-$i.$NAME-$1:$PORT\""
    i=$((i + 1))
  done
  printf '%s' "$out"
}

TF_CONFIG=$(printf '{"cluster": {"chief": [%s], "worker": [%s], "ps": [%s]}, "task": {"type": "%s", "index": %s}}' \
  "$(addresses chief 1)" "$(addresses worker "$NUM_WORKERS")" "$(addresses ps "$NUM_PS")" "$ROLE" "$INDEX")
export TF_CONFIG
if [ "$ROLE" = "ps" ]; then
  # A ps only gathers and scatters rows: no oneDNN (its allocator pools freed memory), and big blocks
  # freed back to the OS (glibc's adaptive mmap threshold would keep them): tf_sharded.cluster.PS_ENV.
  export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1048576}"
fi
if [ "${DRY_RUN:-0}" = "1" ]; then
  printf '%s\n' "$TF_CONFIG"
  exit 0
fi
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
exec python -m tf_sharded train --strategy parameter_server ${TRAIN_ARGS:-}
