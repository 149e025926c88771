#!/usr/bin/env bash
# Fails naming every place outside sync/ that uses absl's Mutex, MutexLock, CondVar, Notification, Condition (or their
# headers) directly: TSan cannot see their orderings in Debian's uninstrumented abseil; sync/sync.h's types it can.
set -euo pipefail
cd "$1"
pattern='absl::(Mutex|MutexLock|ReaderMutexLock|WriterMutexLock|ReleasableMutexLock|CondVar|Notification|Condition|BlockingCounter|Barrier)\b|absl/synchronization/'
if hits="$(grep -rnE "$pattern" --include='*.cc' --include='*.h' --exclude-dir='build*' --exclude-dir=.git . |
           grep -v '^\./sync/')"; then
  echo "use sync/sync.h's types instead of absl's here:" >&2
  echo "$hits" >&2
  exit 1
fi
echo "only sync/sync.h uses absl's synchronisation types"
