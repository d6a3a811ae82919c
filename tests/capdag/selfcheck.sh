#!/usr/bin/env bash
# Self-check of tests/capdag/master.py and tests/capdag/switch.py against each
# other: capdag's RelaySwitch (switch.py) driving capdag masters (master.py)
# over Unix sockets in a temp dir. No network, no Rust.
#
#   tests/capdag/selfcheck.sh        # CAPDAG_PYTHON overrides the interpreter
#
# Exits non-zero on the first failed check; always kills what it started and
# removes its temp dir.
set -euo pipefail

PY="${CAPDAG_PYTHON:-/tmp/capdag-venv/bin/python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MASTER="$HERE/master.py"
SWITCH="$HERE/switch.py"
D="$(mktemp -d "${TMPDIR:-/tmp}/capdag-selfcheck.XXXXXX")"
PIDS=()

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$D"
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { "$PY" -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$(now)"; }

# start_master NAME [ARGS...]: runs master.py --listen $D/NAME.sock in the
# background, waits for its "ready" line; sets MPID.
start_master() {
    local name="$1"; shift
    "$PY" "$MASTER" --listen "$D/$name.sock" "$@" >"$D/$name.out" 2>>"$D/$name.err" &
    MPID=$!
    PIDS+=("$MPID")
    for _ in $(seq 1 200); do
        if grep -qx "ready $D/$name.sock" "$D/$name.out" 2>/dev/null; then return 0; fi
        kill -0 "$MPID" 2>/dev/null || fail "master $name exited before it was ready: $(cat "$D/$name.err")"
        sleep 0.05
    done
    fail "master $name not ready within 10 s"
}

URNS="$("$PY" "$MASTER" --list-caps)"
[ "$(echo "$URNS" | wc -l)" -eq 5 ] || fail "--list-caps did not print 5 URNs"
UPPER="$(echo "$URNS" | sed -n 1p)"; COUNT="$(echo "$URNS" | sed -n 2p)"
SHOUT="$(echo "$URNS" | sed -n 3p)"; SLEEP="$(echo "$URNS" | sed -n 4p)"
TAGGED="$(echo "$URNS" | sed -n 5p)"
export UPPER COUNT SHOUT SLEEP TAGGED
echo "caps: $UPPER | $COUNT | $SHOUT | $SLEEP"

# check OUTFILE PYTHON-ASSERTIONS: the assertions see `steps` (list of the
# step lines, by index) and `done` (the final line).
check() {
    local out="$1" code="$2"
    "$PY" - "$out" <<EOF || fail "checks on $(basename "$out") failed (output in the lines above)"
import json, os, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [l for l in lines if "step" in l]
done = lines[-1]
assert done.get("done") is True, "no done line"
UPPER, COUNT, SHOUT, SLEEP, TAGGED = (os.environ[k] for k in ("UPPER", "COUNT", "SHOUT", "SLEEP", "TAGGED"))
def lines_of(n): return "".join(f"line {i}\n" for i in range(n))
try:
$(echo "$code" | sed 's/^/    /')
except AssertionError as e:
    for l in lines: print(json.dumps(l)[:300], file=sys.stderr)
    print("assertion failed:", e, file=sys.stderr)
    sys.exit(1)
EOF
}

T_ALL=$(now)

# ---------------------------------------------------------------- 1. every cap
T=$(now)
start_master a
"$PY" - >"$D/script1.json" <<'EOF'
import json, os
U, C, S, Z = (os.environ[k] for k in ("UPPER", "COUNT", "SHOUT", "SLEEP"))
print(json.dumps([
    {"call": U, "input": "hello, tether"},
    {"call": C, "input": "100", "expect_chunks": True},
    {"call": C, "input": "5000"},
    {"call": S, "input": "hey"},
    {"cancel_after_first_chunk": Z, "input": "x"},
    {"stop_feeds": U, "input": "x"},
    {"set_policy": "offline"},
    {"call": U, "input": "after policy"},
    {"heartbeat": True},
    {"call": "cap:effect=none", "input": "nonce"},
    {"call": Z, "input": "0.2"},
    {"call": 'cap:in="media:enc=utf-8;text";op=nothing;out="media:enc=utf-8;text"', "input": "x"},
    {"call": C, "input": "not a number"},
]))
EOF
"$PY" "$SWITCH" --master "unix:$D/a.sock" "$D/script1.json" >"$D/run1.out" 2>"$D/run1.err" \
    || fail "switch.py run 1 exited $? ($(tail -3 "$D/run1.err"))"
check "$D/run1.out" '
assert len(steps) == 13, len(steps)
s = steps[0]; assert s["ok"] and s["body"] == "HELLO, TETHER" and s["chunks"] == 1 and s["source"] == "frame", s
s = steps[1]; assert s["ok"] and s["chunks"] == 100 and s["body"] == lines_of(100) and s["chunk_texts"][99] == "line 99\n", s["chunks"]
s = steps[2]; assert s["ok"] and s["chunks"] == 5000 and s["body"] == lines_of(5000), s["chunks"]
s = steps[3]; assert s["ok"] and s["body"] == "HEY!", s
s = steps[4]; assert not s["ok"] and s["body"] == "started" and s["err_code"] == "CANCELLED" and s["attribution_class"] == "user" and s["terminal_kind"] == "cancelled" and s["source"] == "switch_table" and s["cancel_sent"] and s["stragglers"] == {"err": 1}, s
s = steps[5]; assert s["ok"] and s["stop_sent"] and s["ended_by"] == "input_end" and s["body"] == "X", s
s = steps[6]; assert s["ok"], s
s = steps[7]; assert s["ok"] and s["body"] == "AFTER POLICY", s
s = steps[8]; assert s["ok"] and s["pools"], s
s = steps[9]; assert s["ok"] and s["body"] == "nonce", s
s = steps[10]; assert s["ok"] and s["body"] == "starteddone" and s["chunks"] == 2, s
s = steps[11]; assert not s["ok"] and s["err_code"] == "NO_HANDLER" and s["source"] == "send_error", s
s = steps[12]; assert not s["ok"] and s["err_code"] == "BAD_INPUT" and s["source"] == "frame" and s["attribution_class"] == "internal", s
assert done["timeouts"] == 0 and done["healthy"] == [True] and done["masters"][0] == ["cap:effect=none", UPPER, COUNT, SHOUT, SLEEP, TAGGED], done
'
grep -q "sleep: cancelled" "$D/a.err" || fail "the sleep handler never saw its cancel"
echo "ok 1: every cap, N=100 and N=5000 streamed, peer call, cancel, stop_feeds, policy, heartbeat ($(since "$T") s)"

# ------------------------------------- 2. the same master serves a second switch
T=$(now)
echo '[{"call": "'"${UPPER//\"/\\\"}"'", "input": "second connection"}]' >"$D/script2.json"
"$PY" "$SWITCH" --master "unix:$D/a.sock" "$D/script2.json" >"$D/run2.out" 2>"$D/run2.err" \
    || fail "switch.py run 2 exited $?"
check "$D/run2.out" 'assert steps[0]["ok"] and steps[0]["body"] == "SECOND CONNECTION", steps[0]'
echo "ok 2: a new switch connection to the same master.py ($(since "$T") s)"

# ---------------- 3. kill -9 the master mid-request, restart it, reattach the slot
T=$(now)
"$PY" - >"$D/script3.json" <<'EOF'
import json, os
U, C, S, Z = (os.environ[k] for k in ("UPPER", "COUNT", "SHOUT", "SLEEP"))
print(json.dumps([
    {"call": Z, "input": "x"},
    {"call": U, "input": "nobody"},
    {"reattach": 0},
    {"call": U, "input": "again"},
    {"call": C, "input": "100"},
    {"call": S, "input": "back"},
]))
EOF
: >"$D/a.err"
"$PY" "$SWITCH" --master "unix:$D/a.sock" "$D/script3.json" >"$D/run3.out" 2>"$D/run3.err" &
SPID=$!
PIDS+=("$SPID")
for _ in $(seq 1 200); do
    grep -q "sleep: started" "$D/a.err" && break
    sleep 0.05
done
grep -q "sleep: started" "$D/a.err" || fail "the sleep request never started"
kill -9 "$MPID"
wait "$MPID" 2>/dev/null || true
T_KILL=$(now)
sleep 0.5
start_master a
set +e
wait "$SPID"; RC=$?
set -e
[ "$RC" -eq 0 ] || fail "switch.py run 3 exited $RC ($(tail -3 "$D/run3.err"))"
check "$D/run3.out" '
s = steps[0]; assert not s["ok"] and s["body"] == "started" and s["err_code"] == "MASTER_DIED" and s["attribution_class"] == "environment" and s["terminal_kind"] == "master_died" and s["source"] == "switch_table" and s.get("masters_closed") is True, s
s = steps[1]; assert not s["ok"] and s["err_code"] == "NO_HANDLER" and s["source"] == "send_error", s
s = steps[2]; assert s["ok"] and s["master"] == 0 and UPPER in s["caps"], s
s = steps[3]; assert s["ok"] and s["body"] == "AGAIN", s
s = steps[4]; assert s["ok"] and s["chunks"] == 100 and s["body"] == lines_of(100), s["chunks"]
s = steps[5]; assert s["ok"] and s["body"] == "BACK!", s
assert done["healthy"] == [True] and done["timeouts"] == 0, done
'
echo "ok 3: kill -9 mid-request -> MASTER_DIED, then NO_HANDLER; restarted master reattached ($(since "$T") s; $(since "$T_KILL") s after the kill)"

# ------------------------------------------------- 4. two masters, one switch
T=$(now)
start_master b
echo '[{"call": "'"${SHOUT//\"/\\\"}"'", "input": "two"}, {"call": "'"${COUNT//\"/\\\"}"'", "input": "40"}]' >"$D/script4.json"
"$PY" "$SWITCH" --master "unix:$D/a.sock" --master "unix:$D/b.sock" --policy full "$D/script4.json" \
    >"$D/run4.out" 2>"$D/run4.err" || fail "switch.py run 4 exited $?"
check "$D/run4.out" '
assert steps[0]["ok"] and steps[0]["body"] == "TWO!", steps[0]
assert steps[1]["ok"] and steps[1]["chunks"] == 40, steps[1]
assert len(done["masters"]) == 2 and done["healthy"] == [True, True], done
'
echo "ok 4: two masters behind one switch ($(since "$T") s)"

# ----------------------------------------- 4b. a step deadline -> TIMEOUT, exit 1
T=$(now)
echo '[{"call": "'"${SLEEP//\"/\\\"}"'", "input": "5", "timeout_s": 1}, {"call": "cap:effect=none", "input": "alive"}]' >"$D/script4b.json"
set +e
"$PY" "$SWITCH" --master "unix:$D/b.sock" "$D/script4b.json" >"$D/run4b.out" 2>"$D/run4b.err"
RC=$?
set -e
[ "$RC" -eq 1 ] || fail "switch.py with a timed-out step exited $RC, not 1"
check "$D/run4b.out" '
s = steps[0]; assert not s["ok"] and s["err_code"] == "TIMEOUT" and s["source"] == "timeout" and s["body"] == "started" and s["cancelled_after_timeout"], s
assert steps[1]["ok"] and steps[1]["body"] == "alive", steps[1]
assert done["timeouts"] == 1, done
'
echo "ok 4b: a step past its deadline -> TIMEOUT, request cancelled, exit 1 ($(since "$T") s)"

# ------------------------------------------------------------------ 5. --once
T=$(now)
start_master c --once
CPID=$MPID
"$PY" "$SWITCH" --master "unix:$D/c.sock" "$D/script2.json" >"$D/run5.out" 2>"$D/run5.err" \
    || fail "switch.py run 5 exited $?"
for _ in $(seq 1 100); do kill -0 "$CPID" 2>/dev/null || break; sleep 0.05; done
kill -0 "$CPID" 2>/dev/null && fail "master.py --once still running after its connection ended"
set +e; wait "$CPID"; RC=$?; set -e
[ "$RC" -eq 0 ] || fail "master.py --once exited $RC"
[ ! -e "$D/c.sock" ] || fail "master.py --once left its socket behind"
echo "ok 5: master.py --once exits 0 after its connection ($(since "$T") s)"

# ------------------------------------------------------ 6. connect failure -> 2
T=$(now)
set +e
"$PY" "$SWITCH" --master "unix:$D/nobody.sock" --connect-timeout 0.5 "$D/script2.json" >"$D/run6.out" 2>"$D/run6.err"
RC=$?
set -e
[ "$RC" -eq 2 ] || fail "switch.py against no master exited $RC, not 2"
[ ! -s "$D/run6.out" ] || fail "switch.py wrote to stdout although it could not connect"
echo "ok 6: no master -> exit 2: $(cat "$D/run6.err") ($(since "$T") s)"

# ------------------------------------------------------- 7. SIGTERM -> exit 0
start_master d
DPID=$MPID
kill -TERM "$DPID"
set +e; wait "$DPID"; RC=$?; set -e
[ "$RC" -eq 0 ] || fail "master.py exited $RC on SIGTERM"
[ ! -e "$D/d.sock" ] || fail "master.py left its socket behind on SIGTERM"
echo "ok 7: master.py exits 0 on SIGTERM and unlinks its socket"

echo "selfcheck passed in $(since "$T_ALL") s"
