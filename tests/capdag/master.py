#!/usr/bin/env python3
"""A capdag master listening on a Unix socket, for tether's interop tests.

Each accepted connection gets what capdag calls a master: a ``RelaySlave``
whose socket side is the connection, in front of an
``InProcessCartridgeHost`` reached over a socketpair (the wiring of
``trace_handshake.py``). Every frame on the connection is written by capdag's
own classes; this file builds no protocol frame of the switch link itself.

The master speaks first: the host's RELAY_NOTIFY, forwarded by the slave.
The switch then sends POLICY and runs its identity check (``cap:effect=none``,
served by the host's built-in identity handler).

Caps served, besides ``cap:effect=none`` (exact canonical URNs, as
``--list-caps`` prints them):

    cap:in="media:enc=utf-8;text";op=uppercase;out="media:enc=utf-8;text"
        the whole input, uppercased (ASCII letters only: bytes.upper(), as in
        trace_handshake.py) (ResponseWriter.emit_response: one stream
        "result", each CHUNK a CBOR byte string).
    cap:in="media:enc=utf-8;text";op=count;out="media:enc=utf-8;text"
        input: a decimal N (0..1000000). Answer: one stream "result" with N
        CHUNKs, CHUNK i (chunk_index i, from 0) carrying the CBOR byte string
        "line i\\n", then STREAM_END (chunk_count N) and END.
    cap:in="media:enc=utf-8;text";op=shout;out="media:enc=utf-8;text"
        peer-calls the uppercase cap (through the switch) with its input and
        answers the peer's answer followed by "!".
    cap:in="media:enc=utf-8;text";op=sleep;out="media:enc=utf-8;text"
        sends CHUNK "started", waits (30 s; or the input's number of seconds
        when the input is a number below 30), then CHUNK "done", STREAM_END,
        END. Stops early when the request is cancelled or the connection ends.
    cap:in="media:enc=utf-8;text";op=tagged;out="media:enc=utf-8;text";x
        uppercase again, under a cap with a wildcard tag x (written x=*):
        capdag's matcher does not take it as serving a request for x=v, the
        seed's truth table (tether's) does (docs/spec/switch.md §4.6).

Usage:

    master.py --listen PATH [--once]   # prints "ready PATH" once listening
    master.py --list-caps

Connections are served one after another (a new one after the previous ended
is a reattach) until the process is killed (SIGTERM/SIGINT: unlink PATH, exit
0); with ``--once`` it exits 0 when the first connection ends. Everything but
the "ready" line goes to stderr.

Two things the handler API of capdag 1.524.58 does not offer, and how this file
gets them (both marked "NOT PUBLIC API" below):

- A peer call sends only the REQ (``PeerInvoker.call`` returns the response
  queue, not the request id, and has no way to send the argument stream). The
  shout handler finds its peer request id in the invoker's pending map and
  puts STREAM_START / CHUNK / STREAM_END / END on the host's write queue, the
  queue the invoker itself writes the REQ to.
- A handler learns of a CANCEL only while its input is still open (the host
  closes the input queue); once its END was read, nothing tells it. master.py
  watches the frames the RelaySlave hands to the host and flags CANCELs by
  request id, and the sleep handler polls that flag (and a per-connection
  "closed" event). What goes on the wire does not change: the host answers
  the CANCEL with its ERR itself, and anything a handler emits after that is
  suppressed by the host's writer gate.
"""

import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time

import cbor2

from capdag.bifaci import in_process_host as iph
from capdag.bifaci.frame import Frame, FrameType, MessageId, compute_checksum
from capdag.bifaci.io import FrameReader, FrameWriter
from capdag.bifaci.relay import RelaySlave
from capdag.cap.definition import Cap, CapArg, CapOutput, StdinSource
from capdag.urn.cap_urn import CapUrn

MEDIA_TEXT = "media:enc=utf-8;text"


def _urn(op: str) -> str:
    return CapUrn.from_string(f'cap:in="{MEDIA_TEXT}";op={op};out="{MEDIA_TEXT}"').to_string()


UPPER_URN = _urn("uppercase")
COUNT_URN = _urn("count")
SHOUT_URN = _urn("shout")
SLEEP_URN = _urn("sleep")
# Uppercase again, under a cap whose `x=*` tag capdag's matcher does not take as serving a
# request for one value of x (`x=v`), while the seed's truth table, which tether keeps, does:
# a request tether routes here is declined by this host (docs/spec/switch.md §4.6).
TAGGED_URN = CapUrn.from_string(f'cap:in="{MEDIA_TEXT}";op=tagged;out="{MEDIA_TEXT}";x=*').to_string()
ALL_URNS = [UPPER_URN, COUNT_URN, SHOUT_URN, SLEEP_URN, TAGGED_URN]

MAX_COUNT = 1_000_000
SLEEP_MAX_S = 30.0
PEER_TIMEOUT_S = 20.0


def log(msg: str) -> None:
    print(f"[master {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def text_cap(urn: str, title: str, alias: str, out_desc: str) -> Cap:
    cap = Cap(CapUrn.from_string(urn), title, [alias])
    cap.add_arg(CapArg(media_urn=MEDIA_TEXT, name="input", required=True,
                       sources=[StdinSource(MEDIA_TEXT)]))
    cap.add_output(CapOutput(MEDIA_TEXT, "output", out_desc))
    return cap


def input_text(input_q) -> bytes:
    """The request's input (all argument streams, CBOR-decoded, joined)."""
    args, _ = iph.accumulate_input(input_q)
    return b"".join(a.value for a in args)


def cbor_chunk(stream_id: str, index: int, data: bytes) -> Frame:
    """A response CHUNK as capdag's ResponseWriter builds one: the payload is
    the CBOR byte string, the checksum covers those bytes."""
    payload = cbor2.dumps(data)
    return Frame.chunk(MessageId(0), stream_id, 0, payload, index, compute_checksum(payload))


class Connection:
    """What handlers of one connection share: its end, and the CANCELs seen."""

    def __init__(self):
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._cancelled = set()

    def note_cancel(self, rid: MessageId) -> None:
        with self._lock:
            self._cancelled.add(rid)

    def is_cancelled(self, rid: MessageId) -> bool:
        with self._lock:
            return rid in self._cancelled


class Handler(iph.FrameHandler):
    """Common error handling: a handler that raises answers an ERR."""

    name = "handler"

    def __init__(self, conn: Connection):
        self.conn = conn

    def handle_request(self, cap_urn, input_q, output, peer, network):
        try:
            self.handle(cap_urn, input_q, output, peer)
        except ValueError as e:
            # accumulate_input: bad CBOR, or input that never reached its END
            # (cancelled / connection closed). Nothing sensible to answer in
            # the second case; the host's writer drops it if it is post-terminal.
            log(f"{self.name}: input refused: {e}")
            output.emit_error("BAD_INPUT", str(e))
        except Exception as e:  # never leave a request unanswered
            log(f"{self.name}: {type(e).__name__}: {e}")
            output.emit_error("HANDLER_FAILED", f"{type(e).__name__}: {e}")

    def handle(self, cap_urn, input_q, output, peer):
        raise NotImplementedError


class Uppercase(Handler):
    name = "uppercase"

    def handle(self, cap_urn, input_q, output, peer):
        data = input_text(input_q)
        output.emit_response(MEDIA_TEXT, data.upper())


class Count(Handler):
    name = "count"

    def handle(self, cap_urn, input_q, output, peer):
        raw = input_text(input_q)
        try:
            n = int(raw.decode("utf-8").strip())
        except (UnicodeDecodeError, ValueError):
            output.emit_error("BAD_INPUT", f"count: input is not a decimal number: {raw[:40]!r}")
            return
        if not 0 <= n <= MAX_COUNT:
            output.emit_error("BAD_INPUT", f"count: N must be in 0..{MAX_COUNT}, got {n}")
            return
        output.send(Frame.stream_start(MessageId(0), "result", MEDIA_TEXT))
        for i in range(n):
            output.send(cbor_chunk("result", i, f"line {i}\n".encode()))
        output.send(Frame.stream_end(MessageId(0), "result", n))
        output.send(Frame.end_ok(MessageId(0), None))


class Shout(Handler):
    name = "shout"

    def handle(self, cap_urn, input_q, output, peer):
        data = input_text(input_q)
        rx = peer.call(UPPER_URN)
        # NOT PUBLIC API: PeerInvoker.call sends the REQ only and keeps the
        # request id to itself; find it in its pending map, then send the
        # argument stream on the same write queue the REQ went out on.
        peer_rid = None
        with peer._pending_lock:
            for rid, pending in peer._pending.items():
                if pending.sender is rx:
                    peer_rid = rid
                    break
        if peer_rid is None:
            output.emit_error("PEER_FAILED", "shout: the peer request is not pending")
            return
        payload = cbor2.dumps(data)
        for f in (
            Frame.stream_start(peer_rid, "arg-0", MEDIA_TEXT, False),
            Frame.chunk(peer_rid, "arg-0", 0, payload, 0, compute_checksum(payload)),
            Frame.stream_end(peer_rid, "arg-0", 1),
            Frame.end(peer_rid, None),
        ):
            peer._write_tx.put(f)

        answer = bytearray()
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                output.emit_error("PEER_TIMEOUT", f"shout: no answer from {UPPER_URN} in {PEER_TIMEOUT_S:g} s")
                return
            if self.conn.closed.is_set():
                return
            try:
                f = rx.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if f.frame_type == FrameType.CHUNK:
                value = cbor2.loads(f.payload or b"")
                answer.extend(value.encode("utf-8") if isinstance(value, str) else bytes(value))
            elif f.frame_type == FrameType.END:
                break
            elif f.frame_type == FrameType.ERR:
                output.emit_error("PEER_FAILED", f"shout: peer call failed: {f.error_code()}: {f.error_message()}")
                return
        output.emit_response(MEDIA_TEXT, bytes(answer) + b"!")


class Sleep(Handler):
    name = "sleep"

    def handle(self, cap_urn, input_q, output, peer):
        raw = input_text(input_q)
        try:
            seconds = min(max(float(raw.decode("utf-8").strip()), 0.0), SLEEP_MAX_S)
        except (UnicodeDecodeError, ValueError):
            seconds = SLEEP_MAX_S
        rid = output._request_id  # NOT PUBLIC API: the handler's own request id
        output.send(Frame.stream_start(MessageId(0), "result", MEDIA_TEXT))
        output.send(cbor_chunk("result", 0, b"started"))
        log(f"sleep: started rid={rid.to_string()} for {seconds:g} s")
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if self.conn.is_cancelled(rid):
                log(f"sleep: cancelled rid={rid.to_string()} after {time.monotonic() - start:.2f} s")
                return
            if self.conn.closed.wait(0.05):
                log(f"sleep: connection closed, rid={rid.to_string()} abandoned")
                return
        output.send(cbor_chunk("result", 1, b"done"))
        output.send(Frame.stream_end(MessageId(0), "result", 2))
        output.send(Frame.end_ok(MessageId(0), None))
        log(f"sleep: done rid={rid.to_string()}")


def build_host(conn: Connection) -> iph.InProcessCartridgeHost:
    return iph.InProcessCartridgeHost(
        iph.InProcessHostIdentity.for_test("tether-capdag-master"),
        [
            ("uppercase", [text_cap(UPPER_URN, "Uppercase", "tether-uppercase", "The text, uppercased")], Uppercase(conn)),
            ("count", [text_cap(COUNT_URN, "Count", "tether-count", "N lines, one chunk each")], Count(conn)),
            ("shout", [text_cap(SHOUT_URN, "Shout", "tether-shout", "The text, uppercased by a peer call, then !")], Shout(conn)),
            ("sleep", [text_cap(SLEEP_URN, "Sleep", "tether-sleep", "started, then done")], Sleep(conn)),
            ("tagged", [text_cap(TAGGED_URN, "Tagged", "tether-tagged", "The text, uppercased")], Uppercase(conn)),
        ],
    )


class _CancelTap:
    """Stands in for the FrameWriter the RelaySlave writes host-bound frames
    with: notes each CANCEL's request id, then writes the frame unchanged."""

    def __init__(self, inner: FrameWriter, conn: Connection):
        self.inner = inner
        self.conn = conn

    def write(self, frame: Frame) -> None:
        if frame.frame_type == FrameType.CANCEL:
            self.conn.note_cancel(frame.id)
        self.inner.write(frame)


class _EndHook:
    """Stands in for the FrameReader the RelaySlave reads the connection with:
    when the connection ends (EOF or error) it runs ``on_end`` so the local
    side (the host) is shut too. Without it RelaySlave.run waits forever on
    the host side after the switch went away."""

    def __init__(self, inner: FrameReader, on_end):
        self.inner = inner
        self.on_end = on_end

    def read(self):
        try:
            frame = self.inner.read()
        except Exception:
            self.on_end()
            raise
        if frame is None:
            self.on_end()
        return frame


def serve(sock: socket.socket, n: int) -> None:
    conn = Connection()
    slave_local, host_local = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    host = build_host(conn)

    def run_host():
        try:
            host.run(host_local.makefile("rb"), host_local.makefile("wb"))
        except Exception as e:
            log(f"connection {n}: host ended: {type(e).__name__}: {e}")

    host_thread = threading.Thread(target=run_host, name=f"host-{n}", daemon=True)
    host_thread.start()

    ended = threading.Event()

    def end_local():
        if ended.is_set():
            return
        ended.set()
        conn.closed.set()
        for s in (slave_local, host_local):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    slave = RelaySlave(FrameReader(slave_local.makefile("rb")),
                       _CancelTap(FrameWriter(slave_local.makefile("wb")), conn))
    try:
        slave.run(_EndHook(FrameReader(sock.makefile("rb")), end_local),
                  FrameWriter(sock.makefile("wb")))
        log(f"connection {n}: ended")
    except Exception as e:
        log(f"connection {n}: ended with {type(e).__name__}: {e}")
    finally:
        end_local()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        host_thread.join(timeout=3)
        slave_local.close()
        host_local.close()


def main(argv) -> int:
    ap = argparse.ArgumentParser(description="A capdag master (RelaySlave + InProcessCartridgeHost) on a Unix socket.")
    ap.add_argument("--listen", metavar="PATH", help="Unix socket path to listen on")
    ap.add_argument("--once", action="store_true", help="exit 0 after the first connection ends")
    ap.add_argument("--list-caps", action="store_true", help="print the served cap URNs and exit")
    args = ap.parse_args(argv)

    if args.list_caps:
        for urn in ALL_URNS:
            print(urn)
        return 0
    if not args.listen:
        ap.error("--listen PATH is required (or --list-caps)")

    path = args.listen
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(1)
    except OSError as e:
        print(f"master.py: cannot listen on {path}: {e}", file=sys.stderr)
        return 2

    def stop(signum, _frame):
        try:
            os.unlink(path)
        except OSError:
            pass
        log(f"signal {signum}: exiting")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    print(f"ready {path}", flush=True)
    log(f"listening on {path}; caps: {', '.join(ALL_URNS)}")
    n = 0
    while True:
        sock, _ = listener.accept()
        n += 1
        log(f"connection {n}: accepted")
        serve(sock, n)
        if args.once:
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
