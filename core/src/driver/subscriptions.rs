//! Telemetry subscription control over the actor plane (docs/spec/driver.md §5.1): a collector asks
//! a source node, by stream name, to start or stop publishing to it; the source's driver keeps the
//! table of live subscriptions and tells its shell to start or stop a publisher (which dials the
//! collector on the telemetry ALPN).
//!
//! # Wire
//!
//! A control record travels tagged [`TELEMETRY_CONTROL_TAG`] to the source's mailbox. Its
//! payload: op (1 byte: 1 subscribe, 2 unsubscribe), flow id (16), name length (1), the
//! stream name (UTF-8, 1 to [`TELEMETRY_STREAM_NAME_BYTES_MAX`] bytes), and nothing after.

use std::collections::{BTreeMap, BTreeSet};

use super::routing::NodeId;
use crate::limits::{
    TELEMETRY_STREAM_NAME_BYTES_MAX, TELEMETRY_SUBSCRIPTIONS_MAX,
    TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX,
};

/// The actor tag of a subscription control record.
pub use super::routing::TELEMETRY_CONTROL_TAG;

/// What a collector asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Start publishing stream `name` to the sender, as flow `flow_id`.
    Subscribe {
        /// The stream.
        name: String,
        /// The flow the collector will see in the stream's header.
        flow_id: [u8; 16],
    },
    /// Stop that flow.
    Unsubscribe {
        /// The stream.
        name: String,
        /// The flow.
        flow_id: [u8; 16],
    },
}

/// Why control bytes were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// Shorter than its fields say, or bytes after them.
    #[error("control record of {0} bytes does not match its fields")]
    Length(usize),
    /// An op other than 1 or 2.
    #[error("unknown control op {0}")]
    Op(u8),
    /// A name of 0 bytes, past the bound, or not UTF-8.
    #[error("bad stream name")]
    Name,
}

impl Control {
    fn parts(&self) -> (u8, &str, &[u8; 16]) {
        match self {
            Control::Subscribe { name, flow_id } => (1, name, flow_id),
            Control::Unsubscribe { name, flow_id } => (2, name, flow_id),
        }
    }

    /// The wire bytes; `None` when the name is empty or past the bound.
    pub fn encode(&self) -> Option<Vec<u8>> {
        let (op, name, flow_id) = self.parts();
        let len = u8::try_from(name.len()).ok()?;
        if name.is_empty() || name.len() > TELEMETRY_STREAM_NAME_BYTES_MAX {
            return None;
        }
        let mut out = Vec::with_capacity(18 + name.len());
        out.push(op);
        out.extend_from_slice(flow_id);
        out.push(len);
        out.extend_from_slice(name.as_bytes());
        Some(out)
    }

    /// Parses wire bytes, strictly (allocates at most the bounded name).
    pub fn decode(bytes: &[u8]) -> Result<Self, ControlError> {
        let (&op, rest) = bytes
            .split_first()
            .ok_or(ControlError::Length(bytes.len()))?;
        if rest.len() < 17 {
            return Err(ControlError::Length(bytes.len()));
        }
        let (flow, rest) = rest.split_at(16);
        let (&len, name) = rest
            .split_first()
            .ok_or(ControlError::Length(bytes.len()))?;
        if name.len() != usize::from(len) {
            return Err(ControlError::Length(bytes.len()));
        }
        if name.is_empty() || name.len() > TELEMETRY_STREAM_NAME_BYTES_MAX {
            return Err(ControlError::Name);
        }
        let name = std::str::from_utf8(name)
            .map_err(|_| ControlError::Name)?
            .to_owned();
        let mut flow_id = [0u8; 16];
        flow_id.copy_from_slice(flow);
        match op {
            1 => Ok(Control::Subscribe { name, flow_id }),
            2 => Ok(Control::Unsubscribe { name, flow_id }),
            other => Err(ControlError::Op(other)),
        }
    }
}

/// What a control record did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlVerdict {
    /// A publisher starts.
    Started,
    /// A publisher stops.
    Stopped,
    /// Already subscribed, or not subscribed: nothing to do.
    Ignored,
    /// No local stream of that name.
    UnknownStream,
    /// [`TELEMETRY_SUBSCRIPTIONS_MAX`] subscriptions are live already, or the collector's
    /// share of them ([`TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX`]).
    Full,
    /// The bytes did not decode.
    Malformed,
}

/// A live subscription: (collector, stream, flow).
pub type Subscription = (NodeId, String, [u8; 16]);

/// The number of the publisher started for a subscription: one per start, from 1, so that a
/// publisher stopped by an unsubscribe and ending after the same subscription started again
/// is told apart from the new one.
pub type Publisher = u64;

/// The source side's table: local streams and live subscriptions, each with its publisher.
#[derive(Debug, Clone, Default)]
pub struct Subscriptions {
    streams: BTreeSet<String>,
    live: BTreeMap<Subscription, Publisher>,
    /// Publishers started so far.
    publishers: Publisher,
    verdicts: BTreeMap<ControlVerdict, u64>,
}

impl Subscriptions {
    /// A local stream collectors may subscribe to.
    pub fn add_stream(&mut self, name: &str) {
        self.streams.insert(name.to_owned());
    }

    /// A control record from `collector`: the subscription that starts or stops, if any, and
    /// its publisher.
    pub fn apply(
        &mut self,
        collector: NodeId,
        bytes: &[u8],
    ) -> (ControlVerdict, Option<(Subscription, Publisher)>) {
        let (verdict, subscription) = match Control::decode(bytes) {
            Err(_) => (ControlVerdict::Malformed, None),
            Ok(Control::Subscribe { name, .. }) if !self.streams.contains(&name) => {
                (ControlVerdict::UnknownStream, None)
            }
            Ok(Control::Subscribe { name, flow_id }) => {
                let key = (collector, name, flow_id);
                if self.live.contains_key(&key) {
                    (ControlVerdict::Ignored, None)
                } else if self.live.len() >= TELEMETRY_SUBSCRIPTIONS_MAX
                    || self.of(collector) >= TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX
                {
                    (ControlVerdict::Full, None)
                } else {
                    self.publishers += 1;
                    self.live.insert(key.clone(), self.publishers);
                    (ControlVerdict::Started, Some((key, self.publishers)))
                }
            }
            Ok(Control::Unsubscribe { name, flow_id }) => {
                let key = (collector, name, flow_id);
                match self.live.remove(&key) {
                    Some(publisher) => (ControlVerdict::Stopped, Some((key, publisher))),
                    None => (ControlVerdict::Ignored, None),
                }
            }
        };
        *self.verdicts.entry(verdict).or_default() += 1;
        (verdict, subscription)
    }

    /// `publisher` of `subscription` ended: the subscription is gone if that is still its
    /// publisher (not if it was stopped and the subscription started again meanwhile).
    /// `true` if it was live.
    pub fn ended(&mut self, subscription: &Subscription, publisher: Publisher) -> bool {
        if self.live.get(subscription) != Some(&publisher) {
            return false;
        }
        self.live.remove(subscription);
        true
    }

    /// The live subscriptions, in (collector, stream, flow) order.
    pub fn iter(&self) -> impl Iterator<Item = &Subscription> {
        self.live.keys()
    }

    /// The live subscriptions with their publishers, in (collector, stream, flow) order.
    pub fn publishers(&self) -> impl Iterator<Item = (&Subscription, Publisher)> {
        self.live
            .iter()
            .map(|(subscription, publisher)| (subscription, *publisher))
    }

    /// Live subscriptions of `collector` (counted up to its share).
    fn of(&self, collector: NodeId) -> usize {
        self.live
            .range((collector, String::new(), [0; 16])..)
            .take_while(|((of, ..), _)| *of == collector)
            .take(TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX)
            .count()
    }

    /// Live subscriptions.
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Control records by verdict.
    pub fn verdicts(&self) -> &BTreeMap<ControlVerdict, u64> {
        &self.verdicts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_bytes_and_round_trip() {
        let subscribe = Control::Subscribe {
            name: "cpu".to_owned(),
            flow_id: [7; 16],
        };
        let bytes = subscribe.encode().expect("fits");
        assert_eq!(
            hex::encode(&bytes),
            "010707070707070707070707070707070703637075"
        );
        assert_eq!(Control::decode(&bytes), Ok(subscribe));
        let mut unsubscribe = bytes.clone();
        unsubscribe[0] = 2;
        assert!(matches!(
            Control::decode(&unsubscribe),
            Ok(Control::Unsubscribe { .. })
        ));
        // Strict: a byte after the name, a short name, op 3, an empty or non-UTF-8 name.
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(Control::decode(&long), Err(ControlError::Length(22)));
        assert_eq!(Control::decode(&bytes[..20]), Err(ControlError::Length(20)));
        let mut op = bytes.clone();
        op[0] = 3;
        assert_eq!(Control::decode(&op), Err(ControlError::Op(3)));
        let mut empty = bytes[..17].to_vec();
        empty.push(0);
        assert_eq!(Control::decode(&empty), Err(ControlError::Name));
        let mut latin = bytes.clone();
        latin[20] = 0xff;
        assert_eq!(Control::decode(&latin), Err(ControlError::Name));
        assert_eq!(
            Control::Subscribe {
                name: "x".repeat(TELEMETRY_STREAM_NAME_BYTES_MAX + 1),
                flow_id: [0; 16]
            }
            .encode(),
            None
        );
    }

    #[test]
    fn the_table_starts_and_stops_publishers_once() {
        let mut table = Subscriptions::default();
        table.add_stream("cpu");
        let sub = |name: &str, op| {
            let control = if op {
                Control::Subscribe {
                    name: name.to_owned(),
                    flow_id: [1; 16],
                }
            } else {
                Control::Unsubscribe {
                    name: name.to_owned(),
                    flow_id: [1; 16],
                }
            };
            control.encode().expect("fits")
        };
        assert_eq!(
            table.apply(NodeId([9; 32]), &sub("cpu", true)).0,
            ControlVerdict::Started
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), &sub("cpu", true)).0,
            ControlVerdict::Ignored
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), &sub("disk", true)).0,
            ControlVerdict::UnknownStream
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), b"junk").0,
            ControlVerdict::Malformed
        );
        assert_eq!(table.live(), 1);
        let (verdict, stopped) = table.apply(NodeId([9; 32]), &sub("cpu", false));
        assert_eq!(verdict, ControlVerdict::Stopped);
        assert_eq!(
            stopped,
            Some(((NodeId([9; 32]), "cpu".to_owned(), [1; 16]), 1))
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), &sub("cpu", false)).0,
            ControlVerdict::Ignored
        );
        assert_eq!(table.live(), 0);
    }

    /// One collector asking for many flows gets its share and no more: the others still get
    /// theirs, until the table's own bound.
    #[test]
    fn a_collector_gets_its_share_and_cannot_lock_the_others_out() {
        let mut table = Subscriptions::default();
        table.add_stream("cpu");
        let subscribe = |flow: u32| {
            let mut flow_id = [0; 16];
            flow_id[..4].copy_from_slice(&flow.to_be_bytes());
            Control::Subscribe {
                name: "cpu".to_owned(),
                flow_id,
            }
            .encode()
            .expect("fits")
        };
        let greedy = NodeId([6; 32]);
        let started = (0..1_000)
            .filter(|flow| table.apply(greedy, &subscribe(*flow)).0 == ControlVerdict::Started)
            .count();
        assert_eq!(started, TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX);
        assert_eq!(
            table.verdicts()[&ControlVerdict::Full],
            1_000 - started as u64
        );
        let mut collectors = 1;
        for collector in 0..=u8::MAX {
            if collector == 6 {
                continue;
            }
            let verdict = table.apply(NodeId([collector; 32]), &subscribe(0)).0;
            if verdict == ControlVerdict::Full {
                break;
            }
            assert_eq!(verdict, ControlVerdict::Started);
            collectors += 1;
        }
        assert_eq!(table.live(), TELEMETRY_SUBSCRIPTIONS_MAX);
        assert_eq!(
            collectors,
            1 + TELEMETRY_SUBSCRIPTIONS_MAX - TELEMETRY_SUBSCRIPTIONS_PER_COLLECTOR_MAX
        );
    }

    #[test]
    fn a_stopped_publisher_ending_late_leaves_the_subscription_started_again() {
        let mut table = Subscriptions::default();
        table.add_stream("cpu");
        let control = |subscribe: bool| {
            let (name, flow_id) = ("cpu".to_owned(), [1; 16]);
            let control = if subscribe {
                Control::Subscribe { name, flow_id }
            } else {
                Control::Unsubscribe { name, flow_id }
            };
            control.encode().expect("fits")
        };
        let key = (NodeId([9; 32]), "cpu".to_owned(), [1; 16]);
        assert_eq!(
            table.apply(NodeId([9; 32]), &control(true)).1,
            Some((key.clone(), 1))
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), &control(false)).1,
            Some((key.clone(), 1))
        );
        assert_eq!(
            table.apply(NodeId([9; 32]), &control(true)).1,
            Some((key.clone(), 2))
        );
        // Publisher 1 (stopped) ends now: publisher 2's subscription stays.
        assert!(!table.ended(&key, 1));
        assert_eq!(table.publishers().collect::<Vec<_>>(), [(&key, 2)]);
        assert!(table.ended(&key, 2));
        assert_eq!(table.live(), 0);
    }

    proptest! {
        /// Any bytes: decoding never panics; whatever decodes encodes back to the same bytes.
        #[test]
        fn decoding_is_total_and_exact(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            if let Ok(control) = Control::decode(&bytes) {
                prop_assert_eq!(control.encode(), Some(bytes));
            }
        }

        /// Encoded controls of any name within the bound decode to themselves.
        #[test]
        fn round_trip(name in "[a-z]{1,40}", flow in any::<[u8; 16]>(), subscribe in any::<bool>()) {
            let control = if subscribe {
                Control::Subscribe { name, flow_id: flow }
            } else {
                Control::Unsubscribe { name, flow_id: flow }
            };
            let bytes = control.encode().expect("fits");
            prop_assert_eq!(Control::decode(&bytes), Ok(control));
        }
    }
}
