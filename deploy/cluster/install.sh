# deploy/cluster/install.sh: sourced by deploy/cluster/bus and deploy/cluster/haproxy.
# `ensure_bin BIN PKG` prints the path of BIN, installing the Debian package PKG
# first when BIN is missing (apt-get, with sudo unless root). A policy-rc.d that
# answers 101 keeps dpkg from starting the package's system service; a lock file
# keeps two scripts started at once (parallel tests) from running apt-get together.

find_bin() {
  command -v "$1" 2>/dev/null && return 0
  [ -x "/usr/sbin/$1" ] && { echo "/usr/sbin/$1"; return 0; }
  [ -x "/usr/bin/$1" ] && { echo "/usr/bin/$1"; return 0; }
  return 1
}

ensure_bin() {
  local bin=$1 pkg=$2 path
  path=$(find_bin "$bin") && { echo "$path"; return 0; }
  exec 9>"${TMPDIR:-/tmp}/radixgate-bus-install.lock"
  flock 9
  if ! path=$(find_bin "$bin"); then
    local sudo=
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    echo "$(basename "$0"): installing $pkg (apt-get)" >&2
    local policy=/usr/sbin/policy-rc.d added=
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
      $sudo chmod 755 "$policy"
      added=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    { $sudo apt-get install -y --no-install-recommends "$pkg" >&2 ||
        { $sudo apt-get update >&2 && $sudo apt-get install -y --no-install-recommends "$pkg" >&2; }; } ||
      { [ -z "$added" ] || $sudo rm -f "$policy"; echo "$(basename "$0"): cannot install $pkg" >&2; exec 9>&-; return 1; }
    [ -z "$added" ] || $sudo rm -f "$policy"
    path=$(find_bin "$bin") || { echo "$(basename "$0"): $bin not found after installing $pkg" >&2; exec 9>&-; return 1; }
  fi
  # The install lock is not handed on to the server the caller execs.
  exec 9>&-
  echo "$path"
}
