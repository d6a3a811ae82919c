//! The frames the machine writes, and the checks on what the app hands it.

use super::*;

pub(super) fn check_text(text: Option<&str>) -> Result<(), CommandError> {
    match text {
        Some(text) if text.len() > ENVELOPE_TEXT_BYTES_MAX => Err(CommandError::TextTooLong),
        _ => Ok(()),
    }
}

pub(super) fn check_body(body: Option<&Bytes>) -> Result<(), CommandError> {
    match body {
        Some(body) if body.len() > ENVELOPE_INLINE_BODY_BYTES_MAX => {
            Err(CommandError::PayloadTooLarge {
                len: body.len(),
                max: ENVELOPE_INLINE_BODY_BYTES_MAX,
            })
        }
        _ => Ok(()),
    }
}

pub(super) fn no_such(obj: &str) -> CommandError {
    CommandError::NoSuchObject(obj.to_owned())
}

pub(super) fn open_requested(record: &ObjectRecord, cap: Option<String>) -> Event {
    Event::OpenRequested {
        obj: record.obj.clone(),
        kind: record.kind,
        op_id: record.open_id.clone(),
        cap,
    }
}

pub(super) fn op_frame(op: &Op, receipt: u64, floor: Seq) -> Envelope {
    let mut env = Env::new(op.verb);
    env.obj = Some(op.obj.clone());
    env.obj_kind = op.obj_kind;
    env.id = Some(op.id.clone());
    env.seq = Some(op.seq.get());
    env.receipt = Some(receipt);
    env.code = op.code.clone();
    env.reason = op.reason.clone();
    env.cap = op.cap.clone();
    env.floor = Some(floor.get());
    Envelope {
        body: op.body.clone(),
        ..Envelope::new(env)
    }
}

pub(super) fn ack_frame(
    obj: &Address,
    id: &OpId,
    seq: Seq,
    receipt: u64,
    limit: Option<Seq>,
) -> Envelope {
    let mut env = Env::new(Verb::Ack);
    env.obj = Some(obj.clone());
    env.id = Some(id.clone());
    env.seq = Some(seq.get());
    env.receipt = Some(receipt);
    env.limit = limit.map(Seq::get);
    Envelope::new(env)
}

/// A credit update: the peer may transmit seqs of `obj` below `limit`.
pub(super) fn credit_frame(obj: &Address, limit: Seq) -> Envelope {
    let mut env = Env::new(Verb::Ack);
    env.obj = Some(obj.clone());
    env.limit = Some(limit.get());
    Envelope::new(env)
}

/// The first number in `env` that no honest peer sends: a seq, floor, resync point or credit
/// limit at or past [`crate::limits::SUBSTRATE_SEQ_MAX`].
pub(super) fn dishonest_number(env: &Env) -> Option<&'static str> {
    let max = crate::limits::SUBSTRATE_SEQ_MAX;
    [
        (env.seq, "a seq past the bound"),
        (env.floor, "a floor past the bound"),
        (env.from_seq, "a resync point past the bound"),
        (env.limit, "a credit limit past the bound"),
    ]
    .into_iter()
    .find_map(|(value, what)| value.is_some_and(|value| value >= max).then_some(what))
}

/// A floor announcement: every seq of this side's direction of `obj` below `floor` ended or
/// was acked.
pub(super) fn floor_frame(obj: &Address, floor: Seq) -> Envelope {
    let mut env = Env::new(Verb::Resync);
    env.obj = Some(obj.clone());
    env.floor = Some(floor.get());
    Envelope::new(env)
}

/// An unsequenced terminal or transient `err` about op `id` (bounce, denial, out_of_seq).
pub(super) fn substrate_err(obj: &Address, id: &OpId, code: &str) -> Envelope {
    let mut env = Env::new(Verb::Err);
    env.obj = Some(obj.clone());
    env.id = Some(id.clone());
    env.code = Some(code.to_owned());
    Envelope::new(env)
}
