#!/usr/bin/env python3
"""Record, byte for byte, what capdag's RelaySwitch and a capdag master say to each other.

Everything runs in this one process, over socketpairs (AF_UNIX); nothing
leaves the machine.

    RelaySwitch  <== socketpair (tapped) ==>  RelaySlave  <== socketpair ==>  InProcessCartridgeHost
     (engine API)                              (the master)                     (identity + one cap)

The switch side of the tapped link is "switch", the RelaySlave side is
"master". Every frame either side writes on that link is recorded at the
moment it is flushed and before its bytes reach the socket, under one lock, so
the recorded order is the order the frames were sent in.

What the script drives:

1. the connect handshake, as capdag's ``RelaySwitch.__init__`` does it;
2. one request for a trivial cap (uppercase a text), through
   ``RelaySwitch.send_to_master`` / ``read_from_masters``;
3. a policy change (``RelaySwitch.set_policy``);
4. a HEARTBEAT the engine sends through the switch (the switch itself never
   originates one), to show how the master answers it.

Randomness is pinned (request UUIDs, the identity nonce, the host's pid), so
runs are repeatable as far as the frames go.

A second scenario, ``deferred``, starts the master with an EMPTY inventory
(the RelaySlave's own initial RelayNotify, as ``RelaySlave.run(initial_notify=
...)`` sends it) ahead of the host's populated one. The switch then joins the
master without an identity check and runs its runtime identity probe when the
populated RelayNotify arrives; the request follows once the caps are routable.

Output, one file per scenario, in ``tests/data/capdag/``:
``handshake_trace.json`` (scenario ``connect``) and
``handshake_trace_deferred.json`` (scenario ``deferred``). Each is an object
with ``steps`` (where each step starts in ``frames``) and ``frames``, the
ordered list of {"i", "step", "dir", "frame_type", "frame_type_name", "hex",
"fields"}.

Run with the interpreter capdag is installed in, e.g.:

    /tmp/capdag-venv/bin/python tests/capdag/trace_handshake.py            # both
    /tmp/capdag-venv/bin/python tests/capdag/trace_handshake.py deferred   # one
"""

import faulthandler
import json
import queue
import socket
import subprocess
import sys
import threading
import types
import uuid
from importlib import metadata
from pathlib import Path

import cbor2

from capdag.bifaci import in_process_host as iph
from capdag.bifaci import io as bio
from capdag.bifaci.frame import Frame, FrameType, Limits, MessageId, compute_checksum
from capdag.bifaci.io import FrameReader, FrameWriter
from capdag.bifaci.policy import HostPolicy, NetworkPolicy
from capdag.bifaci.relay import RelaySlave
from capdag.bifaci.relay_switch import RelaySwitch, SocketPair

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_vectors import CAP_URN, MEDIA_TEXT, render_frame, uppercase_cap  # noqa: E402  (ours)

REPO = Path(__file__).resolve().parents[2]
OUTS = {
    "connect": REPO / "tests" / "data" / "capdag" / "handshake_trace.json",
    "deferred": REPO / "tests" / "data" / "capdag" / "handshake_trace_deferred.json",
}



# --------------------------------------------------------------------------
# pinning capdag's randomness (for repeatable traces only)
# --------------------------------------------------------------------------

def pin_randomness():
    counter = {"n": 0}
    lock = threading.Lock()

    def fixed_uuid(cls):
        with lock:
            counter["n"] += 1
            n = counter["n"]
        return cls(uuid.UUID(int=(0xA0 << 120) | n).bytes)

    MessageId.new_uuid = classmethod(fixed_uuid)
    # The connect-time identity check draws its nonce from os.urandom in
    # capdag.bifaci.io; give that module an os whose urandom is fixed.
    bio.os = types.SimpleNamespace(urandom=lambda n: bytes(range(n)))
    # The in-process host puts its pid in the RelayNotify manifest.
    iph.os = types.SimpleNamespace(getpid=lambda: 4242)


# --------------------------------------------------------------------------
# the tap
# --------------------------------------------------------------------------

class Trace:
    def __init__(self):
        self.lock = threading.Lock()
        self.frames = []
        self.step = "setup"
        self.steps = []

    def begin(self, step):
        with self.lock:
            self.step = step
            self.steps.append({"step": step, "first_frame": len(self.frames)})


class TapWriter:
    """Stands in for a binary file a capdag FrameWriter writes to. capdag
    writes the length prefix and the body, then flushes; on flush the whole
    frames held are recorded, then written through, under the trace lock."""

    def __init__(self, raw, direction, trace):
        self.raw = raw
        self.direction = direction
        self.trace = trace
        self.pending = bytearray()

    def write(self, data):
        self.pending.extend(data)
        return len(data)

    def flush(self):
        with self.trace.lock:
            while len(self.pending) >= 4:
                n = int.from_bytes(self.pending[:4], "big")
                if len(self.pending) < 4 + n:
                    break
                wire = bytes(self.pending[: 4 + n])
                del self.pending[: 4 + n]
                frame = bio.decode_frame(wire[4:])
                self.trace.frames.append({
                    "i": len(self.trace.frames),
                    "step": self.trace.step,
                    "dir": self.direction,
                    "frame_type": int(frame.frame_type),
                    "frame_type_name": frame.frame_type.name,
                    "hex": wire.hex(),
                    "fields": render_frame(frame),
                })
                self.raw.write(wire)
            self.raw.flush()


# --------------------------------------------------------------------------
# the in-process cap
# --------------------------------------------------------------------------

class Uppercase(iph.FrameHandler):
    def handle_request(self, cap_urn, input_q, output, peer, network):
        try:
            args, _ = iph.accumulate_input(input_q)
        except ValueError as e:
            output.emit_error("BAD_INPUT", str(e))
            return
        data = b"".join(a.value for a in args)
        output.emit_response(MEDIA_TEXT, data.upper())


# --------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------

def run_thread(name, target):
    errors = []

    def body():
        try:
            target()
        except Exception as e:  # recorded, reported at the end
            errors.append(f"{name}: {type(e).__name__}: {e}")

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t, errors


def run_scenario(scenario: str) -> int:
    deferred = scenario == "deferred"
    out_path = OUTS[scenario]
    faulthandler.dump_traceback_later(60, exit=True)
    pin_randomness()
    trace = Trace()

    # switch <-> master link (tapped) and master <-> host link (not tapped)
    sw_sock, m_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    slave_local, host_local = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    host = iph.InProcessCartridgeHost(
        iph.InProcessHostIdentity.for_test("tether-trace"),
        [("uppercase", [uppercase_cap()], Uppercase())],
    )
    _, host_errors = run_thread(
        "host", lambda: host.run(host_local.makefile("rb"), host_local.makefile("wb")))

    slave = RelaySlave(FrameReader(slave_local.makefile("rb")), FrameWriter(slave_local.makefile("wb")))
    initial_notify = None
    if deferred:
        # An empty inventory first: the master joins capless.
        initial_notify = (json.dumps({"installed_cartridges": []}).encode("utf-8"), Limits.default())
    trace.begin("connect")
    _, slave_errors = run_thread(
        "slave",
        lambda: slave.run(
            FrameReader(m_sock.makefile("rb")),
            FrameWriter(TapWriter(m_sock.makefile("wb"), "master->switch", trace)),
            initial_notify,
        ),
    )

    # 1. handshake: the constructor reads RelayNotify, sends POLICY, runs the
    # identity check (only when the RelayNotify names caps), all before
    # returning.
    switch = RelaySwitch(
        [SocketPair(id="master-0",
                    read=sw_sock.makefile("rb"),
                    write=TapWriter(sw_sock.makefile("wb"), "switch->master", trace))],
        HostPolicy(NetworkPolicy.NO_TELEMETRY),
    )

    responses: "queue.Queue" = queue.Queue()

    def pump():
        while True:
            f = switch.read_from_masters()
            responses.put(f)
            if f is None:
                return

    run_thread("engine-reader", pump)

    def await_frame(pred, what, timeout=10.0):
        while True:
            try:
                f = responses.get(timeout=timeout)
            except queue.Empty:
                raise SystemExit(f"timed out waiting for {what}")
            if f is None:
                raise SystemExit(f"switch closed while waiting for {what}")
            if pred(f):
                return f

    if deferred:
        # The populated RelayNotify reaches the switch's reader; the switch
        # holds the caps back until its runtime identity probe succeeds.
        deadline = threading.Event()
        for _ in range(200):
            if CAP_URN in json.loads(switch.routable_capabilities()):
                break
            deadline.wait(0.05)
        else:
            raise SystemExit("the caps never became routable")

    # 2. one request
    trace.begin("request")
    rid = MessageId(bytes.fromhex("0123456789abcdef0123456789abcdef"))
    arg = cbor2.dumps(b"hello, tether")
    switch.send_to_master(Frame.req(rid, CAP_URN, b"", "application/cbor"))
    switch.send_to_master(Frame.stream_start(rid, "arg-0", MEDIA_TEXT, False))
    switch.send_to_master(Frame.chunk(rid, "arg-0", 0, arg, 0, compute_checksum(arg)))
    switch.send_to_master(Frame.stream_end(rid, "arg-0", 1))
    switch.send_to_master(Frame.end(rid))
    answer = bytearray()
    while True:
        f = await_frame(lambda f: f.id == rid, "the answer")
        if f.frame_type == FrameType.CHUNK:
            answer.extend(cbor2.loads(f.payload))
        if f.frame_type in (FrameType.END, FrameType.ERR):
            break
    if f.frame_type != FrameType.END or bytes(answer) != b"HELLO, TETHER":
        raise SystemExit(f"unexpected answer: {f.frame_type.name} {bytes(answer)!r}")

    # 3. a policy change
    trace.begin("set_policy")
    switch.set_policy(HostPolicy(NetworkPolicy.OFFLINE))

    # 4. an engine heartbeat through the switch
    trace.begin("engine_heartbeat")
    hb = MessageId(bytes.fromhex("00112233445566778899aabbccddeeff"))
    switch.send_to_master(Frame.heartbeat(hb))
    await_frame(lambda f: f.frame_type == FrameType.HEARTBEAT and f.id == hb, "the heartbeat reply")

    # Let anything still in flight land, then close the link.
    threading.Event().wait(0.3)
    trace.begin("close")
    sw_sock.shutdown(socket.SHUT_RDWR)
    threading.Event().wait(0.3)

    with trace.lock:
        frames = list(trace.frames)
        steps = list(trace.steps)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "capdag_version": metadata.version("capdag"),
        "scenario": scenario,
        "link": "RelaySwitch (switch) <-> RelaySlave in front of an InProcessCartridgeHost (master)",
        "steps": steps,
        "frames": frames,
    }, indent=1) + "\n")

    for fr in frames:
        print(f'{fr["i"]:3} {fr["step"]:17} {fr["dir"]:15} {fr["frame_type_name"]:13} '
              f'{len(fr["hex"]) // 2:5} bytes', file=sys.stderr)
    # Errors after the close are the expected end of the link; earlier ones
    # would have failed a step above.
    for e in slave_errors + host_errors:
        print(f"(after close) {e}", file=sys.stderr)
    print(f"wrote {len(frames)} frames to {out_path}", file=sys.stderr)
    return 0


def main(argv) -> int:
    if len(argv) == 1:
        if argv[0] not in OUTS:
            raise SystemExit(f"unknown scenario {argv[0]!r}; one of {sorted(OUTS)}")
        return run_scenario(argv[0])
    # Each scenario in its own process: capdag's threads and the pinned
    # randomness start fresh.
    for scenario in OUTS:
        rc = subprocess.call([sys.executable, __file__, scenario])
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
