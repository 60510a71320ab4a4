#!/bin/sh
# A stand-in worker whose "tool" left a daemon and a background job behind.
#
# $1 is a directory for a fifo. Starts a setsid'ed, double-forked daemon (its
# subshell exits at once, so it is orphaned while the worker still runs) and a
# backgrounded sleep, then prints "ready <daemon pid> <background pid>" and
# behaves as TREE_MODE says:
#   wait         (default) wait for the background job (exits on SIGTERM)
#   ignore_term  the same, but SIGTERM is ignored (by everything started after)
#   exit7        read one line from stdin, then exit with status 7
set -e
[ "${TREE_MODE:-wait}" = ignore_term ] && trap '' TERM
fifo="$1/daemon.fifo"
rm -f "$fifo"
mkfifo "$fifo"
(setsid sh -c 'echo $$ > "$0"; exec sleep 300' "$fifo" </dev/null >/dev/null 2>&1 &)
read -r daemon < "$fifo"
sleep 300 </dev/null >/dev/null 2>&1 &
background=$!
echo "ready $daemon $background"
if [ "${TREE_MODE:-wait}" = exit7 ]; then
    read -r line
    exit 7
fi
while :; do wait || :; done
