#!/usr/bin/env python3
"""Build wire vectors for bifaci protocol version 6 with the published capdag encoder.

For every frame type capdag defines, this script builds at least one frame
through capdag's own constructors (``capdag.bifaci.frame.Frame``), turns it
into bytes with capdag's own writer (``capdag.bifaci.io.write_frame``, which
adds the 4-byte length prefix), reads the bytes back with capdag's own reader
(``capdag.bifaci.io.read_frame``) and records both.

Output: ``tests/data/capdag/frames.json`` (relative to the repository root),
a JSON list. Each entry:

    name          a stable name for the vector
    frame_type    the frame type's number
    frame_type_name
    hex           the exact bytes capdag writes, length prefix included
    cbor_hex      the same without the 4-byte prefix
    keys_in_order the integer keys of the CBOR map, in the order capdag wrote them
    fields        what capdag's decoder reads back (see ``render_frame``)
    note          what the vector shows

Every id, nonce and payload is fixed, so two runs write the same file.
Run with the interpreter capdag is installed in, e.g.:

    /tmp/capdag-venv/bin/python tests/capdag/gen_vectors.py
"""

import io
import json
import sys
from importlib import metadata
from pathlib import Path

import cbor2

from capdag.bifaci import io as bio
from capdag.bifaci.frame import (
    AttributionClass,
    CancelReason,
    CreditDirection,
    Frame,
    FrameType,
    Limits,
    MessageId,
    PROTOCOL_VERSION,
    compute_checksum,
    verify_chunk_checksum,
)
from capdag.bifaci.pools import PoolState, encode_pool_states
from capdag.bifaci.policy import HostPolicy, NetworkPolicy
from capdag.cap.definition import Cap, CapArg, CapOutput, StdinSource
from capdag.standard.caps import identity_cap
from capdag.urn.cap_urn import CapUrn

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "capdag" / "frames.json"

# Fixed ids, so the output never changes between runs.
RID = MessageId(bytes.fromhex("0123456789abcdef0123456789abcdef"))
PEER_RID = MessageId(bytes.fromhex("fedcba9876543210fedcba9876543210"))
HB_ID = MessageId(bytes.fromhex("00112233445566778899aabbccddeeff"))
XID = MessageId(7)

CAP_URN = 'cap:in="media:enc=utf-8;text";op=uppercase;out="media:enc=utf-8;text"'
MEDIA_TEXT = "media:enc=utf-8;text"


# --------------------------------------------------------------------------
# rendering what the decoder read
# --------------------------------------------------------------------------

def render_value(value):
    """A JSON rendering of a decoded CBOR value. Byte strings become
    {"$bytes": hex} (plus "$utf8" when they are valid UTF-8), so text and
    bytes stay distinguishable."""
    if isinstance(value, (bytes, bytearray)):
        out = {"$bytes": bytes(value).hex()}
        try:
            out["$utf8"] = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            pass
        return out
    if isinstance(value, dict):
        return {str(k): render_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [render_value(v) for v in value]
    if isinstance(value, float):
        return {"$float": value}
    return value


def render_id(mid):
    if mid is None:
        return None
    if mid.is_uuid():
        return {"uuid": mid.to_uuid_string(), "bytes": mid.uuid_bytes.hex()}
    return {"uint": mid.uint_value}


def render_frame(frame: Frame) -> dict:
    """Every attribute capdag's decoder fills, absent ones as null."""
    return {
        "version": frame.version,
        "frame_type": int(frame.frame_type),
        "id": render_id(frame.id),
        "seq": frame.seq,
        "content_type": frame.content_type,
        "meta": render_value(frame.meta) if frame.meta is not None else None,
        "payload": render_value(frame.payload) if frame.payload is not None else None,
        "len": frame.len,
        "offset": frame.offset,
        "eof": frame.eof,
        "cap": frame.cap,
        "stream_id": frame.stream_id,
        "media_urn": frame.media_urn,
        "routing_id": render_id(frame.routing_id),
        "chunk_index": frame.chunk_index,
        "chunk_count": frame.chunk_count,
        "checksum": frame.checksum,
        "is_sequence": frame.is_sequence,
        "force_kill": frame.force_kill,
        "credit": frame.credit,
        "unbounded": frame.unbounded,
        "output": frame.output,
    }


# --------------------------------------------------------------------------
# the vectors
# --------------------------------------------------------------------------

def uppercase_cap() -> Cap:
    """A trivial cap: text in, text out."""
    cap = Cap(CapUrn.from_string(CAP_URN), "Uppercase", ["uppercase"])
    cap.add_arg(CapArg(media_urn=MEDIA_TEXT, name="input", required=True,
                       sources=[StdinSource(MEDIA_TEXT)]))
    cap.add_output(CapOutput(MEDIA_TEXT, "output", "The text, uppercased"))
    return cap


def small_manifest_json() -> bytes:
    """A RelayNotify payload: one installed cartridge with two caps."""
    manifest = {
        "installed_cartridges": [
            {
                "registry_url": None,
                "id": "tether-vectors",
                "channel": "release",
                "version": "0.0.1",
                "sha256": "00" * 32,
                "cap_groups": [
                    {
                        "name": "tether-vectors",
                        "caps": [
                            identity_cap().to_dict(),
                            uppercase_cap().to_dict(),
                        ],
                        "adapter_urns": [],
                    }
                ],
                # The switch refuses an entry without runtime_stats, and a
                # running cartridge's pool map must cover each of its caps
                # (singleton pool named by the canonical cap URN, then "all").
                "runtime_stats": {
                    "running": True,
                    "pools": {name: st.to_dict() for name, st in pool_states().items()},
                    "pid": 4242,
                    "active_request_count": 0,
                    "peer_request_count": 0,
                    "memory_footprint_mb": 0,
                    "memory_rss_mb": 0,
                    "restart_count": 0,
                },
                "lifecycle": "operational",
            }
        ]
    }
    return json.dumps(manifest, separators=(",", ":")).encode("utf-8")


def check_hello_manifest(manifest: bytes) -> None:
    """Read the manifest the way capdag's CartridgeHost reads a cartridge
    HELLO (a private helper of capdag.bifaci.host_runtime, used only as a
    check): identity cap present, every cap definition valid."""
    from capdag.bifaci import host_runtime as hr

    hr._parse_cap_groups_from_manifest(manifest)


def check_relay_notify_manifest(manifest: bytes) -> None:
    """Read the manifest the way capdag's RelaySwitch reads a RelayNotify
    (private helpers of capdag.bifaci.relay_switch, used only as a check),
    so the vector is one the switch would accept and route by."""
    from capdag.bifaci import relay_switch as rs

    caps, records, _ = rs._parse_relay_notify_payload(manifest)
    for record in records:
        for cap in record.cap_urns():
            rs._admission_chain(None, record.runtime_stats, cap, record.id)
    if sorted(caps) != sorted(["cap:effect=none", CAP_URN]):
        raise SystemExit(f"relay_notify vector: unexpected caps {caps}")


def cartridge_hello_manifest() -> bytes:
    """A cartridge's HELLO manifest (the cartridge.json-like shape)."""
    manifest = {
        "name": "tether-vectors",
        "version": "0.0.1",
        "channel": "release",
        "registry_url": None,
        "description": "wire vectors",
        "cap_groups": [
            {
                "name": "default",
                "caps": [
                    identity_cap().to_dict(),
                    uppercase_cap().to_dict(),
                ],
            }
        ],
    }
    return json.dumps(manifest, separators=(",", ":")).encode("utf-8")


def pool_states():
    return {
        "cap:effect=none": PoolState(),
        CAP_URN: PoolState(declared=2, configured=2),
        "all": PoolState(caps=["cap:effect=none", CAP_URN]),
    }


def build_vectors():
    """(name, frame, note) triples, in frame-type order."""
    v = []

    # HELLO (0)
    v.append(("hello_host", Frame.hello(3_670_016, 262_144, 64, 32),
              "Host HELLO: meta max_frame, max_chunk, max_reorder_buffer, initial_credit, version. id is uint 0."))
    v.append(("hello_cartridge",
              Frame.hello_with_manifest(3_670_016, 262_144, cartridge_hello_manifest(), pool_states(), 64, 32),
              "Cartridge HELLO: host HELLO's meta plus manifest (JSON bytes) and pools (JSON bytes)."))

    # REQ (1)
    v.append(("req", Frame.req(RID, CAP_URN, b"", "application/cbor"),
              "REQ: cap (key 10), empty payload (key 6, zero-length bstr), content_type (key 4); UUID id."))
    req_x = Frame.req(RID, CAP_URN, b"", "application/cbor")
    req_x.routing_id = XID
    v.append(("req_with_xid", req_x,
              "REQ as the switch forwards it to a master: routing_id (key 13) is a uint XID."))
    peer_req = Frame.req(PEER_RID, "cap:effect=none", b"", "application/cbor")
    peer_req.meta = {"parent_rid": RID.to_cbor()}
    v.append(("req_peer_with_parent_rid", peer_req,
              "Peer REQ from a cartridge: meta.parent_rid holds the parent request id (16-byte bstr)."))
    ident_req = Frame.req(RID, "cap:effect=none", b"", "application/cbor")
    v.append(("req_identity", ident_req,
              "REQ for the identity cap, as in the identity check."))

    # CHUNK (3)
    payload = cbor2.dumps(b"hello, tether")
    v.append(("chunk", Frame.chunk(RID, "arg-0", 0, payload, 0, compute_checksum(payload)),
              "CHUNK: stream_id, chunk_index (key 14), checksum (key 16) = FNV-1a 64 of the payload bytes (key 6) "
              "exactly as sent; here the payload is the CBOR encoding of a byte string."))
    c1 = Frame.chunk(RID, "arg-0", 0, payload, 1, compute_checksum(payload))
    c1.seq = 2
    c1.routing_id = XID
    v.append(("chunk_seq2_index1_xid", c1,
              "CHUNK with seq 2, chunk_index 1 and an XID."))
    empty = b""
    v.append(("chunk_empty_payload", Frame.chunk(RID, "arg-0", 0, empty, 0, compute_checksum(empty)),
              "CHUNK with an empty payload: checksum is the FNV-1a 64 offset basis 0xcbf29ce484222325."))
    big_sum = Frame.chunk(RID, "arg-0", 0, b"\x00", 0, compute_checksum(b"\x00"))
    v.append(("chunk_one_zero_byte", big_sum,
              "CHUNK whose payload is one 0x00 byte (checksum 0xaf63bd4c8601b7df)."))
    co = Frame.chunk_with_offset(RID, "arg-0", 0, payload, 0, len(payload), True, 0, compute_checksum(payload))
    v.append(("chunk_with_offset_len_eof", co,
              "CHUNK from chunk_with_offset: offset (key 8), len (key 7, first chunk only), eof (key 9)."))

    # END (4)
    v.append(("end_ok", Frame.end_ok(RID), "END: eof true (key 9), meta.exit_code 0."))
    v.append(("end_bare", Frame.end(RID), "END without meta (as a request body's END; no exit_code)."))
    v.append(("end_ok_with_progress", Frame.end_ok_with(RID, None, 1.0, "done"),
              "END with terminal meta: exit_code, progress (CBOR float64), message."))

    # LOG (5)
    v.append(("log_attributed", Frame.log(RID, "warn", AttributionClass.ENVIRONMENT, "retrying download"),
              "Non-progress LOG: meta level, attribution_class, message."))
    v.append(("log_progress", Frame.progress(RID, 0.5, "halfway"),
              "Progress LOG: meta level=progress, message, progress (float64); no attribution_class."))

    # ERR (6)
    v.append(("err", Frame.err(RID, "CONTEXT_OVERFLOW", AttributionClass.INPUT, "input is too long"),
              "ERR: meta code, attribution_class, message."))
    e2 = Frame.err(RID, "BAD_ARG", AttributionClass.INPUT, "argument is not text", arg_urn=MEDIA_TEXT)
    e2.routing_id = XID
    v.append(("err_with_arg_urn_xid", e2, "ERR with meta.arg_urn and an XID."))

    # HEARTBEAT (7)
    v.append(("heartbeat_probe", Frame.heartbeat(HB_ID), "Plain HEARTBEAT probe: no meta."))
    reply = Frame.heartbeat(HB_ID)
    reply.meta = {"pools": encode_pool_states(pool_states())}
    v.append(("heartbeat_reply_pools", reply,
              "HEARTBEAT reply as a host/cartridge writes it: meta.pools (JSON bytes), same id as the probe."))
    v.append(("heartbeat_probe_desired", Frame.heartbeat_with_desired(HB_ID, {CAP_URN: 1}),
              "HEARTBEAT probe carrying meta.desired_capacities (JSON bytes)."))

    # STREAM_START (8)
    v.append(("stream_start", Frame.stream_start(RID, "arg-0", MEDIA_TEXT, False),
              "STREAM_START: stream_id (11), media_urn (12), is_sequence (17)."))
    v.append(("stream_start_no_is_sequence", Frame.stream_start(RID, "identity-verify", "media:"),
              "STREAM_START with is_sequence absent, as in the identity check."))
    ssu = Frame.stream_start_unbounded(RID, "out-1", MEDIA_TEXT, True).for_output("media:enc=utf-8;log;text")
    v.append(("stream_start_unbounded_output", ssu,
              "STREAM_START with unbounded (key 20) and output (key 21)."))

    # STREAM_END (9)
    v.append(("stream_end", Frame.stream_end(RID, "arg-0", 1), "STREAM_END with chunk_count (key 15)."))
    v.append(("stream_end_unbounded", Frame.stream_end_unbounded(RID, "out-1"), "STREAM_END without chunk_count."))

    # RELAY_NOTIFY (10)
    v.append(("relay_notify", Frame.relay_notify(small_manifest_json(), 3_670_016, 262_144, 64, 32),
              "RELAY_NOTIFY: meta manifest (JSON bytes with installed_cartridges), max_frame, max_chunk, "
              "max_reorder_buffer, initial_credit. id uint 0."))

    # RELAY_STATE (11)
    v.append(("relay_state", Frame.relay_state(b'{"memory_mb":1024}'),
              "RELAY_STATE: opaque payload. id uint 0."))

    # CANCEL (12)
    v.append(("cancel_user", Frame.cancel(RID, CancelReason.user()),
              "CANCEL by the user: meta code=CANCELLED, attribution_class=user, message; force_kill (18) false."))
    v.append(("cancel_unattributed_force", Frame.cancel(RID, CancelReason.unattributed(force_kill=True)),
              "Unattributed CANCEL: no meta, force_kill true."))
    v.append(("cancel_collateral",
              Frame.cancel(RID, CancelReason.collateral(AttributionClass.RESOURCE, "sibling step ran out of memory")),
              "CANCEL as collateral: code=ABORTED_COLLATERAL with the failure's class."))

    # CREDIT (13)
    cr = Frame.credit(RID, "result", 16, CreditDirection.RESPONSE)
    cr.routing_id = XID
    v.append(("credit_response", cr, "CREDIT: credit (key 19), stream_id, meta.credit_dir=response."))
    v.append(("credit_request_no_stream", Frame.credit(RID, None, 4, CreditDirection.REQUEST),
              "CREDIT with no stream_id, meta.credit_dir=request."))

    # CLOSE_STREAM (14)
    v.append(("close_stream_all", Frame.close_stream(RID), "CLOSE_STREAM with no stream_id: close all live inputs."))
    v.append(("close_stream_one", Frame.close_stream(RID, "feed-0"), "CLOSE_STREAM naming one stream."))

    # POLICY (15)
    for net in (NetworkPolicy.OFFLINE, NetworkPolicy.NO_TELEMETRY, NetworkPolicy.FULL):
        v.append((f"policy_{net.value}", Frame.policy(HostPolicy(net)),
                  f"POLICY: meta.network={net.value}. id uint 0."))
    return v


def check_round_trip(name, frame, decoded):
    if int(decoded.frame_type) != int(frame.frame_type):
        raise SystemExit(f"{name}: frame type changed in the round trip")
    if decoded.frame_type == FrameType.CHUNK:
        verify_chunk_checksum(decoded)


def main() -> int:
    check_relay_notify_manifest(small_manifest_json())
    check_hello_manifest(cartridge_hello_manifest())
    limits = Limits.default()
    seen_types = set()
    out = []
    for name, frame, note in build_vectors():
        buf = io.BytesIO()
        bio.write_frame(buf, frame, limits)
        wire = buf.getvalue()
        decoded = bio.read_frame(io.BytesIO(wire), limits)
        check_round_trip(name, frame, decoded)
        body = wire[4:]
        if int.from_bytes(wire[:4], "big") != len(body):
            raise SystemExit(f"{name}: length prefix does not match the body")
        keys = list(cbor2.loads(body).keys())
        seen_types.add(int(frame.frame_type))
        out.append({
            "name": name,
            "frame_type": int(frame.frame_type),
            "frame_type_name": frame.frame_type.name,
            "hex": wire.hex(),
            "cbor_hex": body.hex(),
            "keys_in_order": keys,
            "fields": render_frame(decoded),
            "note": note,
        })

    missing = {int(t) for t in FrameType.all()} - seen_types
    if missing:
        raise SystemExit(f"no vector for frame types {sorted(missing)}")

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"wrote {len(out)} vectors ({len(seen_types)} frame types, protocol version {PROTOCOL_VERSION}, "
        f"capdag {metadata.version('capdag')}) to {OUT}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
