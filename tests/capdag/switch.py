#!/usr/bin/env python3
"""A capdag RelaySwitch driving scripted requests at masters on Unix sockets.

    switch.py --master unix:PATH [--master unix:PATH ...]
              [--policy offline|no_telemetry|full] [--timeout S] SCRIPT

SCRIPT is a JSON file (``-`` for stdin) holding a list of steps, run in order:

    {"call": URN, "input": TEXT}            one request; input optional (absent or
                                            null: no argument stream at all)
        optional: "expect_chunks": true     also report every CHUNK's text
                  "input_as": "text"        send the input as a CBOR text string
                                            (default: CBOR byte string, as capdag's
                                            engines and identity check do)
                  "timeout_s": S            this step's deadline (default --timeout)
    {"cancel_after_first_chunk": URN, "input": TEXT, "cancel_wait_s": 2}
        the request; after the first answer CHUNK, RelaySwitch.cancel_request
        (CancelReason.user()); then waits up to cancel_wait_s for the master's
        answer to the CANCEL (which the switch drops as a straggler).
    {"stop_feeds": URN, "input": TEXT, "stop_wait_s": 2}
        REQ + STREAM_START + one CHUNK, then RelaySwitch.stop_request_feeds
        (CLOSE_STREAM). If the request has not ended within stop_wait_s, the
        input is finished (STREAM_END + END) and the answer awaited.
    {"set_policy": "offline" | "no_telemetry" | "full"}
    {"heartbeat": true}                     HEARTBEAT through send_to_master (goes to
                                            master 0); waits for the reply by id
    {"reattach": I}                         reconnect master I (index into --master,
                                            retrying until the deadline) and
                                            RelaySwitch.add_master it into its slot
    {"sleep_s": S}                          just wait

One JSON line per step on stdout, keys in this order (null when not applicable):

    {"step": i, "kind": K, "cap": URN|null, "ok": bool, "body": TEXT|null,
     "chunks": N|null, "err_code": C|null, "err_message": M|null,
     "attribution_class": A|null, "exit_code": E|null, "source": S|null,
     "terminal_kind": T|null, ...kind-specific keys}

- ok: the request ended with END whose meta.exit_code is 0 (for requests);
  the action succeeded (other steps).
- body: the answer CHUNK payloads, each CBOR-decoded (byte or text string),
  concatenated, as UTF-8 (invalid bytes replaced). chunks: answer CHUNK count.
- source: where the outcome came from: "frame" (a terminal frame the engine
  read), "switch_table" (no frame reached the engine; the switch's own record
  of how the request ended, ``recent_terminal_of_rid``: cancel, master death),
  "send_error" (send_to_master raised: NO_HANDLER, UNKNOWN_REQUEST,
  CARTRIDGE_UNAVAILABLE, SWITCH_ERROR), "timeout" (err_code "TIMEOUT").
- terminal_kind: the switch's TerminatedSummary kind: end, err, cancelled,
  master_died.
- call: "chunk_texts" (list) when expect_chunks; "undecodable_chunks" when
  some CHUNK was not CBOR (its raw bytes then go into body).
- cancel_after_first_chunk: "cancel_sent" (the request was live when
  cancelled), "stragglers" (frame types the switch dropped as post-terminal
  for this step, e.g. {"err": 1}: the master's ERR answering the CANCEL).
- stop_feeds: "stop_sent" (stop_request_feeds' answer), "ended_by"
  ("stop": the request ended by itself after the stop; "input_end": only after
  the input was finished).
- any step: "masters_closed": true when read_from_masters reported every
  master closed during the step.
- reattach: "master", "caps". heartbeat: "pools" (the reply carried meta.pools).
- a request step that timed out: "cancelled_after_timeout": true when the
  request was still live and was then cancelled (CancelReason.host, internal).

At the end: {"done": true, "masters": [[caps of master 0], ...],
"healthy": [bool, ...], "timeouts": N}. Exit 0 when every step ran (an ERR
answer is a step that ran), 1 when a step timed out or failed inside this
script, 2 on bad arguments/script or when connecting or the handshake fails
(one sentence on stderr). Diagnostics go to stderr only.

The engine side grants response credit the way capdag's own peer-response
reader does (``InputGrantEmitter`` with a ``CreditWindow`` of the switch's
initial credit, credit_dir=response, naming the stream; flushed whenever it
would wait), so a master that enforces credit can stream past its window.
"""

import argparse
import json
import os
import queue
import socket
import sys
import threading
import time

import cbor2

from capdag.bifaci.cartridge_runtime import InputGrantEmitter
from capdag.bifaci.credit import CreditWindow
from capdag.bifaci.frame import (
    AttributionClass,
    CancelReason,
    CreditDirection,
    Frame,
    FrameType,
    MessageId,
    compute_checksum,
)
from capdag.bifaci.policy import HostPolicy, NetworkPolicy
from capdag.bifaci.relay_switch import (
    CartridgeUnavailableError,
    NoHandlerError,
    RelaySwitch,
    SocketPair,
    UnknownRequestError,
)
from capdag.urn.cap_urn import CapUrn

MEDIA_TEXT = "media:enc=utf-8;text"
POLL_S = 0.05
GRACE_S = 0.5  # how long a frame may trail the switch's table update


def log(msg: str) -> None:
    print(f"[switch] {msg}", file=sys.stderr, flush=True)


def emit(obj: dict) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


class Fatal(Exception):
    """Connecting or the handshake failed: one sentence, exit 2."""


# --------------------------------------------------------------------------
# connecting
# --------------------------------------------------------------------------

def parse_master(spec: str) -> str:
    if not spec.startswith("unix:") or len(spec) == len("unix:"):
        raise Fatal(f"--master must be unix:PATH, got {spec!r}")
    return spec[len("unix:"):]


def connect_unix(path: str, deadline: float) -> socket.socket:
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            if time.monotonic() >= deadline:
                raise Fatal(f"cannot connect to the master at {path}: {e.strerror}")
            time.sleep(0.1)
        except OSError as e:
            s.close()
            raise Fatal(f"cannot connect to the master at {path}: {e}")


class Watchdog:
    """Shuts the given sockets if not cancelled in time, so a blocking capdag
    handshake read returns (EOF) instead of hanging."""

    def __init__(self, socks, timeout: float):
        self.fired = False
        self._socks = socks
        self._timer = threading.Timer(timeout, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        self.fired = True
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self):
        self._timer.cancel()


# --------------------------------------------------------------------------
# the engine side
# --------------------------------------------------------------------------

class Engine:
    def __init__(self, switch: RelaySwitch):
        self.switch = switch
        self._lock = threading.Lock()
        self._queues = {}  # MessageId -> queue.Queue
        self.masters_closed = 0  # times read_from_masters said every master closed
        t = threading.Thread(target=self._pump, name="engine-pump", daemon=True)
        t.start()

    def _pump(self):
        while True:
            try:
                f = self.switch.read_from_masters()
            except Exception as e:  # e.g. a peer REQ for a cap nobody has
                log(f"read_from_masters raised {type(e).__name__}: {e}")
                continue
            if f is None:
                with self._lock:
                    self.masters_closed += 1
                log("read_from_masters: every master has closed")
                continue
            with self._lock:
                q = self._queues.get(f.id)
            if q is not None:
                q.put(f)
            elif f.frame_type == FrameType.RELAY_NOTIFY:
                log("RELAY_NOTIFY passed through to the engine")
            else:
                log(f"frame for no waiting request: {f.frame_type.name} id={f.id.to_string()}")

    def register(self, rid: MessageId) -> "queue.Queue":
        q = queue.Queue()
        with self._lock:
            self._queues[rid] = q
        return q

    def unregister(self, rid: MessageId) -> None:
        with self._lock:
            self._queues.pop(rid, None)

    def closed_count(self) -> int:
        with self._lock:
            return self.masters_closed


class _SwitchWriter:
    """What InputGrantEmitter writes its CREDIT frames to: the switch's
    send_to_master (which stamps the XID). Counts what it granted."""

    def __init__(self, switch):
        self.switch = switch
        self.granted = 0

    def write(self, frame):
        self.switch.send_to_master(frame)
        self.granted += frame.credit_count() or 0


def send_error_code(e: Exception) -> str:
    if isinstance(e, NoHandlerError):
        return "NO_HANDLER"
    if isinstance(e, UnknownRequestError):
        return "UNKNOWN_REQUEST"
    if isinstance(e, CartridgeUnavailableError):
        return "CARTRIDGE_UNAVAILABLE"
    return "SWITCH_ERROR"


def in_media(cap_urn: str) -> str:
    try:
        urn = CapUrn.from_string(cap_urn).in_urn
    except Exception:
        return MEDIA_TEXT
    return urn or MEDIA_TEXT


def base_result(i: int, kind: str, cap=None) -> dict:
    return {
        "step": i, "kind": kind, "cap": cap, "ok": False, "body": None, "chunks": None,
        "err_code": None, "err_message": None, "attribution_class": None,
        "exit_code": None, "source": None, "terminal_kind": None,
    }


class Request:
    """One engine request through the switch, and what came back for it."""

    def __init__(self, engine: Engine, cap: str, step: dict):
        self.engine = engine
        self.switch = engine.switch
        self.cap = cap
        self.rid = MessageId.new_uuid()
        self.q = engine.register(self.rid)
        self.body = bytearray()
        self.chunks = 0
        self.chunk_texts = []
        self.undecodable = 0
        self.terminal = None  # the terminal frame, if one reached the engine
        self.window_credit = self.switch.limits().initial_credit
        self.windows = {}  # stream_id -> (CreditWindow, InputGrantEmitter)
        self.grant_writer = _SwitchWriter(self.switch)
        self.violations = 0
        data = step.get("input")
        if data is None:
            self.payloads = None
        else:
            if not isinstance(data, str):
                raise ValueError("input must be a string or null")
            as_text = step.get("input_as", "bytes") == "text"
            raw = data.encode("utf-8")
            size = max(1, self.switch.limits().max_chunk // 2)
            pieces = [raw[k:k + size] for k in range(0, len(raw), size)] or [b""]
            self.payloads = [cbor2.dumps(p.decode("utf-8") if as_text else p) for p in pieces]

    # sending ---------------------------------------------------------------
    def send(self, frame):
        self.switch.send_to_master(frame)

    def send_req(self):
        self.send(Frame.req(self.rid, self.cap, b"", "application/cbor"))

    def send_stream_start(self):
        self.send(Frame.stream_start(self.rid, "arg-0", in_media(self.cap), False))

    def send_chunk(self, index: int):
        p = self.payloads[index]
        self.send(Frame.chunk(self.rid, "arg-0", 0, p, index, compute_checksum(p)))

    def send_stream_end(self, count: int):
        self.send(Frame.stream_end(self.rid, "arg-0", count))

    def send_end(self):
        self.send(Frame.end(self.rid, None))

    def send_whole(self):
        self.send_req()
        if self.payloads is not None:
            self.send_stream_start()
            for k in range(len(self.payloads)):
                self.send_chunk(k)
            self.send_stream_end(len(self.payloads))
        self.send_end()

    # receiving -------------------------------------------------------------
    def _flush_grants(self):
        for _window, emitter in self.windows.values():
            emitter.flush()

    def _take(self, f, keep_texts):
        ft = f.frame_type
        if ft == FrameType.STREAM_START:
            sid = f.stream_id
            if sid not in self.windows:
                window = CreditWindow(self.window_credit)
                emitter = InputGrantEmitter(self.grant_writer, self.rid, None, sid,
                                            CreditDirection.RESPONSE, window)
                self.windows[sid] = (window, emitter)
        elif ft == FrameType.CHUNK:
            self.chunks += 1
            payload = f.payload or b""
            try:
                value = cbor2.loads(payload)
                if isinstance(value, str):
                    piece = value.encode("utf-8")
                elif isinstance(value, (bytes, bytearray)):
                    piece = bytes(value)
                else:
                    piece = json.dumps(value, default=repr).encode("utf-8")
            except Exception:
                self.undecodable += 1
                piece = payload
            self.body.extend(piece)
            if keep_texts:
                self.chunk_texts.append(piece.decode("utf-8", errors="replace"))
            entry = self.windows.get(f.stream_id)
            if entry is not None:
                window, emitter = entry
                if not window.arrive():
                    self.violations += 1
                emitter.consumed()
        elif ft in (FrameType.END, FrameType.ERR):
            self.terminal = f

    def wait(self, deadline, keep_texts=False, until=None):
        """Read this request's frames until its terminal (True), ``until(frame)``
        says stop (True), the switch ended it without a frame reaching us
        ("gone"), or the deadline ("timeout")."""
        not_live_since = None
        while True:
            try:
                f = self.q.get_nowait()
            except queue.Empty:
                self._flush_grants()  # L10: flush before waiting
                try:
                    f = self.q.get(timeout=POLL_S)
                except queue.Empty:
                    f = None
            now = time.monotonic()
            if f is not None:
                self._take(f, keep_texts)
                if self.terminal is not None:
                    return True
                if until is not None and until(f):
                    return True
                if now >= deadline:
                    return "timeout"
                continue
            if not self.switch.is_request_live(self.rid):
                if not_live_since is None:
                    not_live_since = now
                elif now - not_live_since >= GRACE_S:
                    return "gone"
            if now >= deadline:
                return "timeout"

    def drain(self, seconds, keep_texts=False):
        end = time.monotonic() + seconds
        while self.terminal is None:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            try:
                f = self.q.get(timeout=min(remaining, POLL_S))
            except queue.Empty:
                continue
            self._take(f, keep_texts)

    def fill(self, res: dict, keep_texts=False):
        res["body"] = self.body.decode("utf-8", errors="replace")
        res["chunks"] = self.chunks
        summary = self.switch.recent_terminal_of_rid(self.rid)
        if summary is not None:
            res["terminal_kind"] = summary.kind.value
        t = self.terminal
        if t is not None:
            res["source"] = "frame"
            if t.frame_type == FrameType.END:
                res["exit_code"] = t.exit_code()
                res["ok"] = t.exit_code() == 0
            else:
                res["ok"] = False
                res["err_code"] = t.error_code()
                res["err_message"] = t.error_message()
                try:
                    res["attribution_class"] = t.attribution_class().value
                except ValueError:
                    res["attribution_class"] = None
        elif summary is not None:
            res["source"] = "switch_table"
            res["ok"] = False
            kind = summary.kind.value
            if kind == "cancelled":
                res["err_code"] = summary.cancel_code
                res["err_message"] = summary.cancel_reason
                res["attribution_class"] = summary.cancel_class.value if summary.cancel_class else None
            elif kind == "master_died":
                res["err_code"] = "MASTER_DIED"
                res["attribution_class"] = "environment"
        if keep_texts:
            res["chunk_texts"] = list(self.chunk_texts)
        if self.undecodable:
            res["undecodable_chunks"] = self.undecodable
        log(f"rid={self.rid.to_string()} chunks={self.chunks} credits_sent={self.grant_writer.granted} "
            f"credit_violations={self.violations}")

    def close(self):
        self.engine.unregister(self.rid)


def timeout_result(res, what, req=None):
    res["ok"] = False
    res["source"] = "timeout"
    res["err_code"] = "TIMEOUT"
    res["err_message"] = f"timed out waiting for {what}"
    if req is not None and req.switch.is_request_live(req.rid):
        # Abandoned: cancel it, as capdag's switch does for a request whose
        # caller went away, so it does not run on into later steps.
        req.switch.cancel_request(req.rid, CancelReason.host(
            AttributionClass.INTERNAL, "switch.py: step deadline passed, request abandoned"))
        res["cancelled_after_timeout"] = True


def stragglers_snapshot(switch):
    return dict(switch.protocol_stats().stragglers.by_frame_type)


def straggler_delta(before, after):
    out = {}
    for k in sorted(after):
        d = after[k] - before.get(k, 0)
        if d:
            out[k] = d
    return out


# --------------------------------------------------------------------------
# steps
# --------------------------------------------------------------------------

STEP_KINDS = ("call", "cancel_after_first_chunk", "stop_feeds", "set_policy",
              "heartbeat", "reattach", "sleep_s")


class Runner:
    def __init__(self, switch, engine, paths, timeout):
        self.switch = switch
        self.engine = engine
        self.paths = paths
        self.timeout = timeout
        self.timeouts = 0
        self.failures = 0

    def run_step(self, i, step):
        kind = next((k for k in STEP_KINDS if k in step), None)
        closed_before = self.engine.closed_count()
        deadline = time.monotonic() + float(step.get("timeout_s", self.timeout))
        if kind in ("call", "cancel_after_first_chunk", "stop_feeds"):
            res = base_result(i, kind, step[kind])
            getattr(self, "step_" + kind)(res, step, deadline)
        else:
            res = base_result(i, kind)
            getattr(self, "step_" + kind)(res, step, deadline)
        if self.engine.closed_count() != closed_before:
            res["masters_closed"] = True
        if res.get("err_code") == "TIMEOUT":
            self.timeouts += 1
        return res

    def _request(self, res, step):
        return Request(self.engine, res["cap"], step)

    def _guard_send(self, res, req, fn):
        try:
            fn()
            return True
        except Exception as e:
            res["ok"] = False
            res["source"] = "send_error"
            res["err_code"] = send_error_code(e)
            res["err_message"] = str(e)
            res["chunks"] = req.chunks
            return False

    def step_call(self, res, step, deadline):
        keep = bool(step.get("expect_chunks"))
        req = self._request(res, step)
        try:
            if not self._guard_send(res, req, req.send_whole):
                return
            outcome = req.wait(deadline, keep_texts=keep)
            req.fill(res, keep_texts=keep)
            if outcome == "timeout":
                timeout_result(res, "the answer", req)
        finally:
            req.close()

    def step_cancel_after_first_chunk(self, res, step, deadline):
        req = self._request(res, step)
        try:
            if not self._guard_send(res, req, req.send_whole):
                return
            outcome = req.wait(deadline, until=lambda f: f.frame_type == FrameType.CHUNK)
            if outcome is True and req.terminal is None:
                before = stragglers_snapshot(self.switch)
                res["cancel_sent"] = self.switch.is_request_live(req.rid)
                self.switch.cancel_request(req.rid, CancelReason.user())
                # The switch terminated the request before sending the CANCEL;
                # the master's answer to it is a straggler the switch drops.
                # Wait for it to show, up to cancel_wait_s.
                end = time.monotonic() + float(step.get("cancel_wait_s", 2.0))
                while time.monotonic() < end and req.terminal is None:
                    delta = straggler_delta(before, stragglers_snapshot(self.switch))
                    if "err" in delta or "end" in delta:
                        break
                    req.drain(POLL_S)
                req.drain(0.1)
                req.fill(res)
                res["stragglers"] = straggler_delta(before, stragglers_snapshot(self.switch))
            else:
                req.fill(res)
                res["cancel_sent"] = False
                if outcome == "timeout":
                    timeout_result(res, "the first answer chunk", req)
        finally:
            req.close()

    def step_stop_feeds(self, res, step, deadline):
        if step.get("input") is None:
            step = dict(step, input="")
        req = self._request(res, step)
        try:
            def opening():
                req.send_req()
                req.send_stream_start()
                req.send_chunk(0)
            if not self._guard_send(res, req, opening):
                return
            res["stop_sent"] = self.switch.stop_request_feeds(req.rid)
            stop_deadline = min(deadline, time.monotonic() + float(step.get("stop_wait_s", 2.0)))
            outcome = req.wait(stop_deadline)
            if outcome is True or outcome == "gone":
                res["ended_by"] = "stop"
            else:
                # Still running: finish the input the way a normal request does.
                def closing():
                    for k in range(1, len(req.payloads)):
                        req.send_chunk(k)
                    req.send_stream_end(len(req.payloads))
                    req.send_end()
                if not self._guard_send(res, req, closing):
                    res["ended_by"] = None
                    return
                res["ended_by"] = "input_end"
                outcome = req.wait(deadline)
            req.fill(res)
            if outcome == "timeout":
                timeout_result(res, "the request's end", req)
        finally:
            req.close()

    def step_set_policy(self, res, step, deadline):
        word = step["set_policy"]
        policy = NetworkPolicy.from_wire(word)
        if policy is None:
            res["err_code"] = "BAD_STEP"
            res["err_message"] = f"unknown policy {word!r}"
            return
        try:
            self.switch.set_policy(HostPolicy(policy))
            res["ok"] = True
        except Exception as e:
            res["source"] = "send_error"
            res["err_code"] = send_error_code(e)
            res["err_message"] = str(e)

    def step_heartbeat(self, res, step, deadline):
        hb = MessageId.new_uuid()
        q = self.engine.register(hb)
        try:
            try:
                self.switch.send_to_master(Frame.heartbeat(hb))
            except Exception as e:
                res["source"] = "send_error"
                res["err_code"] = send_error_code(e)
                res["err_message"] = str(e)
                return
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timeout_result(res, "the heartbeat reply")
                    return
                try:
                    f = q.get(timeout=remaining)
                except queue.Empty:
                    continue
                if f.frame_type == FrameType.HEARTBEAT:
                    res["ok"] = True
                    res["source"] = "frame"
                    res["pools"] = bool(f.meta and "pools" in f.meta)
                    return
                if f.frame_type == FrameType.ERR:
                    res["source"] = "frame"
                    res["err_code"] = f.error_code()
                    res["err_message"] = f.error_message()
                    return
        finally:
            self.engine.unregister(hb)

    def step_reattach(self, res, step, deadline):
        idx = int(step["reattach"])
        res["master"] = idx
        if not 0 <= idx < len(self.paths):
            res["err_code"] = "BAD_STEP"
            res["err_message"] = f"no master {idx}"
            return
        master_id = f"master-{idx}"
        # The old connection must be seen closed before its slot takes a new one.
        while not self.switch.slot_accepts_attach(master_id):
            if time.monotonic() >= deadline:
                timeout_result(res, f"slot {master_id} to detach")
                return
            time.sleep(POLL_S)
        try:
            sock = connect_unix(self.paths[idx], deadline)
        except Fatal as e:
            res["err_code"] = "CONNECT_FAILED"
            res["err_message"] = str(e)
            return
        dog = Watchdog([sock], max(0.1, deadline - time.monotonic()))
        try:
            self.switch.add_master(SocketPair(id=master_id, read=sock.makefile("rb"),
                                              write=sock.makefile("wb")))
        except Exception as e:
            res["err_code"] = "TIMEOUT" if dog.fired else "ATTACH_FAILED"
            res["source"] = "timeout" if dog.fired else None
            res["err_message"] = f"{type(e).__name__}: {e}"
            return
        finally:
            dog.cancel()
        caps, healthy = master_caps(self.switch)
        res["ok"] = healthy[idx]
        res["caps"] = caps[idx]
        if not healthy[idx]:
            res["err_code"] = "UNHEALTHY"
            res["err_message"] = self.switch._masters[idx].last_error

    def step_sleep_s(self, res, step, deadline):
        time.sleep(float(step["sleep_s"]))
        res["ok"] = True


def master_caps(switch):
    # Per-master caps are not public in RelaySwitch; read its slot records.
    with switch._lock:
        return ([list(m.caps) for m in switch._masters], [bool(m.healthy) for m in switch._masters])


def load_script(path):
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        steps = json.loads(text)
    except (OSError, ValueError) as e:
        raise Fatal(f"cannot read the script {path}: {e}")
    if not isinstance(steps, list):
        raise Fatal("the script must be a JSON list of steps")
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise Fatal(f"step {i} is not a JSON object")
        kinds = [k for k in STEP_KINDS if k in step]
        if len(kinds) != 1:
            raise Fatal(f"step {i} must have exactly one of {', '.join(STEP_KINDS)}")
        k = kinds[0]
        if k in ("call", "cancel_after_first_chunk", "stop_feeds") and not isinstance(step[k], str):
            raise Fatal(f"step {i}: {k} must be a cap URN string")
        if k == "set_policy" and NetworkPolicy.from_wire(step[k]) is None:
            raise Fatal(f"step {i}: unknown policy {step[k]!r}")
    return steps


def main(argv) -> int:
    ap = argparse.ArgumentParser(description="A capdag RelaySwitch driving scripted requests at masters on Unix sockets.")
    ap.add_argument("--master", action="append", required=True, metavar="unix:PATH")
    ap.add_argument("--policy", default="no_telemetry", choices=[p.value for p in NetworkPolicy])
    ap.add_argument("--timeout", type=float, default=20.0, help="per-step deadline in seconds (default 20)")
    ap.add_argument("--connect-timeout", type=float, default=10.0,
                    help="deadline for connecting and the handshake (default 10)")
    ap.add_argument("script", help="JSON list of steps, or - for stdin")
    args = ap.parse_args(argv)

    try:
        paths = [parse_master(m) for m in args.master]
        steps = load_script(args.script)
        deadline = time.monotonic() + args.connect_timeout
        socks = [connect_unix(p, deadline) for p in paths]
        dog = Watchdog(socks, max(0.1, deadline - time.monotonic()))
        try:
            switch = RelaySwitch(
                [SocketPair(id=f"master-{i}", read=s.makefile("rb"), write=s.makefile("wb"))
                 for i, s in enumerate(socks)],
                HostPolicy(NetworkPolicy.from_wire(args.policy)),
            )
        except Exception as e:
            if dog.fired:
                raise Fatal(f"the handshake did not finish within {args.connect_timeout:g} s ({e})")
            raise Fatal(f"the handshake with the masters failed: {type(e).__name__}: {e}")
        finally:
            dog.cancel()
    except Fatal as e:
        print(f"switch.py: {e}", file=sys.stderr)
        return 2

    engine = Engine(switch)
    runner = Runner(switch, engine, paths, args.timeout)
    failed = False
    for i, step in enumerate(steps):
        t0 = time.monotonic()
        try:
            res = runner.run_step(i, step)
        except Exception as e:
            res = base_result(i, next(k for k in STEP_KINDS if k in step))
            res["err_code"] = "SCRIPT_ERROR"
            res["err_message"] = f"{type(e).__name__}: {e}"
            failed = True
        emit(res)
        log(f"step {i} ({res['kind']}) took {time.monotonic() - t0:.3f} s")
    caps, healthy = master_caps(switch)
    emit({"done": True, "masters": caps, "healthy": healthy, "timeouts": runner.timeouts})
    sys.stdout.flush()
    # Daemon threads (readers, pump) may be blocked in reads: leave without
    # waiting for them.
    os._exit(1 if failed or runner.timeouts else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
