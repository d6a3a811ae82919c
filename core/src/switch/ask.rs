//! The switch's answering inputs as calls that return their answer at once, for harnesses,
//! models and tests: each feeds one input and reads its [`Answer`] in the same step, as the
//! shell does.

use super::*;

fn answered<T>(answer: Option<T>) -> T {
    answer.expect("each input that asks is answered, with its own kind of answer")
}

/// Each answering input of [`Switch`], fed and answered in one call.
pub trait Ask {
    /// [`Switch::handle_attach`], answered.
    fn ask_attach(
        &mut self,
        now: Time,
        id: &str,
        nonce: [u8; IDENTITY_NONCE_BYTES],
    ) -> Result<ConnId, AttachError>;
    /// [`Switch::handle_engine_request`], answered.
    fn ask_engine_request(
        &mut self,
        now: Time,
        frame: Frame,
        preferred: Option<&CapUrn>,
    ) -> Result<RequestKey, EngineError>;
    /// [`Switch::handle_engine_frame`], answered.
    fn ask_engine_frame(&mut self, now: Time, frame: Frame) -> Result<(), EngineError>;
    /// [`Switch::handle_cancel`], answered.
    fn ask_cancel(&mut self, now: Time, rid: MessageId, reason: &CancelReason) -> bool;
    /// [`Switch::handle_stop_feeds`], answered.
    fn ask_stop_feeds(&mut self, now: Time, rid: MessageId) -> bool;
}

impl Ask for Switch {
    fn ask_attach(
        &mut self,
        now: Time,
        id: &str,
        nonce: [u8; IDENTITY_NONCE_BYTES],
    ) -> Result<ConnId, AttachError> {
        self.handle_attach(now, id, nonce);
        answered(self.poll_answer().and_then(Answer::attached))
    }

    fn ask_engine_request(
        &mut self,
        now: Time,
        frame: Frame,
        preferred: Option<&CapUrn>,
    ) -> Result<RequestKey, EngineError> {
        self.handle_engine_request(now, frame, preferred);
        answered(self.poll_answer().and_then(Answer::request))
    }

    fn ask_engine_frame(&mut self, now: Time, frame: Frame) -> Result<(), EngineError> {
        self.handle_engine_frame(now, frame);
        answered(self.poll_answer().and_then(Answer::frame))
    }

    fn ask_cancel(&mut self, now: Time, rid: MessageId, reason: &CancelReason) -> bool {
        self.handle_cancel(now, rid, reason);
        answered(self.poll_answer().and_then(Answer::live))
    }

    fn ask_stop_feeds(&mut self, now: Time, rid: MessageId) -> bool {
        self.handle_stop_feeds(now, rid);
        answered(self.poll_answer().and_then(Answer::live))
    }
}

/// Each input of a [`Host`](host::Host), fed with what ended the connection (if it did) in one
/// call.
pub trait HostAsk {
    /// [`host::Host::handle_frame`], then [`host::Host::poll_failure`].
    fn ask_frame(&mut self, now: Time, frame: Frame) -> Result<(), host::HostError>;
    /// [`host::Host::handle_timeout`], then [`host::Host::poll_failure`].
    fn ask_timeout(&mut self, now: Time) -> Result<(), host::HostError>;
}

impl HostAsk for host::Host {
    fn ask_frame(&mut self, now: Time, frame: Frame) -> Result<(), host::HostError> {
        self.handle_frame(now, frame);
        self.poll_failure().map_or(Ok(()), Err)
    }

    fn ask_timeout(&mut self, now: Time) -> Result<(), host::HostError> {
        self.handle_timeout(now);
        self.poll_failure().map_or(Ok(()), Err)
    }
}
