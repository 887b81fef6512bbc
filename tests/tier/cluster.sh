#!/usr/bin/env bash
# A local Redis Cluster on loopback for kvrelay's shared tier (docs/TIERING.md): one command to
# start it, one to stop it. Needs redis-server and redis-cli (Debian: apt-get install
# redis-server redis-tools).
#
# Usage: tests/tier/cluster.sh start [--masters N] [--replicas R] [--port P] [--dir DIR] [--maxmemory BYTES]
#        tests/tier/cluster.sh stop  [--dir DIR]
#        tests/tier/cluster.sh nodes [--dir DIR]     (one line per node: port role)
# Defaults: 3 masters, 0 replicas, ports from 7100, state in /tmp/kvrelay-cluster. `start` prints
# the --tier value to pass to kvrelay (redis://127.0.0.1:7100,...).
set -euo pipefail
cmd=${1:-}
shift || true
masters=3 replicas=0 port=7100 dir=/tmp/kvrelay-cluster maxmemory=0
while [ $# -gt 0 ]; do
  case "$1" in
    --masters) masters=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --maxmemory) maxmemory=$2; shift 2 ;;
    *) echo "cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || { echo "cluster.sh: $tool not found (apt-get install redis-server redis-tools)" >&2; exit 1; }
done

stop() {
  [ -d "$dir" ] || return 0
  for pidfile in "$dir"/*/redis.pid; do
    [ -f "$pidfile" ] || continue
    kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  # Wait for the ports to close, at most 10 s.
  for _ in $(seq 100); do
    alive=0
    for pidfile in "$dir"/*/redis.pid; do
      [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && alive=1
    done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  rm -rf "$dir"
}

case "$cmd" in
  start)
    stop
    total=$((masters * (1 + replicas)))
    addrs=()
    for i in $(seq 0 $((total - 1))); do
      p=$((port + i))
      mkdir -p "$dir/$p"
      redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
        --cluster-config-file "$dir/$p/nodes.conf" --cluster-node-timeout 2000 \
        --appendonly no --save '' --dir "$dir/$p" --daemonize yes \
        --pidfile "$dir/$p/redis.pid" --logfile "$dir/$p/redis.log" \
        --maxmemory "$maxmemory" --maxmemory-policy allkeys-lru --enable-debug-command local >/dev/null
      addrs+=("127.0.0.1:$p")
    done
    for a in "${addrs[@]}"; do
      for _ in $(seq 100); do
        redis-cli -h 127.0.0.1 -p "${a##*:}" ping >/dev/null 2>&1 && break
        sleep 0.1
      done
    done
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas "$replicas" --cluster-yes >"$dir/create.log" 2>&1 \
      || { cat "$dir/create.log" >&2; exit 1; }
    # Ready when every node agrees the cluster is ok.
    for a in "${addrs[@]}"; do
      for _ in $(seq 200); do
        redis-cli -p "${a##*:}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' && break
        sleep 0.1
      done
    done
    tier="redis://${addrs[0]}"
    for a in "${addrs[@]:1}"; do tier="$tier,${a}"; done
    echo "$tier"
    ;;
  stop) stop ;;
  nodes)
    for d in "$dir"/*/; do
      p=$(basename "$d")
      role=$(redis-cli -p "$p" role 2>/dev/null | head -1 || echo down)
      echo "$p ${role:-down}"
    done
    ;;
  *) echo "usage: tests/tier/cluster.sh start|stop|nodes [options]" >&2; exit 2 ;;
esac
