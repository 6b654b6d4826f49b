#!/usr/bin/env bash
# Prints this host's network tuning next to tuning/'s recommendations, and where a
# running radixgate's shard threads are. Reads only; changes nothing.
#
#   tuning/check.sh                 # sysctls, limits, io_uring, IRQs/RPS/XPS, CPUs
#   tuning/check.sh --pid PID       # also that radixgate's shard threads and limits
#   NIC=eth0 tuning/check.sh        # the NIC to show (default: the default route's)
#
# Output columns for sysctls: name, current, recommended, and `ok` / `LOW` / `differs`
# (`LOW` where a larger value is the recommendation; `differs` otherwise).
set -uo pipefail
cd "$(dirname "$0")"
PID=""
while [ $# -gt 0 ]; do
  case $1 in
  --pid) PID=$2; shift 2 ;;
  -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
  *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

section() { printf '\n== %s\n' "$*"; }

section "sysctl (recommended: sysctl-front-host.conf)"
printf '%-36s %-24s %-24s %s\n' name current recommended verdict
# "larger is better" for these (a host that already has more keeps it).
AT_LEAST=" net.core.somaxconn net.ipv4.tcp_max_syn_backlog net.core.netdev_max_backlog net.core.rmem_max net.core.wmem_max fs.file-max fs.nr_open "
grep -Ev '^\s*(#|$)' sysctl-front-host.conf | while IFS='=' read -r name want; do
  name=$(echo "$name" | xargs)
  want=$(echo "$want" | xargs)
  have=$(sysctl -n "$name" 2>/dev/null | xargs)
  if [ -z "$have" ]; then
    verdict="absent on this kernel"
  elif [ "$have" = "$want" ]; then
    verdict=ok
  elif [[ $AT_LEAST == *" $name "* ]] && [ "$have" -ge "$want" ] 2>/dev/null; then
    verdict="ok (higher)"
  elif [[ $AT_LEAST == *" $name "* ]]; then
    verdict=LOW
  elif [[ $name == net.ipv4.tcp_[rw]mem ]]; then
    # min default max: each at least the recommendation.
    verdict=$(awk -v h="$have" -v w="$want" 'BEGIN {n = split(h, a); split(w, b); v = "ok (higher)"
      for (i = 1; i <= n; i++) if (a[i] + 0 < b[i] + 0) v = "LOW"; print v}')
  else
    verdict=differs
  fi
  printf '%-36s %-24s %-24s %s\n' "$name" "${have:-–}" "$want" "$verdict"
done
for name in net.core.busy_poll net.core.busy_read net.core.rps_sock_flow_entries; do
  printf '%-36s %-24s %-24s %s\n' "$name" "$(sysctl -n "$name" 2>/dev/null || echo –)" \
    "see README" "(optional)"
done

section "io_uring"
if [ -r /proc/sys/kernel/io_uring_disabled ]; then
  v=$(cat /proc/sys/kernel/io_uring_disabled)
  case $v in
  0) echo "kernel.io_uring_disabled = 0: io_uring allowed (io = \"auto\" uses it)" ;;
  1) echo "kernel.io_uring_disabled = 1: only processes in kernel.io_uring_group may use io_uring; others fall back to epoll" ;;
  *) echo "kernel.io_uring_disabled = $v: io_uring off; shards use the epoll driver" ;;
  esac
else
  echo "no kernel.io_uring_disabled (kernel < 6.6): io_uring allowed if the kernel has it"
fi

section "limits (recommended: LimitNOFILE=1048576, LimitMEMLOCK=infinity, as deploy/systemd)"
echo "this shell: nofile soft $(ulimit -Sn) hard $(ulimit -Hn); memlock soft $(ulimit -Sl) hard $(ulimit -Hl)"
if [ -n "$PID" ] && [ -r "/proc/$PID/limits" ]; then
  grep -E 'Max open files|Max locked memory' "/proc/$PID/limits" | sed "s/^/pid $PID: /"
  echo "pid $PID: $(find "/proc/$PID/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l) open fds"
fi

section "CPUs"
echo "online: $(cat /sys/devices/system/cpu/online 2>/dev/null)  isolated: $(cat /sys/devices/system/cpu/isolated 2>/dev/null || true)"
for c in /sys/devices/system/cpu/cpu[0-9]*; do
  n=${c##*cpu}
  sib=$(cat "$c/topology/thread_siblings_list" 2>/dev/null || echo "?")
  node=$(basename "$(ls -d "$c"/node* 2>/dev/null | head -1)" 2>/dev/null || true)
  gov=$(cat "$c/cpufreq/scaling_governor" 2>/dev/null || echo "–")
  printf 'cpu%-4s siblings %-8s %-6s governor %s\n' "$n" "$sib" "${node:-node?}" "$gov"
done | sort -V
if command -v systemctl >/dev/null && systemctl is-active --quiet irqbalance 2>/dev/null; then
  echo "irqbalance: running (it moves IRQs onto shard cores unless told not to: README, IRQ affinity)"
else
  echo "irqbalance: not running"
fi

section "NIC queues, IRQ affinity, RPS/XPS"
NIC=${NIC:-$(ip route show default 2>/dev/null | awk '{for (i=1;i<NF;i++) if ($i=="dev") {print $(i+1); exit}}')}
if [ -z "$NIC" ] || [ ! -d "/sys/class/net/$NIC" ]; then
  echo "no NIC found (set NIC=...); loopback-only hosts have no NIC interrupts"
else
  echo "$NIC: numa_node $(cat "/sys/class/net/$NIC/device/numa_node" 2>/dev/null || echo –)," \
    "rx queues $(ls -d /sys/class/net/"$NIC"/queues/rx-* 2>/dev/null | wc -l)," \
    "tx queues $(ls -d /sys/class/net/"$NIC"/queues/tx-* 2>/dev/null | wc -l)"
  irqs=$(grep -E "$NIC|virtio[0-9]+-(input|output)\.[0-9]+" /proc/interrupts | cut -d: -f1 | xargs)
  for irq in $irqs; do
    printf 'irq %-5s -> cpus %-10s %s\n' "$irq" "$(cat "/proc/irq/$irq/smp_affinity_list" 2>/dev/null)" \
      "$(grep -E "^ *$irq:" /proc/interrupts | awk '{print $NF}')"
  done
  for q in /sys/class/net/"$NIC"/queues/rx-*; do
    printf '%-6s rps_cpus %-10s rps_flow_cnt %s\n' "${q##*/}" "$(cat "$q/rps_cpus" 2>/dev/null)" \
      "$(cat "$q/rps_flow_cnt" 2>/dev/null)"
  done
  for q in /sys/class/net/"$NIC"/queues/tx-*; do
    printf '%-6s xps_cpus %s\n' "${q##*/}" "$(cat "$q/xps_cpus" 2>/dev/null || echo –)"
  done
fi

if [ -n "$PID" ]; then
  section "radixgate pid $PID: threads (name, tid, allowed CPUs, last CPU, CPU seconds)"
  hz=$(getconf CLK_TCK)
  for t in /proc/"$PID"/task/*; do
    name=$(cat "$t/comm" 2>/dev/null) || continue
    allowed=$(awk '/^Cpus_allowed_list/ {print $2}' "$t/status")
    stat=$(cat "$t/stat")
    set -- ${stat##*) }
    # After the name: state is field 3; utime 14, stime 15, processor 39.
    printf '%-20s tid %-8s allowed %-10s last cpu %-4s cpu %.2fs\n' "$name" "${t##*/}" "$allowed" \
      "${37}" "$(awk -v u="${12}" -v s="${13}" -v hz="$hz" 'BEGIN {print (u + s) / hz}')"
  done | sort
  echo "(the admin API has the same per shard, with live counters: GET /admin/shards)"
fi
