//! Every bound tether enforces, in one place.
//!
//! Units come last in each name (`_bytes_max`, `_count_max`). Each constant says why it has the
//! value it has; a decoder or machine that needs a bound names one of these instead of writing a
//! number.

/// Largest actor-record type tag: a longer one is rejected (docs/spec/driver.md §3.1).
pub const ACTOR_TAG_BYTES_MAX: usize = 1024;

/// Default bound on an actor-record payload. docs/spec/driver.md §3.1: the original used 64 KiB;
/// tether makes the bound a decoder setting and defaults to 1 MiB, room for any gossip or
/// application message that should travel inline rather than as a byte stream.
pub const ACTOR_PAYLOAD_BYTES_DEFAULT: usize = 1024 * 1024;

/// Hard ceiling for the actor payload setting: one record is buffered whole before it is
/// delivered, so the setting may not make a single peer able to pin more than this.
pub const ACTOR_PAYLOAD_BYTES_CEILING: usize = 16 * 1024 * 1024;

/// Longest unsigned varint, in bytes (multiformats unsigned-varint: at most 9 bytes, 63 bits).
pub const VARINT_BYTES_MAX: usize = 9;

/// Largest value an unsigned varint can carry: 9 groups of 7 bits.
pub const VARINT_VALUE_MAX: u64 = (1 << 63) - 1;

/// Bound on every telemetry record and every decoded (decompressed) batch.
/// docs/spec/driver.md §5.4: every record, and every batch once decompressed, is at most 16 MiB.
pub const TELEMETRY_RECORD_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Largest telemetry header token: its length travels as a `u16` (docs/spec/driver.md §5.4).
pub const TELEMETRY_TOKEN_BYTES_MAX: usize = u16::MAX as usize;

/// The writer closes a batch once its raw entries reach this many bytes (docs/spec/driver.md
/// §5.3).
pub const TELEMETRY_BATCH_BYTES_TARGET: usize = 256 * 1024;

/// The writer closes a batch once it holds this many events (docs/spec/driver.md §5.3).
pub const TELEMETRY_BATCH_EVENTS_MAX: usize = 1024;

/// Most channel descriptors a header snapshot may list. Descriptors decode into owned
/// structures; this keeps the memory a header costs proportional to a sane channel count rather
/// than to the 16 MiB record bound (a 2-byte descriptor would otherwise cost ~100 bytes each).
pub const TELEMETRY_HEADER_CHANNELS_MAX: usize = 4096;

/// Most labels one stream or channel descriptor may carry, for the same reason.
pub const TELEMETRY_LABELS_MAX: usize = 32;

/// zstd level of telemetry batches (docs/spec/driver.md §5.3: level 1).
pub const TELEMETRY_ZSTD_LEVEL: i32 = 1;

/// Default largest bifaci frame (docs/spec/switch.md §2.4: 3,670,016 bytes, a margin below
/// 3.75 MB).
pub const BIFACI_FRAME_BYTES_DEFAULT: usize = 3_670_016;

/// Hard ceiling for the bifaci frame setting (docs/spec/switch.md §2.4: 16 MiB).
pub const BIFACI_FRAME_BYTES_CEILING: usize = 16 * 1024 * 1024;

/// Deepest CBOR nesting accepted inside a bifaci `meta` map. Skipping a nested item recurses;
/// this bounds the stack a hostile frame can make the decoder use.
pub const CBOR_NESTING_DEPTH_MAX: usize = 16;

/// Largest substrate frame: length-prefixed type byte plus CBOR (docs/spec/substrate.md §3:
/// 1 MiB).
pub const ENVELOPE_FRAME_BYTES_MAX: usize = 1024 * 1024;

/// QUIC bidirectional streams a peer may have open at once on one connection (set explicitly:
/// each can hold [`QUIC_STREAM_RECEIVE_WINDOW_BYTES`] unread).
pub const QUIC_STREAMS_BIDI_MAX: u32 = 100;

/// QUIC unidirectional streams a peer may have open at once on one connection.
pub const QUIC_STREAMS_UNI_MAX: u32 = 100;

/// Bytes one QUIC stream may have in flight toward this node, unread.
pub const QUIC_STREAM_RECEIVE_WINDOW_BYTES: u32 = 1024 * 1024;

/// Bytes all the streams of one QUIC connection may have in flight toward this node, unread
/// (QUIC's default is unbounded: 100 streams at their window each): what one connection can
/// make this node buffer.
pub const QUIC_CONNECTION_RECEIVE_WINDOW_BYTES: u32 = 8 * 1024 * 1024;

/// Inbound QUIC handshakes a node runs at once; past it a new incoming connection is refused
/// before its handshake (stateless, no task), counted.
pub const QUIC_HANDSHAKES_IN_PROGRESS_MAX: usize = 128;

/// An inbound handshake not done within this is given up.
pub const QUIC_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;

/// Inbound TCP substrate connections whose preamble is being read at once (each within its 5 s
/// deadline); past it a new connection is closed unread. One source (IP address) holds at most
/// a quarter of them, as of every handshake bound (`driver::admission::Handshakes`).
pub const PREAMBLE_READS_IN_PROGRESS_MAX: usize = 256;

/// Connections peers dialed that a node keeps at once, over every peer and channel (each can
/// make it buffer [`QUIC_CONNECTION_RECEIVE_WINDOW_BYTES`]); past it a connection from a new
/// (peer, channel) is refused after its handshake, closed, counted (`refused_full`). A peer
/// holds at most one of them per channel: a newer one replaces and closes the older.
pub const QUIC_CONNECTIONS_INBOUND_MAX: usize = 1_024;

/// Bytes an answer (or a request's input) gathered whole may reach (`collect`, `read_all` of
/// `tether::switch`); past it `collect` fails `TooLarge` and `read_all` stops gathering.
/// Longer bodies are read frame by frame.
pub const SWITCH_COLLECT_BYTES_MAX: usize = 64 * 1024 * 1024;

/// A protocol stream's 8-byte id must arrive within this of the stream's opening; a stream
/// that stays silent is stopped (and holds up no other stream meanwhile).
pub const PROTOCOL_STREAM_ID_TIMEOUT_MS: u64 = 10_000;

/// When a decoder joins the bytes of an item that straddles two received buffers and the
/// format cannot tell the item's length yet (its header is cut), it joins as many bytes again
/// as it holds, and at least this many.
pub const DECODE_JOIN_STEP_BYTES: usize = 256;

/// Largest entry of the log store's file (one durable record: an op with its body, at most a
/// bulk chunk's worth, and its fields). A larger declared length is corruption.
pub const LOG_ENTRY_BYTES_MAX: usize = 1024 * 1024;

/// Largest inline substrate body (docs/spec/substrate.md §3: 64 KiB; larger payloads travel as
/// bulk chunks).
pub const ENVELOPE_INLINE_BODY_BYTES_MAX: usize = 64 * 1024;

/// Largest substrate bulk-chunk body (docs/spec/substrate.md §3: 256 KiB).
pub const ENVELOPE_CHUNK_BODY_BYTES_MAX: usize = 256 * 1024;

/// Longest substrate address (docs/spec/substrate.md §1.2: `[a-z0-9._/-]{1,128}`).
pub const ADDRESS_BYTES_MAX: usize = 128;

/// Most keys one envelope `env` map may carry: the seven core keys plus verb-specific keys.
/// Bounds the work and memory an envelope costs regardless of its byte length.
pub const ENVELOPE_ENV_KEYS_MAX: usize = 32;

/// Longest text value inside an envelope (`id`, `code`, `message`, `reason`, ...). A human
/// readable reason never needs more; op ids are ~26 characters.
pub const ENVELOPE_TEXT_BYTES_MAX: usize = 4096;

/// Default largest CHUNK payload a switch proposes in its HELLO (docs/spec/switch.md §2.4:
/// 256 KiB); larger responses are split into chunks of at most this size.
pub const BIFACI_CHUNK_BYTES_DEFAULT: usize = 256 * 1024;

/// Most caps one master's manifest may advertise. A host serves dozens; the bound keeps a
/// hostile manifest from growing the aggregate cap table (and every routing decision) without
/// limit.
pub const MANIFEST_CAPS_MAX: usize = 4096;

/// Most master slots one switch keeps. Slots are never freed (their index is the routing key),
/// so a host reconnecting under ever new ids is refused past this.
pub const SWITCH_MASTERS_MAX: usize = 256;

/// How long a master has to answer the switch's HELLO and pass the identity check, in
/// milliseconds (docs/spec/switch.md §2.4: 15 s).
pub const SWITCH_HANDSHAKE_TIMEOUT_MS: u64 = 15_000;

/// How often the switch sends a master a HEARTBEAT, in milliseconds (docs/spec/switch.md §2.4:
/// 30 s).
pub const SWITCH_HEARTBEAT_INTERVAL_MS: u64 = 30_000;

/// How long a master has to echo a HEARTBEAT before it is declared dead, in milliseconds
/// (docs/spec/switch.md §2.4: 10 s).
pub const SWITCH_HEARTBEAT_TIMEOUT_MS: u64 = 10_000;

/// Longest echo of the identity nonce the switch gathers (the nonce is 32 bytes at connect and
/// 7 in the runtime probe; anything longer is already wrong).
pub const SWITCH_IDENTITY_ECHO_BYTES_MAX: usize = 64;

/// Budget of the runtime identity probe, run when a master that joined capless advertises
/// caps (capdag's `RUNTIME_PROBE_TIMEOUT`, docs/spec/capdag-v6.md §11.4).
pub const SWITCH_IDENTITY_PROBE_TIMEOUT_MS: u64 = 10_000;

/// Most caps on one path `paths_to` reports (a planner composes a few transforms, never
/// dozens), and most paths it reports: the search is bounded whatever the cap graph.
pub const SWITCH_PATH_CAPS_MAX: usize = 4;

/// See [`SWITCH_PATH_CAPS_MAX`].
pub const SWITCH_PATHS_MAX: usize = 16;

/// Most requests one host serves at once (its peer's live-request bound, seen from the host):
/// a switch that opens requests without end is cut off instead of growing host memory.
pub const SWITCH_SERVED_REQUESTS_MAX: usize = 65_536;

/// Live peer requests one master may have made at once: its share of the switch's request
/// table, so one master flooding peer requests cannot lock out the engine and the others.
/// Past it a REQ is answered `QUOTA`.
pub const SWITCH_PEER_REQUESTS_PER_MASTER_MAX: usize = 4_096;

/// Frames a switch's shell queues for one master's socket. Credit bounds the CHUNKs, so only a
/// master that stops reading its socket fills this; past it the master is cut off
/// (`backlogged`) rather than let its queue grow.
pub const SWITCH_WRITER_FRAMES_MAX: usize = 65_536;

/// Frames a host's shell queues for its socket to the switch. Credit bounds the CHUNKs, so
/// only a switch that stops reading fills this; past it the host drops the connection
/// (`HostError::Backlogged`) rather than let its queue grow.
pub const SWITCH_HOST_WRITER_FRAMES_MAX: usize = 65_536;

/// Commands a host's handlers (writes, consumes, peer requests) and its handle may queue for
/// the host's task; a handler past it waits for room.
pub const SWITCH_HOST_COMMANDS_MAX: usize = 1_024;

/// Default initial per-stream credit window, in chunks (docs/spec/switch.md §2.4: 32 chunks). Both
/// sides propose a window; the smaller one is used.
pub const CREDIT_WINDOW_CHUNKS_DEFAULT: u64 = 32;

/// Default reorder-buffer bound per flow (docs/spec/switch.md §2.4: 64 per flow). A peer
/// that races further ahead than this is refused with `overflow` instead of pinning memory.
pub const REORDER_HELD_COUNT_DEFAULT: usize = 64;

/// Bytes of early flow frames one side of one request holds for reordering (the count bound is
/// [`REORDER_HELD_COUNT_DEFAULT`]). Frames of one request travel one QUIC stream, in order: an
/// honest peer never sends one early, so past it the peer is cut (`reorder` violation).
pub const SWITCH_REORDER_HELD_BYTES_MAX: usize = 1024 * 1024;

/// Bytes of early flow frames a switch host holds for reordering over all its requests; past it
/// the switch connection is cut, as past [`SWITCH_REORDER_HELD_BYTES_MAX`].
pub const SWITCH_HOST_REORDER_HELD_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Bytes of early flow frames the switch holds for reordering on behalf of one sender (a
/// master, or the engine) over all its live requests: the switch's side of
/// [`SWITCH_HOST_REORDER_HELD_BYTES_MAX`]. Past it the sender broke the protocol and is cut
/// (`reorder` violation), so a master holding frames early on many requests is bounded by this,
/// not by [`SWITCH_REORDER_HELD_BYTES_MAX`] times its live requests.
pub const SWITCH_PEER_REORDER_HELD_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Bytes of flow frames the switch holds on behalf of one sender (a master, or the engine)
/// because it wrote them past a stream's credit window, over all its live requests. capdag's
/// in-process cartridge host writes its answers without waiting for CREDIT; the switch holds
/// the excess and lets it go as the receiver grants credit. Past this share the sender is cut
/// (`credit_violation`), so a peer that never waits costs the switch at most this much.
pub const SWITCH_PEER_OVERRUN_HELD_BYTES_MAX: usize = 8 * 1024 * 1024;

/// Bytes of LOG frames handed to one request's reader and not read yet; past it a LOG frame is
/// dropped (counted: logs are diagnostics, and a reader that does not read them, or a peer
/// that floods them, must not make the host buffer without bound).
pub const SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX: usize = 256 * 1024;

/// Bytes of LOG frames handed to readers and not read yet over every request of a switch host
/// (each request within [`SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX`]); past it LOG frames are
/// dropped, counted.
pub const SWITCH_HOST_LOG_UNREAD_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Default size of the recently-terminated ring (docs/spec/switch.md §6.1: the 64 most recent
/// terminations). It is the horizon inside which a late frame counts as a benign straggler.
pub const TERMINATED_RING_COUNT_DEFAULT: usize = 64;

/// Hard ceiling for the ring setting: every summary is a few hundred bytes and the ring is
/// scanned for diagnostics, so a setting above this is a configuration mistake.
pub const TERMINATED_RING_COUNT_CEILING: usize = 65_536;

/// Default bound on live requests in one table. A misbehaving peer that opens requests without
/// ever ending them is refused with `TableFull` instead of exhausting memory.
pub const LIVE_REQUESTS_COUNT_DEFAULT: usize = 65_536;

/// Most streams tracked per request (flow stats and the emission checker). Real requests have a
/// handful of streams; beyond this a peer is refused instead of growing per-request state.
pub const STREAMS_PER_REQUEST_COUNT_MAX: usize = 1024;

/// Longest stream id the request machines keep (stream ids are short names such as `input`).
pub const STREAM_ID_BYTES_MAX: usize = 256;

/// Most cancel-cascade children one request may record (docs/spec/switch.md §5.3: peer calls
/// made on behalf of a request). Bounds the per-request child list a cartridge can grow.
pub const CHILDREN_PER_REQUEST_COUNT_MAX: usize = 1024;

/// Longest cancel or error message kept on a terminated summary; longer ones are cut on a
/// character boundary (the summary is diagnostics, not a data path).
pub const TERMINATION_MESSAGE_BYTES_MAX: usize = 1024;

/// Default in-flight window per substrate object: ops transmitted and not yet hop-acked.
/// Window 1 is the source design's stop-and-wait; per-object seqs keep FIFO for any window
/// (docs/spec/substrate.md §5, §11).
pub const SUBSTRATE_IN_FLIGHT_OPS_DEFAULT: usize = 32;

/// Default receive window per object (`W`): ops of the peer this side holds for one object,
/// delivered and not yet consumed plus held above the frontier. It is the peer's credit: the
/// peer never transmits an op this side could not hold.
///
/// Four times the default in-flight window: the ops of a group count against the window from
/// their arrival until the app consumes them, after their commit and delivery, so while one
/// group waits for its consumer the credit must still cover a whole in-flight window behind
/// it. At twice the in-flight window (64, as before) a consumer that kept up still stalled a
/// single queue on credit: measured with `tether-bench` (log store over iroh, 1 queue, window
/// 32, 1 KiB, six alternating rounds each, medians) 58.8k msg/s at 64 against 62.0k at 128 and
/// 63.5k at 256.
pub const SUBSTRATE_RECEIVE_WINDOW_DEFAULT: u64 = 128;

/// Most un-acked ops one object's outbox may hold (docs/spec/substrate.md §3: 1000 ops per object);
/// the next send is refused with `queue_full`.
pub const SUBSTRATE_OUTBOX_OPS_MAX: usize = 1000;

/// No honest peer sends a seq, floor, resync point or credit limit at or past this: it would
/// take 2^62 ops in one object (146 years at a billion a second). A frame that carries one is a
/// protocol violation: counted, dropped, and the link is cut, before any frontier moves; so
/// every sum of a seq and a window stays far from `u64::MAX`.
pub const SUBSTRATE_SEQ_MAX: u64 = 1 << 62;

/// Most live objects per peer (docs/spec/substrate.md §3: 200 sessions per peer); the next open is
/// refused with `quota`.
pub const SUBSTRATE_OBJECTS_PER_PEER_MAX: usize = 200;

/// Most bounce tombstones kept per peer. Each is an op id the frontier cannot answer for; a
/// peer spraying ops at unknown objects evicts its own oldest tombstones instead of growing
/// state (a duplicate of an evicted one bounces again, which is counted).
pub const SUBSTRATE_BOUNCES_MAX: usize = 4096;

/// A gap older than this triggers a `resync` (docs/spec/substrate.md §5: 30 s).
pub const SUBSTRATE_GAP_RESYNC_MS: u64 = 30_000;

/// Keepalive interval (docs/spec/substrate.md §3: every 30 s).
pub const SUBSTRATE_KEEPALIVE_MS: u64 = 30_000;

/// Silence after which a link is dead (docs/spec/substrate.md §3: 90 s).
pub const SUBSTRATE_DEAD_AFTER_MS: u64 = 90_000;

/// Queue TTL: an op that could not be sent for this long ends as `ttl_expired`
/// (docs/spec/substrate.md §3).
pub const SUBSTRATE_QUEUE_TTL_MS: u64 = 24 * 60 * 60 * 1000;

/// Default dedupe retention: tombstones and closed objects are kept this long
/// (docs/spec/substrate.md §6: ≥ 7 days). Never below the sender's resend horizon (the queue TTL).
pub const SUBSTRATE_DEDUPE_RETENTION_MS: u64 = 7 * 24 * 60 * 60 * 1000;

/// First delay before an op answered with a transient code is sent again; it doubles (with
/// jitter) on every further transient answer, up to [`SUBSTRATE_TRANSIENT_RETRY_CAP_MS`].
pub const SUBSTRATE_TRANSIENT_RETRY_MS: u64 = 1_000;

/// Longest delay between transient retries of one op: a peer that stays busy is asked again
/// twice a minute, not hammered, and not forgotten.
pub const SUBSTRATE_TRANSIENT_RETRY_CAP_MS: u64 = 30_000;

/// First redial delay of a substrate link; doubles with jitter up to
/// [`SUBSTRATE_REDIAL_CAP_MS`]. A flapping link is retried quickly, a dead peer rarely.
pub const SUBSTRATE_REDIAL_BASE_MS: u64 = 100;

/// Longest delay between redials of a substrate link.
pub const SUBSTRATE_REDIAL_CAP_MS: u64 = 10_000;

/// First delay before a failed store load or commit is tried again; doubles with jitter up to
/// [`SUBSTRATE_STORE_RETRY_CAP_MS`]. A disk that comes back is used within seconds.
pub const SUBSTRATE_STORE_RETRY_BASE_MS: u64 = 50;

/// Longest delay between retries of a failing store.
pub const SUBSTRATE_STORE_RETRY_CAP_MS: u64 = 5_000;

/// How often a peer's counters are published to `metrics`, at most (on the next input after
/// it passed: serializing them on every input would tax the hot path).
pub const SUBSTRATE_STATS_EVERY_MS: u64 = 1_000;

/// How long a peer started for an inbound link waits for that link once its state is loaded,
/// before it may end as idle. The shell hands the link in on the load's wake; the wait only
/// bounds a link that never comes (its task and state are freed after it).
pub const SUBSTRATE_ADOPT_WAIT_MS: u64 = 5_000;

/// A good capacity for a node's telemetry sink (a bounded channel the app creates): 1,024
/// items are at most 1,024 batches of ≤ 1,024 events, so a sink that falls that far behind
/// makes the publisher wait rather than the collector buffer.
pub const TELEMETRY_SINK_ITEMS_DEFAULT: usize = 1024;

/// A good capacity for a protocol binding's event sink: lifecycle events and inbound streams
/// an app has not taken yet; past it events are dropped and counted (best-effort,
/// docs/spec/driver.md §3.4) and a dropped inbound stream is closed.
pub const PROTOCOL_SINK_EVENTS_DEFAULT: usize = 1024;

/// Sends and requests that may wait for outbox room per object in a peer's task, beyond the
/// outbox itself. While an object has this many waiting, the task takes no new op commands from
/// the app (they wait in the ops lane, then in the callers' futures): a waiting `send` is never
/// refused, and an app that issues without awaiting holds its own backlog. Equal to the outbox
/// bound, so a waiting app has as much queued as in flight.
pub const SUBSTRATE_WAITING_SENDS_MAX: usize = 1000;

/// Op commands (open, send, req, close) queued from the app to one peer's task. Past it a new
/// command waits inside the caller's future, in issue order, and is withdrawn if the caller
/// drops it. Commands that answer a delivery (consume, answer, accept, reject) have their own
/// lane, bounded by what the peer delivered, and are never held back.
pub const SUBSTRATE_COMMANDS_MAX: usize = 1024;

/// Largest total of `res` bodies the shell gathers for one request before it ends the request
/// with `ReplyTooLarge` (a peer streaming answers forever cannot exhaust memory). 16 MiB is 256
/// full inline bodies.
pub const SUBSTRATE_REPLY_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Persist batches a peer's task keeps waiting for its store, beside the commit in flight (a
/// failed commit's batches wait again). Past half of it the task takes no new op commands from
/// the app; past all of it, it stops reading the link (the peer's writes back up in TCP or
/// QUIC), so neither an app nor a peer that keeps sending during an outage can grow them. A
/// commit takes every batch waiting when it starts, so the one in flight holds at most this
/// many and what a wake's inputs added. A batch is one input's records, so 1,024 covers a long
/// outage of normal traffic.
pub const SUBSTRATE_UNCOMMITTED_BATCHES_MAX: usize = 1024;

/// Records in the persist batches a peer's task keeps waiting for its store past which it
/// stops reading the link, beside [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`]. The frames of one read
/// are one step, so one batch holds a read's records: a peer packing a read with small frames
/// that each stage a record (strays, each answered with a bounce) would otherwise have the
/// batch bound admit 1,024 reads of them during a store outage. 4,096 records (about 850 KiB
/// at 208 bytes each, bodies aside, which the receive windows bound) is what 1,024 batches of
/// one frame each held at most; the read in hand is finished, so one read's records more.
pub const SUBSTRATE_UNCOMMITTED_RECORDS_MAX: usize = 4096;

/// The longest a peer holds back persist batches that nothing waits on (an acked op
/// forgotten, a consumed delivery, an expired tombstone) before committing them on their own.
/// They normally ride with the next commit something waits on; a crash before it only
/// repeats what the protocol repeats (the resend is acked again, the delivery delivered
/// again). 10 ms is a few disk syncs: an idle peer settles in that time.
pub const SUBSTRATE_LAZY_COMMIT_MS: u64 = 10;

/// Seqs an object's sender reserves durably ahead of the ones it has used. A send may go on
/// the wire while the batch holding it is still being committed only if its seq is below a
/// reservation already committed: after a crash the sender resumes at the reservation, so no
/// seq that may have reached the peer is ever used twice, and the peer skips the unused rest
/// as it skips any seq below the sender's floor. The reservation is renewed when half of it
/// is used: one object record per 128 sends, and a gap of at most 256 seqs per restart.
pub const SUBSTRATE_SEQ_RESERVE: u64 = 256;

/// Batches held back (as [`SUBSTRATE_LAZY_COMMIT_MS`]) past which they are committed at once,
/// far below [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`] so that holding back never stops the
/// peer taking commands or reading its link.
pub const SUBSTRATE_LAZY_COMMIT_BATCHES_MAX: usize = 64;

/// Emptied step buffers (one kind holds a step's records, the other the outputs that wait for
/// them) a peer's machine keeps for its next steps. Every input stages into one of each, and a
/// committed batch hands its buffers back; a busy peer's commit returns hundreds at once
/// (16 queues of window 32 on one peer: about 5.6 allocations a message with 1,024 kept, 9.3
/// with 128, 12.2 with none), so the bound is the batches a peer can have waiting for its
/// store ([`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`]). They never outnumber the batches the peer
/// had outstanding at its peak, and are freed once it is quiet: by the first timeout that
/// finds every batch persisted (with the link up, the keepalive's comes at most
/// [`SUBSTRATE_KEEPALIVE_MS`] after the last send), or at once when every batch is persisted
/// and no link is up. At most about 2 MiB per peer busy in the last keepalive period
/// ([`SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX`]).
pub const SUBSTRATE_SPARE_STEP_BUFFERS_MAX: usize = SUBSTRATE_UNCOMMITTED_BATCHES_MAX;

/// Entries a step buffer may have room for and still be kept as a spare
/// ([`SUBSTRATE_SPARE_STEP_BUFFERS_MAX`]): a step usually stages one to three (a first push
/// makes room for four, std's smallest allocation for elements of this size; were that to
/// change, buffers would only stop being kept), and a buffer grown by a rare large step is
/// freed rather than held. Records take 208 bytes and outputs 304, so a spare of each holds
/// at most about 2 KiB.
pub const SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX: usize = 4;

/// Larger emptied step buffers a peer's machine keeps, beside the small ones
/// ([`SUBSTRATE_SPARE_STEP_BUFFERS_MAX`]), for reads of several frames: the frames of one read
/// are one step, and a 64 KiB read of 1 KiB sends stages about 60 records and more outputs,
/// which grew a small buffer four or five times over, copying it each time. A read's second
/// frame moves the step into a large spare. `tether-core-cost` (16 queues, window 32): 732.3M
/// instructions with none kept, 723.6M with 4, 718.7M with 8 (a step's buffer grown 3,693,
/// 1,413 and 435 times).
pub const SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX: usize = 8;

/// Entries a large spare step buffer ([`SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX`]) may have room
/// for. At 64, `tether-core-cost` kept almost none (its steps' buffers grew 3,693 times, as with
/// none kept): a read's buffers outgrow it. At 208 bytes a record and 304 an output, the
/// large spares of a peer hold at most 8 × 128 × 512 B = 512 KiB.
pub const SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX: usize = 128;

/// Most slots of a [`crate::ring::Ring`], the table kept in order of the numbers it is keyed
/// by, of which a peer has two: its task's answers by command ticket and its sends and reqs in
/// flight by op-id counter, each 16 bytes a slot: at most 256 KiB a peer each, their room too.
/// A ring spans the keys from the oldest entry waiting; past this, the oldest entries still
/// waiting move to a table of late ones. `tether-bench`'s 16 queues keep 12,800 sends waiting.
pub const SUBSTRATE_RING_SLOTS_MAX: usize = 16 * 1024;

/// Most numbers without an entry (commands without answers, such as consumes; op ids of
/// opens) a [`crate::ring::Ring`] fills in to reach a new entry; past it, the entries waiting
/// move to the table of late ones and the ring starts again at the new key.
pub const SUBSTRATE_RING_GAP_MAX: u64 = 1024;

/// Records a commit to a blocking store may hold and still run in place on the peer task's
/// worker when nothing else waits for that task (the two hops to a blocking thread and back
/// cost more than one sync holds the worker); a larger commit, or one while input waits, runs
/// on the blocking pool.
pub const SUBSTRATE_INLINE_COMMIT_RECORDS_MAX: usize = 8;

/// Encoded chunks (each up to 256 KiB) queued for one link's socket. When the socket is
/// slower, frames wait in the machine, whose windows and credit bound them: 2 MiB per peer.
pub const SUBSTRATE_WRITE_CHUNKS_MAX: usize = 8;

/// Most closed or rejected objects kept per peer for the retention period. They answer
/// duplicates of their ops; a peer opening and closing objects in a loop evicts its own oldest
/// ones instead of growing state (a duplicate for an evicted object bounces, which is counted).
pub const SUBSTRATE_RETAINED_OBJECTS_MAX: usize = 4096;

/// Largest receive window (`W`) a machine accepts, so the most deliveries per object the app may
/// hold unconsumed (docs/spec/substrate.md §3: 1000 ops per object). A larger setting is lowered to
/// it.
pub const SUBSTRATE_INBOX_OPS_MAX: usize = 1000;

/// Longest cap, media or tagged URN text [`crate::cap`] parses, in bytes. A cap URN travels in
/// every REQ frame and in every manifest entry (docs/spec/switch.md §4); real ones stay under
/// 300 bytes, so 4 KiB leaves more than ten times that while bounding the work and memory one
/// hostile URN can cost the parser.
pub const CAP_URN_BYTES_MAX: usize = 4096;

/// Most tags one tagged URN may carry (a cap's own tags, or the tags of one of its media URNs).
/// Matching walks the pattern's tags with one lookup each, so this bounds the cost of every
/// `accepts` and `is_dispatchable`; real URNs carry fewer than ten.
pub const CAP_URN_TAGS_MAX: usize = 64;

/// Frames one peer's egress queue holds past its ring (the spillover of its `HybridChannel`).
/// Pushes never block; past this bound a frame is dropped and counted (`egress_full`), so a
/// peer that cannot be written to holds bounded memory.
pub const EGRESS_SPILL_FRAMES_MAX: usize = 65_536;

/// Bytes of frames (payload, tag and bookkeeping) one peer's egress spillover holds; past it a
/// frame is dropped and counted (`egress_full`), as past [`EGRESS_SPILL_FRAMES_MAX`]. The ring
/// before it is bounded in slots (the application's own sends fill it, each within the node's
/// `payload_bytes_max`).
pub const EGRESS_SPILL_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Most frames one slot of a peer's egress ring carries. `Node::send_batch` encodes a run of
/// frames for one peer into slots of up to this many records (one hand-off to the writer per
/// slot instead of per frame, handed to the stream without a copy), so a ring of `n` slots
/// holds at most `n` times this many frames. A run that finds no room in the ring is pushed
/// frame by frame, so the spillover stays bounded in frames ([`EGRESS_SPILL_FRAMES_MAX`]).
pub const EGRESS_RUN_FRAMES_MAX: usize = 64;

/// Egress queues each thread remembers for a lone `Node::send` (a handful of peers sent to in
/// turn stay off the egress lock); each entry keeps its queue's ring allocated until replaced
/// or found retired.
pub const NODE_SEND_CACHE_QUEUES: usize = 4;

/// Distinct type tags a node's egress table names by number. A queued frame carries its tag's
/// number instead of the tag (a ring slot of 72 bytes instead of 88: the slot crosses from the
/// sending core to the writer's on every frame); a frame whose tag is not (yet) in the table is
/// queued with its tag, boxed, and its writer adds the tag while there is room. Tags are the
/// application's own (message types), so this is plenty; past it every new tag is boxed.
pub const EGRESS_TAGS_MAX: usize = 1024;

/// How long a peer's egress queue and writer live with nothing to write before they are torn
/// down (the default; `NodeBuilder::idle_peer_timeout` sets it). A node talking to many
/// short-lived peers keeps memory for the live ones only.
pub const EGRESS_IDLE_TEARDOWN_MS_DEFAULT: u64 = 30_000;

/// Peers whose relay URLs a node remembers as hints for later addresses without one; past it
/// the peer recorded longest ago is forgotten.
pub const RELAY_HINT_PEERS_MAX: usize = 4_096;

/// Peers whose address (the last one given to `connect` or `join`) a node keeps for later
/// dials; past it the peer recorded longest ago is forgotten and is dialed by its key alone.
pub const ADDRESS_BOOK_PEERS_MAX: usize = 4_096;

/// Actors a node's route view (its directory of signed host claims) holds; a claim for a new
/// actor past it is refused (counted), so a peer cannot grow the directory without bound.
pub const DIRECTORY_ROUTES_MAX: usize = 65_536;

/// Actor locations a node caches for its egress path (resolved from the route view); past it
/// the location resolved longest ago is forgotten.
pub const LOCATION_CACHE_ENTRIES_MAX: usize = 4_096;

/// Host claims a node signed for its own actors (announced to every peer it connects to).
pub const LOCAL_CLAIMS_MAX: usize = 4_096;

/// Host claims a node queues to one peer at a time when it learns this node's actors (a new
/// actor connection); the next batch follows when that peer's writer has drained the last. A
/// peer (or a thousand of them) connecting costs the node this many queued claims each, not
/// every claim it holds.
pub const ANNOUNCE_CLAIMS_BATCH_MAX: usize = 64;

/// Routes one host may hold in a node's route view (its share of [`DIRECTORY_ROUTES_MAX`]):
/// as many actors as an honest node can register ([`LOCAL_CLAIMS_MAX`]). A claim past its
/// host's share is refused (`full`), so one peer cannot fill the directory for everyone.
pub const DIRECTORY_ROUTES_PER_HOST_MAX: usize = LOCAL_CLAIMS_MAX;

/// The highest generation a host claim may carry (2^48: a registration every microsecond
/// for eight years). Past it a claim is refused (`jump`), so no claim can sit at a generation
/// nothing could ever follow.
pub const CLAIM_GENERATION_MAX: u64 = 1 << 48;

/// How far past the generation a node holds for an actor a newer claim may go (2^20); past
/// it the claim is refused (`jump`), so a route cannot be pushed out of every later claim's
/// reach in one step.
pub const CLAIM_GENERATION_STEP_MAX: u64 = 1 << 20;

/// Bytes of a telemetry stream name in a subscription control record.
pub const TELEMETRY_STREAM_NAME_BYTES_MAX: usize = 128;

/// Failed dials a node remembers for the opens that waited on them (per peer and channel),
/// so that each waiter hears the failure instead of dialing again in turn; past it the
/// oldest failure is forgotten and its remaining waiters dial afresh.
pub const FAILED_OPENS_MAX: usize = 256;

/// Telemetry subscriptions a source node serves at once (each a publisher and a connection);
/// past it a subscribe is refused (counted).
pub const TELEMETRY_SUBSCRIPTIONS_MAX: usize = 256;

/// A collector's share of [`TELEMETRY_SUBSCRIPTIONS_MAX`]: one collector asking for many flows
/// cannot lock the others out.
pub const TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX: usize = 32;

// ---------------------------------------------------------------------------------------------
// Sizes the shells read, write and batch in (no peer chooses them, but a reader of the limits
// finds them here with the rest).

/// Bytes of records a node coalesces into one QUIC stream write.
pub const NODE_WRITE_BATCH_BYTES: usize = 256 * 1024;

/// Bytes of encoded runs a block of `Node::send_batch`'s grows to (from one run, doubling): the
/// runs of a block are handed to the QUIC stream as one chunk, and a block is held until its
/// last run is sent, so a call pins at most one block beyond the runs it encoded.
pub const EGRESS_RUN_BLOCK_BYTES: usize = 64 * 1024;

/// Bytes a node reads from a QUIC stream at a time.
pub const NODE_READ_CHUNK_BYTES: usize = 64 * 1024;

/// Bytes of a block an actor stream's reader copies what it reads into, chunk after chunk (a
/// larger chunk gets a block of its own size). A block is used again once every record read
/// from it is gone, so a payload the app keeps pins at most one block.
pub const NODE_READ_BLOCK_BYTES: usize = 16 * 1024;

/// Frames a publisher's queue holds for one subscriber; past it the publisher's `emit`
/// drops the frame for that subscriber (counted), so a slow collector never grows memory.
pub const TELEMETRY_PUBLISHER_FRAMES: usize = 1024;

/// Commands from a switch's engine API queued for its task.
pub const SWITCH_ENGINE_COMMANDS_MAX: usize = 1024;

/// Bytes a switch connection reads at a time.
pub const SWITCH_READ_CHUNK_BYTES: usize = 64 * 1024;

/// Bytes of frames a switch connection encodes per socket write.
pub const SWITCH_WRITE_BATCH_BYTES: usize = 64 * 1024;

/// App commands a substrate peer's task hands in per wake before it drains the outputs
/// (bounds one wake's work).
pub const SUBSTRATE_COMMANDS_PER_WAKE: usize = 256;

/// Link reads a substrate peer's task hands in per wake.
pub const SUBSTRATE_READS_PER_WAKE: usize = 64;

/// Bytes of a substrate link's read block: reads fill one block end to end, and the frames
/// decoded from them are views of it.
pub const SUBSTRATE_READ_CHUNK_BYTES: usize = 64 * 1024;

/// A substrate link reads into the rest of its block while at least this much is left, then
/// into a fresh block: however a peer paces its bytes, a block holds up to its size of them,
/// so a body kept from a small read holds its block's share, not a block of its own.
pub const SUBSTRATE_READ_ROOM_MIN_BYTES: usize = 4 * 1024;

/// Bytes of frames a substrate link coalesces into one write.
pub const SUBSTRATE_WRITE_CHUNK_BYTES: usize = 256 * 1024;

/// The smallest body a substrate link writing to a stream that takes owned chunks (QUIC)
/// hands on as the app's own buffer instead of copying it into the frame: below it, a chunk
/// of its own costs the stream more than the copy it saves. Measured over iroh (log store, 16
/// queues, paired runs): by reference from 512 bytes cost 1 KiB messages 1.6 µs more CPU each
/// and 5% of their rate; at 2 and 4 KiB CPU was even and the rate up to 12% higher; at 16 KiB
/// CPU fell 9%.
pub const SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES: usize = 4096;

/// Space a substrate link's encoder makes ready before it takes a wake's frames (a quarter of
/// [`SUBSTRATE_WRITE_CHUNK_BYTES`]): the usual wake's frames fit without the buffer growing,
/// and the space is used again once the writer has sent them.
pub const SUBSTRATE_WRITE_RESERVE_BYTES: usize = SUBSTRATE_WRITE_CHUNK_BYTES / 4;

/// Bytes an unread `res` part is counted as beyond its body, so that a peer sending empty
/// parts cannot grow memory either.
pub const SUBSTRATE_REPLY_PART_OVERHEAD_BYTES: usize = 64;

/// Default cap on substrate peer tasks created by inbound links.
pub const SUBSTRATE_PEERS_DEFAULT: usize = 1024;

/// Inbound handshakes a substrate runs at once; past it a new link is dropped unread.
pub const SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX: usize = 64;

/// A log store's file is never compacted below this size: a small file costs nothing to replay.
pub const LOG_COMPACT_BYTES_MIN: u64 = 64 * 1024 * 1024;

/// The most a log store's compaction reads of its old file at once: live rows lying within
/// this of each other are read together.
pub const LOG_COMPACT_READ_BYTES: usize = 1024 * 1024;

/// A log store's file is compacted once it is this many times the size of its last snapshot.
pub const LOG_COMPACT_GROWTH: u64 = 4;

/// Bytes of zeros a log store keeps written and synced past its last commit.
pub const LOG_PREPARE_BYTES: u64 = 16 * 1024 * 1024;

/// The zeros a log store's preparation writes at a time (the close flag is checked between them).
pub const LOG_PREPARE_CHUNK_BYTES: usize = 1024 * 1024;

/// The alignment of a log store's direct writes (offset, length and buffer), and the block a
/// commit's last bytes are padded to with zeros: the largest logical block size of common
/// disks, and the page size of common kernels, so that a commit never writes part of a block
/// the page cache does not hold (which would read it from the disk first).
pub const LOG_BLOCK_BYTES: u64 = 4096;

/// The largest commit a log store writes with direct I/O (a larger one, rare, goes through the
/// page cache): the bound of the buffer direct commits are put together in, one per store.
pub const LOG_DIRECT_COMMIT_BYTES_MAX: usize = 1024 * 1024;

/// The most bytes a node's peer book file may hold: a larger one is refused when read, and
/// writing stops at the last whole entry under it (the application's entries first).
pub const PEER_BOOK_BYTES_MAX: usize = 1 << 20;

/// The most peers a node's peer book records from inbound links (the application's own
/// entries are not counted: it names them).
pub const PEER_BOOK_SEEN_PEERS_MAX: usize = 4_096;

/// The most addresses one peer's entry in a peer book holds, in the file and in memory.
pub const PEER_BOOK_ADDRS_PER_PEER_MAX: usize = 8;

/// Connection events (`node.conn.ready` / `node.conn.ended`) a driver keeps for its shell to
/// report; past it the oldest is dropped and counted ([`crate::driver::Driver::conn_events_dropped`]).
pub const DRIVER_CONN_EVENTS_QUEUED_MAX: usize = 4_096;

/// The least time between two writes of a node's peer book for what inbound links showed:
/// changes within it are written together, so a peer reconnecting from ever-new addresses
/// costs the disk one write per interval, not one per connection.
pub const PEER_BOOK_WRITE_INTERVAL_MS: u64 = 1_000;
