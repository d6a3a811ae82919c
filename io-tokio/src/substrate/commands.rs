//! A peer task's command channel, with two lanes.
//!
//! - The **ops** lane (open, send, req, close) holds at most [`SUBSTRATE_COMMANDS_MAX`]
//!   commands. A command issued while it is full waits inside the caller's [`Pending`] (in
//!   issue order: a later command never passes a waiting one), so an app that issues without
//!   awaiting holds its own backlog, and dropping a `Pending` that still waits withdraws its
//!   command. The task stops taking ops while an object has [`SUBSTRATE_WAITING_SENDS_MAX`]
//!   sends waiting for outbox room; the lane then fills and callers wait.
//! - The **control** lane (consume, answer, accept or reject, a reply part read, a new link,
//!   shutdown) is never held back: each entry answers something the peer delivered, so its
//!   length is bounded by what the machine delivers (the inbox bound per object, the reply
//!   bound per request), and a task that waits for room for new ops must never stop hearing
//!   that the app consumed.
//!
//! [`Pending`]: super::Pending
//! [`SUBSTRATE_WAITING_SENDS_MAX`]: tether_core::limits::SUBSTRATE_WAITING_SENDS_MAX

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Waker};

use tether_core::limits::SUBSTRATE_COMMANDS_MAX;

use tether_core::substrate::{peer, OpId};
use tokio::sync::oneshot;

use super::{Error, ReplySink};

/// A reply to one command.
pub(super) type Reply1<T> = oneshot::Sender<Result<T, Error>>;

/// What the app and the accept loop ask of a peer's task.
pub(super) enum Command {
    /// An app command for the peer, and where its answers go (`None`: a consume).
    App(peer::Command, Option<Answer>),
    /// An inbound link whose handshake verified (it replaces the live link).
    Attach(Box<super::preauth::Verified>),
    /// The app named this peer: a task without a link, a dial in flight or one scheduled
    /// dials now if it has an address (it may have learned one since it started, as a peer
    /// loaded from the store before the app said how to reach it).
    Reach,
    /// The app read a `res` part of this many bytes of the req with this ticket.
    ReplyRead(peer::Ticket, usize),
    /// Drop the current link as a network cut would.
    Disconnect,
    Shutdown(oneshot::Sender<()>),
}

/// Where the answers to one command go.
pub(super) enum Answer {
    Unit(Reply1<()>),
    Sent(Reply1<OpId>),
    Req(ReplySink),
}

/// A command issued while the ops lane was full: it waits here until the task makes room.
/// Only the caller's `Pending` holds it strongly; the lane keeps a weak reference, so a caller
/// that gives up takes its command with it.
pub(super) type Slot = Mutex<Option<Command>>;

#[derive(Default)]
struct State {
    control: VecDeque<Command>,
    ops: VecDeque<Command>,
    waiting: VecDeque<Weak<Slot>>,
    receiver: Option<Waker>,
    closed: bool,
}

struct Chan {
    state: Mutex<State>,
    bound: usize,
}

impl Chan {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Creates a peer task's command channel.
pub(super) fn channel() -> (CommandTx, CommandRx) {
    bounded(SUBSTRATE_COMMANDS_MAX)
}

fn bounded(bound: usize) -> (CommandTx, CommandRx) {
    let chan = Arc::new(Chan {
        state: Mutex::default(),
        bound,
    });
    (CommandTx { chan: chan.clone() }, CommandRx { chan })
}

/// What became of an issued op command.
pub(super) enum Issued {
    /// It is in the lane (or the channel is closed and it was dropped, which answers its
    /// caller `Shutdown`).
    Queued,
    /// The lane is full: it waits in this slot, which the caller must keep.
    Waiting(Arc<Slot>),
}

/// Sends commands to a peer's task.
#[derive(Clone)]
pub(super) struct CommandTx {
    chan: Arc<Chan>,
}

impl std::fmt::Debug for CommandTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommandTx")
    }
}

impl CommandTx {
    /// Issues an op command: queued now when the lane has room and nothing waits, otherwise
    /// held in a slot behind the commands already waiting.
    pub(super) fn issue(&self, command: Command) -> Issued {
        let mut state = self.chan.lock();
        if state.closed {
            return Issued::Queued;
        }
        if state.waiting.is_empty() && state.ops.len() < self.chan.bound {
            state.ops.push_back(command);
            wake(&mut state);
            return Issued::Queued;
        }
        let slot = Arc::new(Mutex::new(Some(command)));
        state.waiting.push_back(Arc::downgrade(&slot));
        Issued::Waiting(slot)
    }

    /// Sends a control command (never held back). Dropped when the task is gone.
    pub(super) fn control(&self, command: Command) {
        let mut state = self.chan.lock();
        if !state.closed {
            state.control.push_back(command);
            wake(&mut state);
        }
    }

    /// Whether both senders feed the same task.
    pub(super) fn same_channel(&self, other: &CommandTx) -> bool {
        Arc::ptr_eq(&self.chan, &other.chan)
    }

    /// Commands in the ops lane, and commands waiting in callers for room in it.
    pub(super) fn backlog(&self) -> (usize, usize) {
        let state = self.chan.lock();
        let waiting = state
            .waiting
            .iter()
            .filter(|slot| slot.strong_count() > 0)
            .count();
        (state.ops.len(), waiting)
    }
}

fn wake(state: &mut State) {
    if let Some(waker) = state.receiver.take() {
        waker.wake();
    }
}

/// The peer task's end.
pub(super) struct CommandRx {
    chan: Arc<Chan>,
}

impl CommandRx {
    /// The next command: control first; ops only when `take_ops`.
    pub(super) async fn recv(&mut self, take_ops: bool) -> Command {
        poll_fn(|cx| self.poll_recv(cx, take_ops)).await
    }

    /// No command is queued or waiting for room.
    pub(super) fn is_idle(&self) -> bool {
        let state = self.chan.lock();
        state.control.is_empty()
            && state.ops.is_empty()
            && state.waiting.iter().all(|slot| slot.strong_count() == 0)
    }

    /// The next command if one is ready.
    pub(super) fn try_recv(&mut self, take_ops: bool) -> Option<Command> {
        let mut state = self.chan.lock();
        self.take(&mut state, take_ops)
    }

    fn poll_recv(&mut self, cx: &mut Context<'_>, take_ops: bool) -> Poll<Command> {
        let mut state = self.chan.lock();
        match self.take(&mut state, take_ops) {
            Some(command) => Poll::Ready(command),
            None => {
                state.receiver = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn take(&self, state: &mut State, take_ops: bool) -> Option<Command> {
        if let Some(command) = state.control.pop_front() {
            return Some(command);
        }
        if !take_ops {
            return None;
        }
        let command = state.ops.pop_front()?;
        // Room: the oldest waiting commands move into the lane, in issue order.
        while state.ops.len() < self.chan.bound {
            let Some(waiting) = state.waiting.pop_front() else {
                break;
            };
            let moved = waiting
                .upgrade()
                .and_then(|slot| slot.lock().unwrap_or_else(PoisonError::into_inner).take());
            state.ops.extend(moved);
        }
        Some(command)
    }
}

impl Drop for CommandRx {
    /// The task is gone: every queued and waiting command is dropped, which answers its
    /// caller `Shutdown`.
    fn drop(&mut self) {
        let mut state = self.chan.lock();
        state.closed = true;
        let (control, ops) = (
            std::mem::take(&mut state.control),
            std::mem::take(&mut state.ops),
        );
        let waiting: Vec<Command> = std::mem::take(&mut state.waiting)
            .into_iter()
            .filter_map(|slot| slot.upgrade())
            .filter_map(|slot| slot.lock().unwrap_or_else(PoisonError::into_inner).take())
            .collect();
        drop(state);
        drop((control, ops, waiting));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::substrate::Error;
    use tether_core::substrate::peer::Command as PeerCommand;
    use tokio::sync::oneshot;

    fn close(obj: &str) -> (Command, oneshot::Receiver<Result<(), Error>>) {
        let (reply, rx) = oneshot::channel();
        let close = PeerCommand::Close {
            obj: obj.into(),
            reason: String::new(),
        };
        let command = Command::App(close, Some(Answer::Unit(reply)));
        (command, rx)
    }

    fn obj_of(command: &Command) -> String {
        match command {
            Command::App(command, _) => command.object().to_owned(),
            _ => panic!("a close"),
        }
    }

    #[test]
    fn a_full_lane_holds_later_commands_in_their_callers_in_issue_order() {
        let (tx, mut rx) = bounded(2);
        let mut slots = Vec::new();
        let mut replies = Vec::new();
        for n in 0..5 {
            let (command, reply) = close(&n.to_string());
            replies.push(reply);
            if let Issued::Waiting(slot) = tx.issue(command) {
                slots.push(slot);
            }
        }
        assert_eq!(slots.len(), 3, "two fit the lane, three wait");
        assert_eq!(tx.backlog(), (2, 3));
        // The caller of #3 gives up: its command is withdrawn, the others keep their order.
        drop(slots.remove(1));
        let order: Vec<String> = std::iter::from_fn(|| rx.try_recv(true))
            .map(|command| obj_of(&command))
            .collect();
        assert_eq!(order, ["0", "1", "2", "4"]);
        assert_eq!(tx.backlog(), (0, 0));
    }

    #[test]
    fn control_passes_ops_and_is_taken_while_ops_are_held_back() {
        let (tx, mut rx) = bounded(2);
        let (op, _op_reply) = close("op");
        assert!(matches!(tx.issue(op), Issued::Queued));
        let consume = PeerCommand::Consume {
            obj: tether_core::substrate::Address::parse("q").expect("an address"),
            seq: tether_core::substrate::Seq(1),
        };
        tx.control(Command::App(consume, None));
        assert!(matches!(
            rx.try_recv(false),
            Some(Command::App(
                PeerCommand::Consume {
                    seq: tether_core::substrate::Seq(1),
                    ..
                },
                None
            ))
        ));
        assert!(rx.try_recv(false).is_none(), "ops held back");
        assert!(matches!(
            rx.try_recv(true),
            Some(Command::App(PeerCommand::Close { .. }, _))
        ));
    }

    #[test]
    fn a_closed_channel_answers_queued_and_waiting_callers() {
        let (tx, rx) = bounded(1);
        let (first, mut first_reply) = close("a");
        let (second, mut second_reply) = close("b");
        assert!(matches!(tx.issue(first), Issued::Queued));
        let Issued::Waiting(_slot) = tx.issue(second) else {
            panic!("the lane is full");
        };
        drop(rx);
        assert!(
            first_reply.try_recv().is_err(),
            "dropped: the caller hears Shutdown"
        );
        assert!(
            second_reply.try_recv().is_err(),
            "dropped: the caller hears Shutdown"
        );
        let (late, mut late_reply) = close("c");
        assert!(matches!(tx.issue(late), Issued::Queued));
        assert!(late_reply.try_recv().is_err());
    }
}
