//! Checks shared by tether's fuzz targets. Decoders are fed arbitrary bytes two ways (whole,
//! and cut into received buffers) and must agree, must never panic, must keep every item
//! within its bounds, and every item they yield must encode and decode back to itself
//! (decode → encode → decode stability). Stateful targets
//! drive a core machine and its reference model in lockstep with arbitrary op sequences.

use bytes::{Bytes, BytesMut};
use tether_core::wire::actor::ActorDecoder;
use tether_core::wire::bifaci::{BifaciDecoder, Frame};
use tether_core::wire::envelope::{Envelope, EnvelopeDecoder};
use tether_core::wire::telemetry::{
    encode_batch, encode_channel_declared, encode_stream_ended, Compression, TelemetryDecoder,
    TelemetryItem,
};
use tether_core::wire::{Format, StreamDecoder};

/// Decodes the input three ways and expects the same outcome: pushed whole (copied), and cut
/// into received buffers, adopted without copying, or copied and adopted in turn. The first
/// buffer is cut where the input's first byte says; then come up to 48 buffers whose sizes
/// cycle through a small set the same byte starts (so items and headers straddle buffers),
/// and the rest in one.
fn decode_all<F: Format + Clone>(format: F, data: &[u8]) -> Vec<F::Item> {
    let Some((&split, data)) = data.split_first() else {
        return Vec::new();
    };
    let cut = usize::from(split).min(data.len());
    let sizes = [usize::from(split % 61) + 1, 1, 7, 300, 2];
    let mut parts = vec![&data[..cut]];
    let mut rest = &data[cut..];
    // At most 48 small buffers, then the rest in one: a run stays cheap on large inputs.
    for size in sizes.iter().cycle().take(48) {
        let (part, after) = rest.split_at((*size).min(rest.len()));
        parts.push(part);
        rest = after;
    }
    parts.push(rest);
    let whole = decode_parts(format.clone(), &[data], Feed::Copy);
    let mixed = decode_parts(format.clone(), &parts, Feed::InTurn);
    let (items, adopted) = decode_parts(format, &parts, Feed::Adopt);
    for (how, outcome) in [("in turn", mixed.1), ("adopted", adopted.clone())] {
        assert_eq!(
            outcome, whole.1,
            "a stream's outcome depends on how its bytes arrived ({how})"
        );
    }
    assert_eq!(items.len(), whole.0.len());
    items
}

/// How [`decode_parts`] hands bytes to the decoder.
#[derive(Clone, Copy)]
enum Feed {
    Copy,
    Adopt,
    InTurn,
}

/// What a stream came to, apart from its items: how many items, each frame-local error (kind
/// and offset), the offset reached, and the error that stopped it or the verdict of `finish`.
#[derive(Debug, Clone, PartialEq)]
struct Outcome {
    items: usize,
    errors: Vec<(&'static str, u64)>,
    offset: u64,
    end: Option<&'static str>,
}

/// Pushes `parts` in order as `feed` says, popping after each, and keeps decoding past
/// frame-local errors.
fn decode_parts<F: Format>(format: F, parts: &[&[u8]], feed: Feed) -> (Vec<F::Item>, Outcome) {
    use tether_core::wire::FormatError;
    let mut decoder = StreamDecoder::new(format);
    let mut items = Vec::new();
    let mut errors = Vec::new();
    for (index, part) in parts.iter().enumerate() {
        match (feed, index % 2) {
            (Feed::Copy, _) | (Feed::InTurn, 0) => decoder.push(part),
            _ => decoder.push_bytes(Bytes::copy_from_slice(part)),
        }
        loop {
            match decoder.pop() {
                Ok(Some(item)) => items.push(item),
                Ok(None) => break,
                // Frame-local errors leave the stream usable: keep decoding past them.
                Err(error) if !error.error.is_fatal() => {
                    errors.push((error.error.kind(), error.offset));
                }
                Err(error) => {
                    let outcome = Outcome {
                        items: items.len(),
                        errors,
                        offset: error.offset,
                        end: Some(error.error.kind()),
                    };
                    return (items, outcome);
                }
            }
        }
    }
    let end = decoder.finish().err().map(|error| error.error.kind());
    let outcome = Outcome {
        items: items.len(),
        errors,
        offset: decoder.offset(),
        end,
    };
    (items, outcome)
}

/// Decodes `bytes` whole and expects exactly `expected` with a clean end.
fn redecode<F: Format>(format: F, bytes: &[u8]) -> Vec<F::Item> {
    let mut decoder = StreamDecoder::new(format);
    decoder.push(bytes);
    let items: Vec<F::Item> =
        std::iter::from_fn(|| decoder.pop().expect("re-encoded bytes decode")).collect();
    decoder.finish().expect("re-encoded bytes end cleanly");
    items
}

/// Actor records.
pub fn actor(data: &[u8]) {
    let format = ActorDecoder::with_payload_bytes_max(4096);
    let items = decode_all(format.clone(), data);
    let mut bytes = Vec::new();
    for item in &items {
        assert!(item.payload().len() <= 4096);
        item.encode(4096, &mut bytes)
            .expect("a decoded record re-encodes");
    }
    assert_eq!(redecode(format, &bytes), items);
}

/// Telemetry streams.
pub fn telemetry(data: &[u8]) {
    let items = decode_all(TelemetryDecoder::default(), data);
    let mut bytes = BytesMut::new();
    for item in &items {
        match item {
            TelemetryItem::Header(header) => header.encode(&mut bytes).expect("re-encodes"),
            TelemetryItem::ChannelDeclared(channel) => {
                encode_channel_declared(channel, &mut bytes).expect("re-encodes")
            }
            TelemetryItem::Batch(batch) => {
                let frames: Vec<_> = batch.frames().collect();
                assert_eq!(frames.len(), batch.len());
                encode_batch(&frames, Compression::None, &mut bytes).expect("re-encodes")
            }
            TelemetryItem::StreamEnded => encode_stream_ended(&mut bytes),
        }
    }
    if items.is_empty() {
        return;
    }
    let again = redecode(TelemetryDecoder::default(), &bytes);
    assert_eq!(again.len(), items.len());
    for (a, b) in again.iter().zip(&items) {
        match (a, b) {
            (TelemetryItem::Batch(a), TelemetryItem::Batch(b)) => {
                assert!(a.frames().eq(b.frames()))
            }
            (a, b) => assert_eq!(a, b),
        }
    }
}

/// Bifaci frames.
pub fn bifaci(data: &[u8]) {
    let items = decode_all(BifaciDecoder::default(), data);
    let mut bytes = Vec::new();
    for item in &items {
        item.encode(usize::MAX, &mut bytes)
            .expect("a decoded frame re-encodes");
    }
    assert_eq!(redecode(BifaciDecoder::default(), &bytes), items);
    // The body decoder alone, on the raw input.
    if let Ok(frame) = Frame::decode_body(&Bytes::copy_from_slice(data)) {
        assert_eq!(
            Frame::decode_body(&Bytes::from(frame.encode_body())),
            Ok(frame)
        );
    }
}

/// Substrate envelopes.
pub fn envelope(data: &[u8]) {
    let items = decode_all(EnvelopeDecoder, data);
    let mut bytes = Vec::new();
    for item in &items {
        item.encode(&mut bytes)
            .expect("a decoded envelope re-encodes");
    }
    assert_eq!(redecode(EnvelopeDecoder, &bytes), items);
    if let Ok(envelope) = Envelope::decode_frame(&Bytes::copy_from_slice(data)) {
        let mut bytes = Vec::new();
        envelope.encode(&mut bytes).expect("re-encodes");
        let again = Envelope::decode_frame(&Bytes::from(bytes).split_off(4));
        assert_eq!(again, Ok(envelope));
    }
}

/// The log store's entries: each decoded entry re-encodes to exactly the bytes it came from
/// (the format has one spelling per entry), in version 1 and in version 2 with the salt the
/// first 8 bytes give; the header check never panics.
pub fn log(data: &[u8]) {
    use tether_core::substrate::log::{
        decode_entry, decode_header, encode_begin, encode_commit, encode_record, Entry, LogFormat,
    };
    let _ = decode_header(data);
    let salt = data.get(..8).map_or(0, |salt| {
        u64::from_le_bytes(salt.try_into().expect("8 bytes"))
    });
    for format in [LogFormat::V1, LogFormat::new(salt)] {
        let mut rest = data;
        while let Ok(Some((entry, used))) = decode_entry(format, rest) {
            assert!(
                used <= rest.len(),
                "an entry never claims more than it was given"
            );
            let mut again = Vec::new();
            match &entry {
                Entry::Begin { peer } => encode_begin(format, peer, &mut again),
                Entry::Record(record) => encode_record(format, record, &mut again),
                Entry::Commit => encode_commit(format, &mut again),
            }
            assert_eq!(again, &rest[..used], "one spelling per entry");
            rest = &rest[used..];
        }
    }
}

/// Whole log files through the scan the store replays with: every commit handed over lies
/// inside the file, in order, after the header and before `end`; damage lies between commits
/// and before `end`; the tail is what follows `end`. Rewriting the commits found (as a repair
/// does) gives a file that scans sound, to the same commits.
pub fn log_file(data: &[u8]) {
    use tether_core::substrate::log::{
        encode_begin, encode_commit, encode_header, encode_record, scan, ScannedCommit,
    };
    let mut commits: Vec<ScannedCommit> = Vec::new();
    let plain = scan(data, |commit| commits.push(commit));
    // A compaction's scan (bodies as slices of the buffer) finds exactly what a scan finds.
    let shared = bytes::Bytes::copy_from_slice(data);
    let mut sliced: Vec<ScannedCommit> = Vec::new();
    assert_eq!(
        tether_core::substrate::log::scan_shared(&shared, |commit| sliced.push(commit)),
        plain
    );
    assert_eq!(sliced, commits);
    let Ok(Some(found)) = plain else {
        return;
    };
    let total = data.len() as u64;
    assert!(found.end <= total && found.tail == total - found.end);
    assert_eq!(found.commits, commits.len() as u64);
    let mut last = found.format.header_bytes() as u64;
    let mut damage = found.damaged.iter().peekable();
    for commit in &commits {
        while let Some(range) = damage.next_if(|range| range.start < commit.at.start) {
            assert!(
                range.start >= last && range.end <= commit.at.start,
                "damage between commits"
            );
            last = range.end;
        }
        assert!(commit.at.start >= last, "commits in order, apart");
        last = commit.at.end;
    }
    assert!(damage.next().is_none(), "no damage after the last commit");
    assert_eq!(last, found.end);
    // Each record's entry lies inside its commit, in order, and verifies as its row's record
    // where a compaction would copy it from; the index of the scan names exactly the rows the
    // replayed state holds.
    let mut index = tether_core::substrate::log::LogIndex::new();
    let mut states: std::collections::BTreeMap<String, tether_core::substrate::DurableState> =
        std::collections::BTreeMap::new();
    for commit in &commits {
        assert_eq!(commit.records.len(), commit.records_at.len());
        let mut from = commit.at.start;
        for (record, at) in commit.records.iter().zip(&commit.records_at) {
            assert!(
                at.start >= from && at.end < commit.at.end,
                "records in order, inside"
            );
            from = at.end;
            if !record.removes() {
                let entry = &data[at.start as usize..at.end as usize];
                assert_eq!(
                    tether_core::substrate::log::verify_entry(
                        found.format,
                        &record.row_key(),
                        at,
                        entry
                    )
                    .as_ref(),
                    Ok(record)
                );
            }
        }
        index.scanned(commit);
        states
            .entry(commit.peer.clone())
            .or_default()
            .apply_records(&commit.records);
    }
    assert_eq!(
        index.rows(),
        states
            .values()
            .map(tether_core::substrate::DurableState::row_count)
            .sum::<usize>()
    );
    let mut rewritten = Vec::new();
    encode_header(found.format, &mut rewritten);
    for commit in &commits {
        encode_begin(found.format, &commit.peer, &mut rewritten);
        for record in &commit.records {
            encode_record(found.format, record, &mut rewritten);
        }
        encode_commit(found.format, &mut rewritten);
    }
    let mut again = Vec::new();
    let rescanned = scan(&rewritten, |commit| again.push(commit))
        .expect("a header it wrote")
        .expect("a whole header");
    assert!(rescanned.is_sound() && rescanned.tail == 0);
    assert_eq!(
        again
            .iter()
            .map(|c| (&c.peer, &c.records))
            .collect::<Vec<_>>(),
        commits
            .iter()
            .map(|c| (&c.peer, &c.records))
            .collect::<Vec<_>>()
    );
}

/// Stateful: the first byte picks the ring size (1–8), every later byte one table op; core and
/// the reference model run in lockstep and every lifecycle law is checked after each op.
pub fn request_table(data: &[u8]) {
    let Some((&keep, ops)) = data.split_first() else {
        return;
    };
    let keep = std::num::NonZeroUsize::new(usize::from(keep % 8) + 1).expect("1..=8");
    let mut lockstep = tether_formal_replay::explore::TableLockstep::new(keep);
    for op in ops {
        if let Err(law) = lockstep.apply(*op) {
            panic!("request table: {law}");
        }
    }
}

/// Stateful: the first two bytes pick the window (0–65535), every later byte one window op;
/// core and the model run in lockstep and the grant laws are checked after each op.
pub fn credit_window(data: &[u8]) {
    let [high, low, ops @ ..] = data else { return };
    let mut lockstep =
        tether_formal_replay::explore::WindowLockstep::new(u32::from(u16::from_be_bytes([
            *high, *low,
        ])));
    for op in ops {
        if let Err(law) = lockstep.apply(*op) {
            panic!("credit window: {law}");
        }
    }
}

/// Stateful: one substrate machine fed an arbitrary mix of frames (decoded from the input by
/// the real envelope decoder), app commands, persistence reports, link changes and time. It
/// must never panic, and what it keeps stays within the configured bounds.
pub fn substrate(data: &[u8]) {
    use std::sync::Arc;
    use tether_core::substrate::{AllowAll, Authorizer, BatchId, Config, Machine, PeerId};
    use tether_core::time::Time;
    use tether_core::wire::envelope::ObjKind;

    let config = Config {
        in_flight_max: 4,
        receive_window: 8,
        objects_max: 4,
        outbox_ops_max: 8,
        // Renewed every other op: sends often wait for a renewal's commit.
        seq_reserve: 4,
        ..Config::default()
    };
    let mut machine = Machine::new(
        PeerId::new("peer"),
        config.clone(),
        Arc::new(Authorizer::new(AllowAll)),
        1,
    );
    let mut now = 0u64;
    let mut emitted = 0u64;
    let mut decoder = StreamDecoder::new(EnvelopeDecoder);
    let mut rest = data;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        let at = Time::from_millis(now);
        let name = ["a", "b", "c", "d", "e"][usize::from(op >> 5) % 5];
        match op % 12 {
            0 => machine.handle_link_up(at),
            1 => machine.handle_link_down(at),
            2 => {
                now += u64::from(op) * 1_000;
                machine.handle_timeout(Time::from_millis(now));
            }
            3 => machine.handle_persisted(at, BatchId(emitted)),
            4 => drop(machine.open(at, ObjKind::Queue, name, None)),
            5 => drop(machine.send(at, name, Bytes::from_static(b"x"))),
            6 => drop(machine.accept(at, name)),
            7 => drop(machine.close(at, name, "bye")),
            _ => {
                // Wire bytes: the next chunk of the input, its length given by one byte.
                let Some((&len, tail)) = rest.split_first() else {
                    break;
                };
                let len = usize::from(len).min(tail.len());
                decoder.push(&tail[..len]);
                rest = &tail[len..];
                while let Ok(Some(frame)) = decoder.pop() {
                    machine.handle_frame(at, frame);
                }
            }
        }
        while let Some(batch) = machine.poll_persist() {
            emitted = batch.id.0;
        }
        while machine.poll_transmit().is_some() {}
        while machine.poll_event().is_some() {}
        let stats = machine.stats();
        // Sends, reqs and answers stop at the bound; open, accept/reject and close add one each.
        let bound = config.outbox_ops_max as u64 + 2;
        assert!(stats.outbox_depth.values().all(|depth| *depth <= bound));
    }
}

/// Telemetry subscription control bytes: decoding is total, strict and bounded (whatever
/// decodes encodes back to exactly the same bytes); a source's table fed them never panics
/// and never holds more subscriptions than it was asked to start.
pub fn telemetry_control(data: &[u8]) {
    use tether_core::driver::subscriptions::{Control, ControlVerdict, Subscriptions};

    if let Ok(control) = Control::decode(data) {
        assert_eq!(control.encode().as_deref(), Some(data));
    }
    let mut table = Subscriptions::default();
    table.add_stream("cpu");
    let (verdict, _) = table.apply(tether_core::driver::NodeId::new([1; 32]), data);
    assert_eq!(
        table.live(),
        usize::from(verdict == ControlVerdict::Started)
    );
}

/// Host claim bytes: decoding is total and exact (whatever decodes is exactly `CLAIM_BYTES`
/// or `CLAIM_WITH_HANDOFF_BYTES` long and encodes back to the same bytes); a directory fed any
/// bytes, from their claimed host or from another peer (the first input byte says which),
/// never panics, takes only claims whose signatures verify, sent by their host, at a
/// generation within the ceiling, and holds one route at most.
pub fn host_claim(data: &[u8]) {
    use tether_core::driver::directory::{
        ClaimVerdict, Directory, HostClaim, CLAIM_BYTES, CLAIM_WITH_HANDOFF_BYTES,
    };
    use tether_core::limits::CLAIM_GENERATION_MAX;

    let Some((&choice, data)) = data.split_first() else {
        return;
    };
    let decoded = HostClaim::decode(data);
    if let Ok(claim) = &decoded {
        assert!(data.len() == CLAIM_BYTES || data.len() == CLAIM_WITH_HANDOFF_BYTES);
        assert_eq!(&claim.encode()[..], data);
    }
    let from = match &decoded {
        Ok(claim) if choice & 1 == 0 => claim.host,
        _ => tether_core::driver::NodeId::new([choice; 32]),
    };
    let mut directory = Directory::default();
    let verdict = directory.apply_bytes(&from, data);
    let takeable = decoded.is_ok_and(|claim| {
        claim.verify() && claim.host == from && claim.generation <= CLAIM_GENERATION_MAX
    });
    assert_eq!(verdict == ClaimVerdict::Accepted, takeable);
    assert!(directory.route_count() <= 1);
}

/// Stateful: three transport driver machines with dials, joins and batch writes completing
/// or failing when the input says, connections killed with delayed close reports, idle
/// writers, disconnects, closes and time; opens of streams on every channel; host claims
/// registered, handed off, announced, replayed, carried by other nodes and forged; telemetry
/// subscriptions. Every law of
/// `tether_core::driver::harness::run_ops` must hold (admission, one dial per peer,
/// generation-scoped eviction, SWIM feedback, frame accounting and order, opens' accounting,
/// route views that follow the claims, publishers that follow the subscriptions, liveness
/// after healing).
pub fn driver(data: &[u8]) {
    if let Err(law) = tether_core::driver::harness::run_ops(data) {
        panic!("driver: {law}");
    }
}

/// Stateful: a request switch with three masters driven by arbitrary engine requests, peer
/// requests, master frames (right, wrong and missing XIDs, any seq), cancels, stop-feeds,
/// closes, reattaches and time. It must never panic, every frame it writes must pass the
/// emission checker per flow, and no ended request may stay in its table.
pub fn switch(data: &[u8]) {
    if let Err(law) = tether_core::switch::harness::run_ops(data) {
        panic!("switch: {law}");
    }
}

/// Cap, media and tagged URN text: every UTF-8 input either parses or is refused with an
/// offset inside it; whatever parses prints canonical text that parses back to the same value
/// and prints identically again. A parsed cap dispatches to, and ranks first for, itself.
pub fn cap_urn(data: &[u8]) {
    use tether_core::cap::{is_dispatchable, rank, CapUrn, MediaUrn, TaggedUrn};

    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    check_urn(text, TaggedUrn::parse);
    check_urn(text, MediaUrn::parse);
    if let Some(cap) = check_urn(text, CapUrn::parse) {
        assert!(is_dispatchable(&cap, &cap));
        assert_eq!(rank(&cap, std::slice::from_ref(&cap), Some(&cap)), vec![0]);
    }
}

/// Parses `text` with `parse` and checks the parse → print → parse laws; the value, if any.
fn check_urn<T: std::fmt::Display + std::fmt::Debug + PartialEq>(
    text: &str,
    parse: impl Fn(&str) -> Result<T, tether_core::cap::ParseError>,
) -> Option<T> {
    match parse(text) {
        Ok(value) => {
            let printed = value.to_string();
            let again = parse(&printed).expect("canonical text parses");
            assert_eq!(again, value, "{text:?} printed as {printed:?}");
            assert_eq!(again.to_string(), printed, "printing is stable");
            Some(value)
        }
        Err(error) => {
            assert!(error.offset <= text.len(), "{text:?}: {error}");
            None
        }
    }
}

/// The stream transports' preamble: decoding is total, bounded (never more than
/// `PREAMBLE_BYTES_MAX` bytes) and exact (whatever decodes encodes back to the bytes it took).
pub fn preamble(data: &[u8]) {
    use tether_core::substrate::preamble::{decode_preamble, encode_preamble, PREAMBLE_BYTES_MAX};
    if let Ok(Some((preamble, used))) = decode_preamble(data) {
        assert!(used <= data.len() && used <= PREAMBLE_BYTES_MAX);
        let mut again = Vec::new();
        encode_preamble(&preamble.dialer, &preamble.nonce, &mut again).expect("it decoded");
        assert_eq!(again, &data[..used]);
    }
}

/// A substrate link's handshake and framing: a listener's link fed arbitrary bytes never
/// panics, is never up without a proof made with its key (the input cannot hold one: it
/// never sees the listener's fresh nonce), and every close it asks for is typed. Then two
/// honest sides with the key the input gives always come up, with the same tuple.
pub fn substrate_handshake(data: &[u8]) {
    use std::sync::Arc;
    use tether_core::substrate::handshake::{Auth, Channel, Handshake, Progress, Role};
    use tether_core::substrate::{
        capabilities, AllowAll, Authorizer, Config, Machine, PeerId, PeerLink,
    };
    use tether_core::time::Time;
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let (key, bytes) = rest.split_at(usize::from(split).min(rest.len()).min(32));
    let auth = Auth::SharedKey(key.to_vec());
    let channel = Channel {
        conn_id: b"fuzz".to_vec(),
        binding: Vec::new(),
    };
    let machine = Machine::new(
        PeerId::new("peer"),
        Config::default(),
        Arc::new(Authorizer::new(AllowAll)),
        1,
    );
    let mut link = PeerLink::new(machine, auth.clone(), Vec::new());
    link.link_up(Time::ZERO, Role::Listener, channel.clone(), vec![9; 16]);
    for chunk in bytes.chunks(7) {
        link.handle_bytes(Time::from_millis(1), Bytes::copy_from_slice(chunk));
        assert!(!link.is_up(), "up without a proof made with the key");
    }
    let _ = link.poll_close();
    let window = Config::default().receive_window;
    let caps = || capabilities(&auth, Vec::new(), window);
    let mut dialer = Handshake::start(
        Time::ZERO,
        Role::Dialer,
        auth.clone(),
        caps(),
        channel.clone(),
        vec![1; 16],
    );
    let mut listener = Handshake::start(
        Time::ZERO,
        Role::Listener,
        auth.clone(),
        caps(),
        channel,
        vec![2; 16],
    );
    let (mut dialer_done, mut listener_done) = (None, None);
    for _ in 0..4 {
        while let Some(frame) = dialer.poll_transmit() {
            if let Progress::Ready(tuple) =
                listener.handle_frame(Time::ZERO, &frame).expect("honest")
            {
                listener_done = Some(tuple);
            }
        }
        while let Some(frame) = listener.poll_transmit() {
            if let Progress::Ready(tuple) = dialer.handle_frame(Time::ZERO, &frame).expect("honest")
            {
                dialer_done = Some(tuple);
            }
        }
    }
    assert!(dialer_done.is_some() && dialer_done == listener_done);
}

/// Stateful: the switch host machine after a valid POLICY, fed arbitrary frames (decoded from
/// the input by the real bifaci decoder), the application's ends and abandons, and time. It
/// never panics; every request it reports ends at most once (ended + cancelled never pass the
/// requests); what it holds stays within its bound; a timeout error leaves nothing held.
pub fn switch_host(data: &[u8]) {
    use tether_core::limits::SWITCH_SERVED_REQUESTS_MAX;
    use tether_core::switch::ask::HostAsk;
    use tether_core::switch::host::{Host, HostConfig, HostEvent};
    use tether_core::time::Time;
    use tether_core::wire::bifaci::{FrameType, NetworkPolicy};
    const CAP: &str = "cap:in=media:text;out=media:upper";
    let mut host = Host::new(
        HostConfig::new("fuzz", vec![CAP.to_owned()], [3; 8]),
        Time::ZERO,
    );
    host.ask_frame(Time::ZERO, NetworkPolicy::Full.to_frame())
        .expect("a valid policy");
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    let mut live = Vec::new();
    let mut now = 0u64;
    let mut rest = data;
    while let Some((&op, tail)) = rest.split_first() {
        rest = tail;
        let at = Time::from_millis(now);
        let closed = match op % 6 {
            0 => {
                now += u64::from(op) * 500;
                host.ask_timeout(Time::from_millis(now)).is_err()
            }
            1 | 2 => {
                if let Some(key) = live.pop() {
                    if op % 6 == 1 {
                        let _ = host.write(key, Frame::new(FrameType::End, key.rid));
                    } else {
                        host.abandon(key);
                    }
                }
                false
            }
            _ => {
                let Some((&len, tail)) = rest.split_first() else {
                    break;
                };
                let len = usize::from(len).min(tail.len());
                decoder.push(&tail[..len]);
                rest = &tail[len..];
                let mut closed = false;
                while let Ok(Some(frame)) = decoder.pop() {
                    closed |= host.ask_frame(at, frame).is_err();
                }
                closed
            }
        };
        while host.poll_transmit().is_some() {}
        while let Some(event) = host.poll_event() {
            if let HostEvent::Request { key, .. } = event {
                live.push(key);
            }
        }
        let stats = host.stats();
        assert!(stats.ended + stats.cancelled <= stats.requests, "{stats:?}");
        assert!(host.served_len() <= SWITCH_SERVED_REQUESTS_MAX);
        if closed {
            // The connection is over (the shell closes it): nothing more is driven.
            return;
        }
    }
}

/// RELAY_NOTIFY metas and manifests from arbitrary frames: `RelayNotify::from_meta` and
/// `manifest_caps` are total (a typed error or a value, never a panic), and a RELAY_NOTIFY that
/// decodes encodes to a meta that decodes to the same RELAY_NOTIFY.
pub fn switch_hello(data: &[u8]) {
    use tether_core::switch::{manifest_caps, RelayNotify};
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    decoder.push(data);
    while let Ok(Some(frame)) = decoder.pop() {
        if let Ok(notify) = RelayNotify::from_meta(frame.meta.as_ref()) {
            let again =
                RelayNotify::from_meta(Some(&notify.to_meta())).expect("what decoded encodes");
            assert_eq!(again, notify);
        }
        if let Some(payload) = &frame.payload {
            let _ = manifest_caps(payload);
        }
    }
    let _ = manifest_caps(data);
}

/// The authorize chain: a scope policy built from the input judges ops built from the input
/// exactly as a plain reading of deny-by-default says (an unknown peer is refused; a known
/// one is allowed when one of its scopes allows the verb or `*`), never panicking; a chain
/// with a denying interceptor after it refuses whatever it allows.
pub fn authorize(data: &[u8]) {
    use std::collections::BTreeMap;
    use tether_core::substrate::{AuthorizeContext, Authorizer, Denial, PeerId, ScopeAuthorizer};
    use tether_core::wire::envelope::Verb;
    let Some((&shape, rest)) = data.split_first() else {
        return;
    };
    let peers = ["a", "b", "c", "d"];
    let scopes = ["read", "write", "admin"];
    // Who holds which scopes: the first bytes, one per peer (bit i: scope i; 0x80: unknown).
    let holdings: BTreeMap<&str, Option<Vec<&str>>> = peers
        .iter()
        .enumerate()
        .map(|(i, peer)| {
            let bits = rest.get(i).copied().unwrap_or(0);
            let held = (bits & 0x80 == 0).then(|| {
                scopes
                    .iter()
                    .enumerate()
                    .filter(|(s, _)| bits & (1 << s) != 0)
                    .map(|(_, s)| *s)
                    .collect()
            });
            (*peer, held)
        })
        .collect();
    // Which verbs each scope allows: the next bytes (bit per verb; 0x40: "*").
    let matrix: BTreeMap<&str, Vec<String>> = scopes
        .iter()
        .enumerate()
        .map(|(i, scope)| {
            let bits = rest.get(4 + i).copied().unwrap_or(0);
            let mut verbs: Vec<String> = Verb::ALL
                .iter()
                .enumerate()
                .filter(|(v, _)| *v < 6 && bits & (1 << v) != 0)
                .map(|(_, verb)| verb.as_str().to_owned())
                .collect();
            if bits & 0x40 != 0 {
                verbs.push("*".to_owned());
            }
            (*scope, verbs)
        })
        .collect();
    let owned: BTreeMap<String, Option<Vec<String>>> = holdings
        .iter()
        .map(|(peer, held)| {
            (
                (*peer).to_owned(),
                held.as_ref()
                    .map(|h| h.iter().map(|s| (*s).to_owned()).collect()),
            )
        })
        .collect();
    let policy = ScopeAuthorizer::new(
        move |peer: &PeerId| owned.get(peer.as_str()).cloned().flatten(),
        matrix
            .iter()
            .map(|(scope, verbs)| ((*scope).to_owned(), verbs.clone())),
    );
    let chain = Authorizer::new(policy);
    for &byte in rest.iter().skip(7) {
        let peer = PeerId::new(if byte & 0x80 != 0 {
            "stranger"
        } else {
            peers[usize::from(byte) % 4]
        });
        let verb = Verb::ALL[usize::from(byte >> 2) % Verb::ALL.len()];
        let ctx = AuthorizeContext {
            peer: &peer,
            verb,
            obj: "q",
            obj_kind: None,
            cap: None,
        };
        let expected = holdings
            .get(peer.as_str())
            .cloned()
            .flatten()
            .is_some_and(|held| {
                held.iter().any(|scope| {
                    matrix[scope]
                        .iter()
                        .any(|allowed| allowed == "*" || allowed == verb.as_str())
                })
            });
        assert_eq!(
            chain.check(&ctx).is_ok(),
            expected,
            "{} {}",
            peer.as_str(),
            verb.as_str()
        );
    }
    let _ = shape;
    let denying = Authorizer::new(|_: &AuthorizeContext<'_>| Err(Denial::scope_denied()));
    let peer = PeerId::new("a");
    let ctx = AuthorizeContext {
        peer: &peer,
        verb: Verb::Send,
        obj: "q",
        obj_kind: None,
        cap: None,
    };
    assert!(denying.check(&ctx).is_err());
}

/// A substrate peer's life (`core::substrate::peer::Peer`). The first half of the input is a
/// `peer` conformance case (events and times), replayed on core and on the reference model,
/// which must agree step for step. The second half drives the peer directly with any input in
/// any order (answers nobody asked for, stale generations, commands that wait or not,
/// shutdown): it must never panic, never ask for a second commit or dial while one is out,
/// and bind connections under generations that only grow.
pub fn peer(data: &[u8]) {
    use tether_core::substrate::peer::{Command, DialFailed, Dialed, Output, Peer, StoreFault};
    use tether_core::substrate::{AllowAll, Authorizer, Config, Machine, PeerId, PeerLink};
    use tether_core::time::Time;
    use tether_core::wire::envelope::ObjKind;
    use tether_formal_replay::peer::{blank_case, core_peer, model_peer, PeerEvent, ALPHABET};

    let (first, second) = data.split_at(data.len() / 2);
    // Differential: core against the model.
    let mut at = 0u64;
    let events: Vec<PeerEvent> = first
        .iter()
        .skip(1)
        .take(64)
        .map(|byte| {
            at += [0, 7, 60, 400, 3_000, 11_000][usize::from(byte >> 5) % 6];
            PeerEvent {
                at,
                event: ALPHABET[usize::from(byte & 0x0f) % ALPHABET.len()],
            }
        })
        .collect();
    let (seed, dialable) = match first.first() {
        Some(byte) => (u64::from(*byte), byte & 0x80 == 0),
        None => (0, true),
    };
    let case = blank_case(seed, dialable, events);
    let core = core_peer(&case).expect("core runs every well-formed case");
    let model = model_peer(&case).expect("the model runs every well-formed case");
    assert_eq!(
        core.steps, model.steps,
        "core and the model disagree on {case:?}"
    );

    // Anything, in any order.
    let link = || {
        let machine = Machine::new(
            PeerId::new("b"),
            Config::default(),
            std::sync::Arc::new(Authorizer::new(AllowAll)),
            3,
        );
        PeerLink::new(
            machine,
            tether_core::substrate::handshake::Auth::None,
            Vec::new(),
        )
    };
    let mut peer = Peer::new(PeerId::new("b"), true, true, 5);
    let (mut commit_out, mut dial_out, mut generation) = (false, false, 0u64);
    let mut now = 0u64;
    let mut ticket = 0u64;
    for (index, byte) in second.iter().enumerate() {
        now += u64::from(byte >> 4) * 37;
        let at = Time::from_millis(now);
        let obj = tether_core::substrate::ObjName::new(
            ["q0", "q1", "bad name"][usize::from(byte >> 6) % 3],
        );
        ticket += 1;
        match byte & 0x0f {
            0 => peer.handle_loaded(at, Ok(link())),
            1 => peer.handle_loaded(at, Err(StoreFault)),
            2 => {
                if std::mem::take(&mut commit_out) || byte & 0x10 != 0 {
                    peer.handle_committed(at, Ok(()));
                }
            }
            3 => {
                if std::mem::take(&mut commit_out) || byte & 0x10 != 0 {
                    peer.handle_committed(at, Err(StoreFault));
                }
            }
            4 => {
                dial_out = false;
                let dialed = Dialed {
                    channel: tether_core::substrate::handshake::Channel {
                        conn_id: vec![byte & 3],
                        binding: Vec::new(),
                    },
                    nonce: vec![*byte; 16],
                };
                peer.handle_dialed(at, Ok(dialed));
            }
            5 => {
                dial_out = false;
                peer.handle_dialed(at, Err(DialFailed));
            }
            6 => peer.handle_timeout(at),
            7 => peer.handle_link_closed(at, u64::from(byte >> 4)),
            8 => peer.handle_link_bytes(
                at,
                peer.generation(),
                bytes::Bytes::copy_from_slice(&second[index..(index + 8).min(second.len())]),
            ),
            9 => peer.handle_command(
                at,
                ticket,
                Command::Open {
                    kind: ObjKind::Queue,
                    obj,
                    cap: None,
                },
            ),
            10 => peer.handle_command(
                at,
                ticket,
                Command::Send {
                    obj,
                    body: bytes::Bytes::from_static(b"x"),
                    wait: byte & 0x10 != 0,
                },
            ),
            11 => peer.handle_command(
                at,
                ticket,
                Command::Close {
                    obj,
                    reason: String::new(),
                },
            ),
            12 => peer.handle_reachability(byte & 0x10 != 0, byte & 0x20 != 0),
            13 => peer.handle_reach(at),
            14 => peer.handle_disconnect(at),
            _ => peer.handle_shutdown(at),
        }
        while let Some(output) = peer.poll_output() {
            match output {
                Output::Commit(batches) => {
                    assert!(!commit_out, "a second commit while one is out");
                    assert!(!batches.is_empty(), "an empty commit");
                    commit_out = true;
                }
                Output::Dial { .. } => {
                    assert!(!dial_out, "a second dial while one is out");
                    dial_out = true;
                }
                Output::Bind { generation: next } => {
                    assert!(next > generation, "generations only grow");
                    generation = next;
                }
                _ => {}
            }
        }
        let mut out = BytesMut::new();
        while peer.poll_transmit(&mut out) && out.len() < 1 << 20 {}
        if peer.finished() {
            peer.finish(at);
            while peer.poll_output().is_some() {}
            return;
        }
    }
}
