#!/bin/sh
# Builds this pod's TF_CONFIG from its role and StatefulSet ordinal, then runs the training application.
#   ROLE         chief | worker | ps
#   NAME         job name prefix (default ctr); pods are $NAME-$ROLE-<i> behind headless services $NAME-$ROLE
#   NUM_WORKERS, NUM_PS, PORT (defaults 2, 2, 2222)
#   TRAIN_ARGS   extra flags for `python -m tf_sharded train`
#   DRY_RUN=1    print TF_CONFIG and exit (used by the tests)
set -eu
NAME="${NAME:-ctr}"
PORT="${PORT:-2222}"
NUM_WORKERS="${NUM_WORKERS:-2}"
NUM_PS="${NUM_PS:-2}"
INDEX="${HOSTNAME##*-}"

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
