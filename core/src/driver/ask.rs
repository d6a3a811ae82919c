//! The driver's answering inputs as calls that return their answer at once, for harnesses,
//! models and tests: each feeds one input and reads its [`Answer`] in the same step, as a
//! shell does through its gate (`io-tokio`'s `Gate::ask`).

use super::*;
use crate::time::Time;

fn answered<T>(answer: Option<T>) -> T {
    answer.expect("each input that asks is answered, with its own kind of answer")
}

/// The trait and its one impl from one list: `ask_x = handle_x(params) -> answer, pick;`.
macro_rules! asks {
    ($($ask:ident = $handle:ident($($arg:ident: $ty:ty),*) -> $answer:ty, $pick:expr;)*) => {
        /// Each answering input of [`Driver`], fed and answered in one call.
        pub trait Ask<C> {
            $(
                #[doc = concat!("[`Driver::", stringify!($handle), "`], answered.")]
                fn $ask(&mut self, $($arg: $ty),*) -> $answer;
            )*
        }

        impl<C: Clone> Ask<C> for Driver<C> {
            $(
                fn $ask(&mut self, $($arg: $ty),*) -> $answer {
                    self.$handle($($arg),*);
                    answered(self.poll_answer().and_then($pick))
                }
            )*
        }
    };
}

asks! {
    ask_admit = handle_admit(now: Time, peer: &NodeId, path: Path, direction: Direction)
        -> Result<(), Refused>, Answer::admitted;
    ask_connected = handle_connected(now: Time, peer: NodeId, channel: Channel, conn: C)
        -> Option<Generation>, Answer::cached;
    ask_open = handle_open(now: Time, peer: NodeId, path: Path, channel: Channel)
        -> Result<Open<C>, Refused>, Answer::open;
    ask_open_waited = handle_open_waited(
        now: Time,
        peer: NodeId,
        channel: Channel,
        ticket: DialTicket
    ) -> Open<C>, |a| a.open().and_then(Result::ok);
    ask_open_failed = handle_open_failed(
        now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation
    ) -> Open<C>, |a| a.open().and_then(Result::ok);
    ask_send = handle_send(now: Time, peer: NodeId) -> SendVerdict, Answer::send;
    ask_batch = handle_batch(
        now: Time,
        peer: NodeId,
        frames: u64,
        swim: bool,
        stream: Option<Generation>
    ) -> Option<Batch<C>>, Answer::batch;
    ask_stream_fault = handle_stream_fault(now: Time, peer: NodeId, channel: Channel, fatal: bool)
        -> StreamVerdict, Answer::stream;
    ask_stream_opener = handle_stream_opener(
        now: Time,
        peer: NodeId,
        channel: Channel,
        first: Option<&[u8]>
    ) -> StreamVerdict, Answer::stream;
    ask_stream_unread = handle_stream_unread(now: Time, peer: NodeId, channel: Channel)
        -> StreamVerdict, Answer::stream;
    ask_dialed = handle_dialed(now: Time, peer: NodeId, result: Result<C, DialFailure>)
        -> Option<Generation>, Answer::cached;
    ask_join = handle_join(now: Time, peer: NodeId, has_relay: bool, direct_addresses: usize)
        -> Result<(), Refused>, Answer::admitted;
    ask_join_sent = handle_join_sent(now: Time, peer: NodeId, conn: C)
        -> Option<Generation>, Answer::cached;
    ask_register = handle_register(now: Time, claim: HostClaim)
        -> Result<(), RegisterError>, Answer::registered;
    ask_hand_off = handle_hand_off(
        now: Time,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
        handoff: Handoff
    ) -> Result<(), RegisterError>, Answer::registered;
    ask_telemetry_control = handle_telemetry_control(now: Time, collector: NodeId, payload: &[u8])
        -> Option<ControlVerdict>, Answer::control;
    ask_claim = handle_claim(now: Time, peer: NodeId, bytes: &[u8]) -> ClaimVerdict, Answer::claim;
    ask_checked_claim = handle_checked_claim(now: Time, peer: NodeId, claim: CheckedClaim)
        -> ClaimVerdict, Answer::claim;
    ask_send_to_actor = handle_send_to_actor(now: Time, actor: ActorAddr)
        -> Result<NodeId, DropReason>, Answer::route;
}
