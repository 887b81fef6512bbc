#!/usr/bin/env bash
# A local Redis Cluster on loopback for kvrelay's shared tier (docs/TIERING.md): one command to
# start it, one to stop it. Needs redis-server and redis-cli (Debian: apt-get install
# redis-server redis-tools).
#
# Usage: tests/tier/cluster.sh start [--masters N] [--replicas R] [--port P] [--dir DIR] [--maxmemory BYTES]
#                                     [--node-timeout MS]
#        tests/tier/cluster.sh stop  [--dir DIR]
#        tests/tier/cluster.sh nodes [--dir DIR]     (one line per node: port role)
#        tests/tier/cluster.sh synced [--dir DIR]    (waits until every replica has every write)
# Defaults: 3 masters, 0 replicas, ports from 7100, state in /tmp/kvrelay-cluster, a node timeout
# of 2,000 ms. `start` prints the --tier value to pass to kvrelay (redis://127.0.0.1:7100,...).
#
# With replicas, `start` returns once every replica has finished its first sync: a replica that
# never synced refuses to fail over ("Disconnected from master for longer than allowed",
# cluster-replica-validity-factor), so a master killed before then leaves its slots down and
# the cluster in cluster_state:fail for good. Replication is diskless and starts at once
# (repl-diskless-sync-delay 0; Redis 7 waits 5 s by default for more replicas to join).
set -euo pipefail
cmd=${1:-}
shift || true
masters=3 replicas=0 port=7100 dir=/tmp/kvrelay-cluster maxmemory=0 node_timeout=2000
while [ $# -gt 0 ]; do
  case "$1" in
    --masters) masters=$2; shift 2 ;;
    --replicas) replicas=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --maxmemory) maxmemory=$2; shift 2 ;;
    --node-timeout) node_timeout=$2; shift 2 ;;
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
    kill "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null || true
  done
  # Wait for the ports to close, at most 10 s.
  for _ in $(seq 100); do
    alive=0
    for pidfile in "$dir"/*/redis.pid; do
      [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null && alive=1
    done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  rm -rf "$dir"
}

# Waits (at most 20 s) until every replica's link to its master is up and it has every write
# its master has: the master's master_repl_offset is each of its replicas' offset.
synced() {
  for _ in $(seq 200); do
    lagging=0
    for d in "$dir"/*/; do
      p=$(basename "$d")
      info=$(redis-cli -p "$p" info replication 2>/dev/null | tr -d '\r') || continue
      case "$info" in
        *role:slave*)
          grep -q '^master_link_status:up' <<<"$info" || lagging=1 ;;
        *role:master*)
          offset=$(sed -n 's/^master_repl_offset://p' <<<"$info")
          while read -r line; do
            [ "${line##*offset=}" != "$line" ] || continue
            o=${line##*offset=}; o=${o%%,*}
            [ "$o" = "$offset" ] || lagging=1
          done < <(grep '^slave[0-9]*:' <<<"$info")
          ;;
      esac
    done
    [ $lagging = 0 ] && return 0
    sleep 0.1
  done
  echo "cluster.sh: replicas still not in sync after 20 s" >&2
  return 1
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
        --cluster-config-file "$dir/$p/nodes.conf" --cluster-node-timeout "$node_timeout" --repl-diskless-sync-delay 0 \
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
    [ "$replicas" = 0 ] || synced
    tier="redis://${addrs[0]}"
    for a in "${addrs[@]:1}"; do tier="$tier,${a}"; done
    echo "$tier"
    ;;
  stop) stop ;;
  synced) synced ;;
  nodes)
    for d in "$dir"/*/; do
      p=$(basename "$d")
      role=$(redis-cli -p "$p" role 2>/dev/null | head -1 || echo down)
      echo "$p ${role:-down}"
    done
    ;;
  *) echo "usage: tests/tier/cluster.sh start|stop|nodes|synced [options]" >&2; exit 2 ;;
esac
