//! The gate's inputs and the one executor of the machine's actions: every input goes through
//! `Gate::drive`; the actions it queued are executed here, one after another, never inside one
//! another.

use super::*;

impl Gate {
    pub(super) fn new(config: DriverConfig) -> Self {
        Self {
            state: Mutex::new(State {
                driver: Driver::new(config),
                addrs: PeerBook::new(ADDRESS_BOOK_PEERS_MAX),
            }),
            refusals: watch::channel(Refusals::default()).0,
            changes: watch::channel(0).0,
            timer: Notify::new(),
            started: std::time::Instant::now(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn now(&self) -> Time {
        Time::from_millis(self.started.elapsed().as_millis() as u64)
    }

    /// The instant of machine time `at`.
    pub(super) fn instant(&self, at: Time) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.started + Duration::from_millis(at.as_millis()))
    }

    /// Runs one input whose caller waits on the machine's answer (`pick` takes its kind out
    /// of the [`Answer`], polled under the lock): the answer and the actions the input queued.
    pub(super) fn ask<T>(
        &self,
        input: impl FnOnce(&mut Driver<Connection>, Time),
        pick: impl FnOnce(Answer<Connection>) -> Option<T>,
    ) -> (T, Vec<Action<Connection>>) {
        let (answer, actions) = self.drive(|driver, now| {
            input(driver, now);
            driver.poll_answer()
        });
        let answer = answer
            .and_then(pick)
            .expect("each input that asks is answered, with its own kind of answer");
        (answer, actions)
    }

    /// Runs one input on the machine: what `input` returns and the actions it queued.
    pub(super) fn drive<R>(
        &self,
        input: impl FnOnce(&mut Driver<Connection>, Time) -> R,
    ) -> (R, Vec<Action<Connection>>) {
        let now = self.now();
        let mut state = self.lock();
        let driver = &mut state.driver;
        let (version, timeout) = (driver.version(), driver.poll_timeout());
        let answer = input(driver, now);
        // An answer nobody asked for (the input's caller does not wait on it) goes here.
        drop(driver.poll_answer());
        let actions: Vec<_> = std::iter::from_fn(|| driver.poll_action()).collect();
        let events: Vec<_> = std::iter::from_fn(|| driver.poll_conn_event()).collect();
        let moved = driver.version() != version;
        let rearm = driver.poll_timeout() != timeout;
        let refusals = (moved && *self.refusals.borrow() != *driver.refusals())
            .then(|| driver.refusals().clone());
        drop(state);
        events.into_iter().for_each(report_conn_event);
        if let Some(refusals) = refusals {
            self.refusals.send_replace(refusals);
        }
        if moved {
            self.changes
                .send_modify(|version| *version = version.wrapping_add(1));
        }
        if rearm {
            self.timer.notify_one();
        }
        (answer, actions)
    }

    /// Admits `peer` on `path` (a path whose only machine input is its admission), or counts
    /// the refusal.
    pub(crate) fn admit(
        &self,
        peer: &NodeId,
        path: Path,
        direction: Direction,
    ) -> Result<(), NodeError> {
        let (admitted, _) = self.ask(
            |driver, now| driver.handle_admit(now, peer, path, direction),
            Answer::admitted,
        );
        admitted.map_err(NodeError::from)
    }
}

/// Reports a connection event of the machine: a `tracing` event (`node.conn.ready`,
/// `node.conn.ended` with its cause) and a counter (`tether_node_conn_ready{channel}`,
/// `tether_node_conn_ended{channel,cause}`).
fn report_conn_event(event: ConnEvent) {
    match event {
        ConnEvent::Ready {
            peer,
            channel,
            generation,
            inbound,
        } => {
            let channel = channel.path().as_str();
            metrics::counter!("tether_node_conn_ready", "channel" => channel).increment(1);
            info!(
                event = "node.conn.ready",
                peer = %peer,
                channel,
                generation = generation.get(),
                inbound,
                "connection ready"
            );
        }
        ConnEvent::Ended {
            peer,
            channel,
            generation,
            cause,
        } => {
            let (channel, cause) = (channel.path().as_str(), cause.as_str());
            metrics::counter!("tether_node_conn_ended", "channel" => channel, "cause" => cause)
                .increment(1);
            info!(
                event = "node.conn.ended",
                peer = %peer,
                channel,
                generation = generation.get(),
                cause,
                "connection ended"
            );
        }
    }
}

/// Actions waiting to be executed, each with the node whose machine made it.
pub(super) type Pending = VecDeque<(Arc<Inner>, Action<Connection>)>;

thread_local! {
    /// The actions waiting on this thread, while an [`Executor::run`] drains them.
    static EXECUTING: std::cell::RefCell<Option<Pending>> = const { std::cell::RefCell::new(None) };
}

/// The one loop that executes the machine's actions on a thread: the outermost
/// [`Inner::drive`] drains them, an inner one only queues.
pub(super) struct Executor;

impl Executor {
    pub(super) fn run(inner: &Arc<Inner>, actions: Vec<Action<Connection>>) {
        let outermost = EXECUTING.with(|queue| {
            let mut queue = queue.borrow_mut();
            let outermost = queue.is_none();
            queue
                .get_or_insert_with(VecDeque::new)
                .extend(actions.into_iter().map(|action| (inner.clone(), action)));
            outermost
        });
        if !outermost {
            return;
        }
        // Cleared however the loop ends (an action that panics included), so the thread's
        // next drive drains again.
        struct Done;
        impl Drop for Done {
            fn drop(&mut self) {
                // Taken out first and dropped with no borrow held (what it drops may drive).
                let rest = EXECUTING.with(|queue| queue.borrow_mut().take());
                drop(rest);
            }
        }
        let _done = Done;
        while let Some((inner, action)) =
            EXECUTING.with(|queue| queue.borrow_mut().as_mut().and_then(VecDeque::pop_front))
        {
            inner.execute(action);
        }
    }
}

impl Inner {
    /// Runs one input on the driver machine and executes the actions it queued. Executing an
    /// action may drive the machine again (an announcement is a send, which the machine
    /// judges): those inputs' actions join the queue of the call already draining on this
    /// thread instead of being executed inside it, so the shell never re-enters itself and
    /// actions run one after another in the order the machine made them.
    pub(super) fn drive<R>(
        self: &Arc<Self>,
        input: impl FnOnce(&mut Driver<Connection>, Time) -> R,
    ) -> R {
        let (answer, actions) = self.gate.drive(input);
        if !actions.is_empty() {
            Executor::run(self, actions);
        }
        answer
    }

    /// Runs one input whose caller waits on the machine's answer (`pick` takes its kind out
    /// of the [`Answer`]), polled under the gate's lock before any action runs.
    pub(super) fn ask<T>(
        self: &Arc<Self>,
        input: impl FnOnce(&mut Driver<Connection>, Time),
        pick: impl FnOnce(Answer<Connection>) -> Option<T>,
    ) -> T {
        let (answer, actions) = self.gate.ask(input, pick);
        if !actions.is_empty() {
            Executor::run(self, actions);
        }
        answer
    }

    /// Does what the machine said.
    pub(super) fn execute(self: &Arc<Self>, action: Action<Connection>) {
        match action {
            Action::Dial {
                peer,
                attempt,
                timeout,
            } => {
                let inner = self.clone();
                self.spawn(async move { inner.dial(peer, attempt, timeout).await });
            }
            Action::JoinAttempt {
                peer,
                attempt,
                timeout,
            } => {
                let inner = self.clone();
                self.spawn(async move { inner.join_attempt(peer, attempt, timeout).await });
            }
            Action::KickWriter { peer } => {
                if let Some(queue) = self.egress_read().queues.get(&peer) {
                    queue.wake.kick();
                }
            }
            Action::RetireWriter { peer } => {
                if let Some(queue) = self.egress_read().queues.get(&peer) {
                    queue.wake.retire.store(true, Ordering::Release);
                    queue.wake.kick();
                }
            }
            Action::SendFailed { peer } => {
                if let Some(bridge) = &self.bridge {
                    bridge.send_failed(peer);
                }
            }
            Action::Announce { peer, claim } => {
                let frame = OutFrame {
                    to: peer,
                    dest: ActorAddr::mailbox(peer),
                    type_tag: HOST_CLAIM_TAG.into(),
                    payload: Bytes::copy_from_slice(&claim.encode()),
                };
                if self.sendable(&frame) {
                    self.send(frame);
                }
            }
            Action::StartPublisher {
                collector,
                stream,
                flow_id,
                publisher,
            } => self.start_publisher(collector, stream, flow_id, publisher),
            Action::StopPublisher {
                stream, publisher, ..
            } => {
                if let Some(source) = self.source(&stream) {
                    source.inner.unsubscribe(publisher);
                }
            }
            Action::Close { conn, code } => conn.close(code.into(), b"closed"),
            Action::Dispatch {
                peer,
                conn,
                dispatch,
            } => self.dispatch(peer, conn, dispatch),
        }
    }

    /// The timer task: hands the machine its due timeouts.
    pub(super) async fn timer_loop(self: Arc<Self>) {
        loop {
            let notified = self.gate.timer.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let due = self.gate.lock().driver.poll_timeout();
            match due {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(self.gate.instant(at)) => {
                            self.drive(|driver, now| driver.handle_timeout(now));
                        }
                        () = &mut notified => {}
                    }
                }
                None => notified.await,
            }
        }
    }
}
