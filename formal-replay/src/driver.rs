//! The `driver` section against production: core's driver machine
//! (`tether_core::driver::Driver`) configured as `docs/conformance/driver.md` §1 fixes, fed
//! the case's ops, its answers, actions and state written in the section's strings.

use std::time::Duration;

use tether_core::driver::ask::Ask;
use tether_core::driver::machine::RegisterError;
use tether_core::driver::schedule::JoinPhase;
use tether_core::driver::{
    Action, Alpns, Channel, ControlVerdict, DialEnd, DialFailure, DialTicket, Direction, Dispatch,
    Driver, DriverConfig, NodeId, Open, Path, PeerAuth, SendVerdict, StreamVerdict,
    TELEMETRY_CONTROL_TAG,
};
use tether_core::driver::{ActorAddr, Handoff};
use tether_core::time::Time;

use crate::script::{hex, DriverCase, DriverCounters, DriverEnd, DriverOp, DriverStep};

/// The section's node id of peer `n`.
fn id(n: u8) -> NodeId {
    NodeId([n; 32])
}

/// The section's configuration (§1).
pub fn config(allow: Option<&[u8]>) -> DriverConfig {
    DriverConfig {
        auth: match allow {
            None => PeerAuth::open(),
            Some(list) => PeerAuth::allow_list(list.iter().map(|n| id(*n))),
        },
        alpns: Alpns {
            actor: b"a".to_vec(),
            telemetry: b"t".to_vec(),
            telemetry_collect: true,
            protocols: vec![b"p0".to_vec(), b"p1".to_vec()],
            switch: Some(b"s".to_vec()),
            substrate: Some(b"u".to_vec()),
        },
        idle_peer_timeout: Duration::from_millis(1_000),
        dial_attempt_timeout: Duration::from_millis(10_000),
        join_attempt_timeout: Duration::from_millis(10_000),
        join_delay_divisor: 1,
        valid_peer: |peer| peer.0[0] < 250,
        failed_opens_max: 2,
        relay_hint_peers_max: 3,
        inbound_connections_max: 6,
        announce_batch: 2,
        claim_authorizer: None,
    }
}

fn channel(name: &str) -> Result<Channel, String> {
    match name {
        "actor" => Ok(Channel::Actor),
        "telemetry" => Ok(Channel::Telemetry),
        "protocol:0" => Ok(Channel::Protocol(0)),
        "protocol:1" => Ok(Channel::Protocol(1)),
        "switch" => Ok(Channel::Switch),
        "substrate" => Ok(Channel::Substrate),
        other => Err(format!("unknown channel {other:?}")),
    }
}

fn channel_name(channel: Channel) -> String {
    match channel {
        Channel::Actor => "actor".to_owned(),
        Channel::Telemetry => "telemetry".to_owned(),
        Channel::Protocol(index) => format!("protocol:{index}"),
        Channel::Switch => "switch".to_owned(),
        Channel::Substrate => "substrate".to_owned(),
    }
}

fn path(name: &str) -> Result<Path, String> {
    Ok(match name {
        "actor" => Path::Actor,
        "join" => Path::Join,
        "telemetry" => Path::Telemetry,
        "protocol" => Path::Protocol,
        "switch" => Path::Switch,
        "substrate" => Path::Substrate,
        "unknown" => Path::Unknown,
        other => return Err(format!("unknown path {other:?}")),
    })
}

fn direction(name: &str) -> Result<Direction, String> {
    match name {
        "inbound" => Ok(Direction::Inbound),
        "outbound" => Ok(Direction::Outbound),
        other => Err(format!("unknown direction {other:?}")),
    }
}

fn action(action: Action<u64>) -> String {
    match action {
        Action::Dial { peer, attempt, .. } => format!("dial:{}:{attempt}", peer.0[0]),
        Action::JoinAttempt { peer, attempt, .. } => format!("join:{}:{attempt}", peer.0[0]),
        Action::KickWriter { peer } => format!("kick:{}", peer.0[0]),
        Action::RetireWriter { peer } => format!("retire:{}", peer.0[0]),
        Action::SendFailed { peer } => format!("send_failed:{}", peer.0[0]),
        Action::Close { conn, code } => format!("close:{conn}:{code}"),
        Action::Dispatch { conn, .. } => format!("dispatch:{conn}"),
        Action::Announce { peer, claim } => format!(
            "announce:{}:{}:{}",
            peer.0[0], claim.actor.0[0], claim.generation
        ),
        Action::StartPublisher {
            collector,
            stream,
            flow_id,
            publisher,
        } => format!(
            "publish:{}:{stream}:{}:{publisher}",
            collector.0[0],
            hex(&flow_id)
        ),
        Action::StopPublisher {
            collector,
            stream,
            flow_id,
            publisher,
        } => format!(
            "unpublish:{}:{stream}:{}:{publisher}",
            collector.0[0],
            hex(&flow_id)
        ),
    }
}

/// A registration's or a handoff's result, as the section names it.
fn registered(result: Result<(), RegisterError>) -> String {
    match result {
        Ok(()) => "ok",
        Err(RegisterError::BadSignature) => "bad_signature",
        Err(RegisterError::Stale) => "stale",
        Err(RegisterError::Full) => "full",
        Err(RegisterError::Jump) => "jump",
        Err(RegisterError::NotHosted) => "not_hosted",
    }
    .to_owned()
}

/// The node whose key signs this node's own claims (§4 `register`): any valid key will do.
const LOCAL: u8 = 200;

/// Lowercase hex as bytes.
fn unhex(text: &str) -> Result<Vec<u8>, String> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(format!("{text:?} is not lowercase hex")),
    };
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return Err(format!("{text:?} has an odd number of hex digits"));
    }
    bytes
        .chunks(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

fn generation(generation: Option<tether_core::driver::Generation>) -> Option<String> {
    generation.map(|g| format!("gen:{}", g.get()))
}

/// A script's generation (≥ 1; the machine never issues 0).
fn generation_of(raw: u64) -> Result<tether_core::driver::Generation, String> {
    tether_core::driver::Generation::new(raw)
        .ok_or_else(|| "generation 0 is never issued".to_owned())
}

/// What a stream the shell cannot read on gets: `continue` or `stop:<code>`.
fn verdict(verdict: StreamVerdict) -> String {
    match verdict {
        StreamVerdict::Continue => "continue".to_owned(),
        StreamVerdict::Stop(code) => format!("stop:{code}"),
    }
}

/// The observation of where a stream goes: `cached:<generation>:<conn>`, `dial:<ticket>`,
/// `wait:<ticket>`, `failed` or `closed`.
fn opened(open: Open<u64>) -> String {
    match open {
        Open::Cached(g, conn) => format!("cached:{}:{conn}", g.get()),
        Open::Dial { ticket, .. } => format!("dial:{}", ticket.get()),
        Open::Wait(ticket) => format!("wait:{}", ticket.get()),
        Open::Failed => "failed".to_owned(),
        Open::Closed => "closed".to_owned(),
    }
}

/// `relays` if each is a relay string as §2 defines it.
fn checked_relays(relays: &[String]) -> Result<&[String], String> {
    let valid = |relay: &String| {
        !relay.is_empty()
            && relay.len() <= 64
            && relay
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b":/.-".contains(&b))
    };
    match relays.iter().find(|relay| !valid(relay)) {
        Some(bad) => Err(format!("not a relay string: {bad:?}")),
        None => Ok(relays),
    }
}

/// Opens' dials as `end` lists them: (peer, channel, ticket, waiters).
fn dials(
    dials: impl Iterator<Item = (NodeId, Channel, DialTicket, u64)>,
) -> Vec<(u8, String, u64, u64)> {
    dials
        .map(|(peer, channel, ticket, waiters)| {
            (peer.0[0], channel_name(channel), ticket.get(), waiters)
        })
        .collect()
}

/// Replays `case` on core's machine.
pub fn run_case(case: &DriverCase) -> Result<DriverCase, String> {
    if case.ops.len() != case.steps.len() {
        return Err(format!(
            "{} ops but {} steps",
            case.ops.len(),
            case.steps.len()
        ));
    }
    let mut driver: Driver<u64> = Driver::new(config(case.allow.as_deref()));
    let mut last = 0u64;
    let mut steps = Vec::with_capacity(case.ops.len());
    for op in &case.ops {
        if op.at() < last {
            return Err(format!("time goes back from {last} to {}", op.at()));
        }
        last = op.at();
        let now = Time::from_millis(op.at());
        let result = match op {
            DriverOp::Accept {
                peer, alpn, conn, ..
            } => Some({
                driver.handle_accepted(now, id(*peer), alpn.as_bytes(), *conn);
                match driver
                    .take_dispatch()
                    .ok_or("an accept queued no dispatch")?
                {
                    Dispatch::Refused(_) => "refused".to_owned(),
                    Dispatch::Actor(g) => format!("actor:{}", g.get()),
                    Dispatch::Telemetry(g) => {
                        format!("telemetry:{}", g.get())
                    }
                    Dispatch::Protocol(index, g) => {
                        format!("protocol:{index}:{}", g.get())
                    }
                    Dispatch::Switch(g) => format!("switch:{}", g.get()),
                    Dispatch::Substrate(g) => format!("substrate:{}", g.get()),
                    Dispatch::NoAdapter => "no_adapter".to_owned(),
                    Dispatch::Full => "full".to_owned(),
                }
            }),
            DriverOp::Connected {
                peer,
                channel: name,
                conn,
                ..
            } => generation(driver.ask_connected(now, id(*peer), channel(name)?, *conn)),
            DriverOp::Closed {
                peer,
                channel: name,
                generation: g,
                ..
            } => {
                driver.handle_connection_closed(now, id(*peer), channel(name)?, generation_of(*g)?);
                None
            }
            DriverOp::Disconnect {
                peer,
                channel: name,
                ..
            } => {
                driver.handle_disconnect(now, id(*peer), channel(name)?);
                None
            }
            DriverOp::Admit {
                peer,
                path: p,
                direction: d,
                ..
            } => Some(
                match driver.ask_admit(now, &id(*peer), path(p)?, direction(d)?) {
                    Ok(()) => "ok".to_owned(),
                    Err(_) => "refused".to_owned(),
                },
            ),
            DriverOp::Send { peer, .. } => Some(match driver.ask_send(now, id(*peer)) {
                SendVerdict::Enqueue => "enqueue".to_owned(),
                SendVerdict::Dropped(reason) => format!("drop:{}", reason.as_str()),
            }),
            DriverOp::Batch {
                peer,
                frames,
                swim,
                stream,
                ..
            } => {
                let stream = match stream {
                    Some(g) => Some(generation_of(*g)?),
                    None => None,
                };
                Some(
                    match driver.ask_batch(now, id(*peer), *frames, *swim, stream) {
                        Some(batch) => {
                            let kept = if batch.open_stream { "" } else { ":kept" };
                            format!("write:{}:{}{kept}", batch.generation.get(), batch.conn)
                        }
                        None => "drop".to_owned(),
                    },
                )
            }
            DriverOp::Stopped {
                peer, generation, ..
            } => {
                driver.handle_stream_stopped(now, id(*peer), generation_of(*generation)?);
                None
            }
            DriverOp::Open {
                peer,
                path: p,
                channel: name,
                ..
            } => Some(
                match driver.ask_open(now, id(*peer), path(p)?, channel(name)?) {
                    Ok(open) => opened(open),
                    Err(_) => "refused".to_owned(),
                },
            ),
            DriverOp::OpenFailed {
                peer,
                channel: name,
                generation: g,
                ..
            } => Some(opened(driver.ask_open_failed(
                now,
                id(*peer),
                channel(name)?,
                generation_of(*g)?,
            ))),
            DriverOp::RelaysSeen { peer, relays, .. } => {
                driver.handle_relays_seen(now, id(*peer), checked_relays(relays)?.to_vec());
                None
            }
            DriverOp::RelaysFor { peer, given, .. } => Some(
                driver
                    .relays_for(&id(*peer), checked_relays(given)?)
                    .join(","),
            ),
            DriverOp::Unresponsive {
                peer,
                channel: name,
                generation: g,
                ..
            } => {
                driver.handle_unresponsive(now, id(*peer), channel(name)?, generation_of(*g)?);
                None
            }
            DriverOp::OpenWaited {
                peer,
                channel: name,
                ticket,
                ..
            } => Some(opened(driver.ask_open_waited(
                now,
                id(*peer),
                channel(name)?,
                DialTicket::from(*ticket),
            ))),
            DriverOp::OpenWaitAbandoned {
                peer,
                channel: name,
                ticket,
                ..
            } => {
                driver.handle_open_wait_abandoned(
                    now,
                    id(*peer),
                    channel(name)?,
                    DialTicket::from(*ticket),
                );
                None
            }
            DriverOp::OpenDialFailed {
                peer,
                channel: name,
                ticket,
                abandoned,
                ..
            } => {
                let end = if *abandoned {
                    DialEnd::Abandoned
                } else {
                    DialEnd::Failed
                };
                driver.handle_open_dial_failed(
                    now,
                    id(*peer),
                    channel(name)?,
                    DialTicket::from(*ticket),
                    end,
                );
                None
            }
            DriverOp::WriteFailed {
                peer,
                generation: g,
                frames,
                swim,
                ..
            } => {
                driver.handle_write_failed(now, id(*peer), generation_of(*g)?, *frames, *swim);
                None
            }
            DriverOp::Idle { peer, .. } => {
                driver.handle_writer_idle(now, id(*peer));
                None
            }
            DriverOp::Dialed { peer, conn, .. } => {
                let result = conn.ok_or(DialFailure::Connect);
                generation(driver.ask_dialed(now, id(*peer), result))
            }
            DriverOp::Join {
                peer,
                relay,
                direct,
                ..
            } => {
                let direct = usize::try_from(*direct).unwrap_or(usize::MAX);
                Some(match driver.ask_join(now, id(*peer), *relay, direct) {
                    Ok(()) => "ok".to_owned(),
                    Err(_) => "refused".to_owned(),
                })
            }
            DriverOp::JoinConnected { peer, .. } => {
                driver.handle_join_connected(now, id(*peer));
                None
            }
            DriverOp::JoinSent { peer, conn, .. } => {
                generation(driver.ask_join_sent(now, id(*peer), *conn))
            }
            DriverOp::JoinFailed { peer, .. } => {
                driver.handle_join_failed(now, id(*peer), "failed");
                None
            }
            DriverOp::Fault {
                peer,
                fatal,
                channel: name,
                ..
            } => {
                let channel = channel(name.as_deref().unwrap_or("actor"))?;
                Some(verdict(driver.ask_stream_fault(
                    now,
                    id(*peer),
                    channel,
                    *fatal,
                )))
            }
            DriverOp::Unread {
                peer,
                channel: name,
                ..
            } => Some(verdict(driver.ask_stream_unread(
                now,
                id(*peer),
                channel(name)?,
            ))),
            DriverOp::EgressFull { frames, .. } => {
                driver.handle_egress_full(now, *frames);
                None
            }
            DriverOp::Register {
                actor,
                generation,
                forged,
                ..
            } => {
                let mut claim = signed_claim(LOCAL, *actor, *generation);
                if *forged {
                    claim.signature[63] ^= 1;
                }
                Some(registered(driver.ask_register(now, claim)))
            }
            DriverOp::HandOff {
                actor,
                to,
                generation,
                forged,
                ..
            } => {
                let to = id(*to);
                let mut handoff =
                    Handoff::sign(&[LOCAL; 32], &ActorAddr([*actor; 32]), &to, *generation);
                if *forged {
                    handoff.signature[63] ^= 1;
                }
                Some(registered(driver.ask_hand_off(
                    now,
                    ActorAddr([*actor; 32]),
                    to,
                    *generation,
                    handoff,
                )))
            }
            DriverOp::Stream { name, .. } => {
                driver.handle_telemetry_stream(now, name);
                None
            }
            DriverOp::Control { peer, payload, .. } => {
                // As the actor reader hands it over: a record for the driver, by its tag.
                let payload = unhex(payload)?;
                driver.handle_record(now, id(*peer), TELEMETRY_CONTROL_TAG, &payload);
                None
            }
            DriverOp::Ended {
                peer,
                name,
                flow,
                publisher,
                ..
            } => {
                let flow: [u8; 16] = unhex(flow)?
                    .try_into()
                    .map_err(|_| format!("flow {flow:?} is not 16 bytes"))?;
                driver.handle_publisher_ended(now, &(id(*peer), name.clone(), flow), *publisher);
                None
            }
            DriverOp::Timeout { .. } => {
                driver.handle_timeout(now);
                None
            }
            DriverOp::Close { .. } => {
                driver.handle_close(now);
                None
            }
        };
        let actions = std::iter::from_fn(|| driver.poll_action())
            .map(action)
            .collect();
        steps.push(DriverStep {
            result,
            actions,
            timeout: driver.poll_timeout().map(Time::as_millis),
        });
    }
    Ok(DriverCase {
        steps,
        end: end(&driver),
        ..case.clone()
    })
}

fn end(driver: &Driver<u64>) -> DriverEnd {
    let counters = driver.counters();
    DriverEnd {
        drops: driver
            .drops()
            .0
            .iter()
            .map(|(why, n)| (why.as_str().to_owned(), *n))
            .collect(),
        refusals: driver
            .refusals()
            .iter()
            .map(|(path, direction, n)| (format!("{}/{}", path.as_str(), direction.as_str()), n))
            .collect(),
        counters: DriverCounters {
            accepted: counters.accepted,
            dials_started: counters.dials_started,
            dial_failures: counters.dial_failures,
            evictions: counters.evictions,
            stale_failures: counters.stale_failures,
            writers_retired: counters.writers_retired,
            refused_full: counters.refused_full,
        },
        cache: driver
            .connections()
            .map(|(peer, channel, g)| (peer.0[0], channel_name(channel), g.get()))
            .collect(),
        joins: driver
            .join_statuses()
            .map(|(peer, status)| {
                let phase = match status.phase {
                    JoinPhase::Connecting { attempt, .. } => format!("connecting:{attempt}"),
                    JoinPhase::Sending => "sending".to_owned(),
                    JoinPhase::Sent => "sent".to_owned(),
                    JoinPhase::Failed => "failed".to_owned(),
                };
                (peer.0[0].to_string(), phase)
            })
            .collect(),
        claims: driver
            .local_claims()
            .map(|claim| (claim.actor.0[0], claim.generation))
            .collect(),
        subscriptions: driver
            .subscriptions()
            .map(|(collector, stream, flow)| (collector.0[0], stream.clone(), hex(flow)))
            .collect(),
        controls: driver
            .control_verdicts()
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(verdict, n)| (control_name(*verdict).to_owned(), *n))
            .collect(),
        opening: dials(driver.opening()),
        failed_opens: dials(driver.failed_opens()),
        relays: driver
            .relay_hints()
            .map(|(peer, relays)| (peer.0[0], relays.to_vec()))
            .collect(),
    }
}

fn control_name(verdict: ControlVerdict) -> &'static str {
    match verdict {
        ControlVerdict::Started => "started",
        ControlVerdict::Stopped => "stopped",
        ControlVerdict::Ignored => "ignored",
        ControlVerdict::UnknownStream => "unknown_stream",
        ControlVerdict::Full => "full",
        ControlVerdict::Malformed => "malformed",
    }
}

/// Peer `host`'s claim on actor `[actor; 32]` at `generation`, signed with the secret key
/// `[host; 32]`; remembered per thread (the property tests sign the same few claims
/// thousands of times).
pub(crate) fn signed_claim(host: u8, actor: u8, generation: u64) -> tether_core::driver::HostClaim {
    thread_local! {
        static SIGNED: std::cell::RefCell<
            std::collections::BTreeMap<(u8, u8, u64), tether_core::driver::HostClaim>,
        > = std::cell::RefCell::default();
    }
    SIGNED.with(|signed| {
        *signed
            .borrow_mut()
            .entry((host, actor, generation))
            .or_insert_with(|| {
                tether_core::driver::HostClaim::sign(
                    &[host; 32],
                    ActorAddr([actor; 32]),
                    generation,
                )
            })
    })
}
