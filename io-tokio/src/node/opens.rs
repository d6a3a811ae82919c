//! Opening streams to a peer on the connection the machine names (cached, or a fresh dial it
//! orders), and serving the bidirectional streams of switch and substrate connections.

use super::*;
use tether_core::wire::bifaci::QUIC_STREAM_OPENER;
use tokio::time::timeout;

/// A dial an [`Open::Dial`] ordered under `ticket`: unless it connected, its end is reported
/// when it is dropped: failed (the opens waiting on it fail as well), or abandoned because its
/// caller went away (the next open dials).
pub(super) struct OpenDial {
    pub(super) inner: Arc<Inner>,
    pub(super) peer: NodeId,
    pub(super) channel: Channel,
    pub(super) ticket: DialTicket,
    /// How it ended, unless it connected.
    pub(super) end: Option<DialEnd>,
}

impl Drop for OpenDial {
    fn drop(&mut self) {
        if let Some(end) = self.end {
            let (peer, channel, ticket) = (self.peer, self.channel, self.ticket);
            self.inner.drive(|driver, now| {
                driver.handle_open_dial_failed(now, peer, channel, ticket, end)
            });
        }
    }
}

/// Reports the connection a stream was opened on unresponsive: what ran over it stopped
/// answering (a switch master whose heartbeat went unechoed). The
/// node's machine evicts that connection (that generation only: a newer one stays) and closes
/// it with [`CLOSE_UNRESPONSIVE`], so the next stream to the peer dials afresh rather than
/// queueing behind a peer that no longer reads. [`crate::switch::Switch::connect_iroh`] uses
/// it on every cut of that kind; it does nothing once the node is gone.
#[derive(Clone)]
pub struct ConnectionCut {
    inner: std::sync::Weak<Inner>,
    peer: NodeId,
    channel: Channel,
    generation: Generation,
}

impl std::fmt::Debug for ConnectionCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionCut")
            .field("channel", &self.channel)
            .field("generation", &self.generation.get())
            .finish_non_exhaustive()
    }
}

impl ConnectionCut {
    /// Reports the connection unresponsive (see the type).
    pub fn unresponsive(&self) {
        if let Some(inner) = self.inner.upgrade() {
            let (peer, channel, generation) = (self.peer, self.channel, self.generation);
            inner.drive(|driver, now| driver.handle_unresponsive(now, peer, channel, generation));
        }
    }
}

/// An open waiting on the dial `ticket` (when set): dropped then, it reports that it went
/// away, so the dial's waiters are counted right.
pub(super) struct OpenWait {
    pub(super) inner: Arc<Inner>,
    pub(super) peer: NodeId,
    pub(super) channel: Channel,
    pub(super) ticket: Option<DialTicket>,
}

impl Drop for OpenWait {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            let (peer, channel) = (self.peer, self.channel);
            self.inner
                .drive(|driver, now| driver.handle_open_wait_abandoned(now, peer, channel, ticket));
        }
    }
}

/// Where the machine placed an open once it stopped waiting.
pub(super) enum Placed {
    /// On this cached connection.
    Cached(Generation, Connection),
    /// On a connection this open dials under the ticket, giving up after the timeout.
    Dial(DialTicket, Duration),
}

impl Inner {
    /// A new stream to `addr` on `channel` where the machine says (the allow-list for `path`
    /// first): `open` on the cached connection, whichever side dialed it (a dead one is
    /// evicted, that generation only); with none, on a fresh connection dialed on `alpn`
    /// ([`Inner::dial_cached`]), which `serve` then serves as an accepted one is. While
    /// another open's dial to the peer is in flight, this waits for it.
    pub(super) async fn open_stream_to<S, E, F>(
        self: &Arc<Self>,
        addr: EndpointAddr,
        path: Path,
        channel: Channel,
        alpn: &[u8],
        open: impl Fn(Generation, Connection) -> F,
        serve: impl FnOnce(&Arc<Self>, Generation, Connection),
    ) -> Result<S, NodeError>
    where
        F: std::future::Future<Output = Result<S, E>>,
        E: Into<BoxError>,
    {
        let peer = node_id_of(&addr.id);
        let deadline = self.gate.lock().driver.stream_open_timeout();
        let mut placed = self.open_verdict(peer, path, channel).await?;
        let ticket = loop {
            placed = match placed {
                Placed::Cached(generation, conn) => {
                    match timeout(deadline, open(generation, conn)).await {
                        Ok(Ok(stream)) => return Ok(stream),
                        // Failed, or no stream within the deadline: the connection is dead.
                        Ok(Err(_)) | Err(_) => {
                            self.place(peer, channel, |driver, now| {
                                driver.handle_open_failed(now, peer, channel, generation);
                            })
                            .await?
                        }
                    }
                }
                Placed::Dial(ticket, timeout) => break (ticket, timeout),
            };
        };
        let (generation, conn) = self.dial_cached(addr, alpn, channel, ticket).await?;
        serve(self, generation, conn.clone());
        let error: BoxError = match timeout(deadline, open(generation, conn)).await {
            Ok(Ok(stream)) => return Ok(stream),
            Ok(Err(error)) => error.into(),
            Err(_) => Box::new(OpenTimedOut(deadline)),
        };
        // The fresh connection could not open the stream: the machine evicts it, and this
        // open ends with the error.
        self.drive(|driver, now| {
            driver.handle_fresh_open_failed(now, peer, channel, generation);
        });
        Err(NodeError::Connect(error))
    }

    /// Where the machine places an open to `peer` on `channel` (the allow-list for `path`
    /// first): the cached connection or a dial; while another open's dial is in flight, it
    /// waits for that dial ([`Inner::place`]).
    pub(super) async fn open_verdict(
        self: &Arc<Self>,
        peer: NodeId,
        path: Path,
        channel: Channel,
    ) -> Result<Placed, NodeError> {
        self.place(peer, channel, |driver, now| {
            driver.handle_open(now, peer, path, channel)
        })
        .await
    }

    /// Asks the machine where an open to `peer` on `channel` goes (`ask`: the first question)
    /// and follows its answer until the open is placed: each [`Open::Wait`] asks again once
    /// the machine's state moved (watched from before `ask`, so no move is missed); a failed
    /// dial it waited on, or the node closing, is its error.
    pub(super) async fn place(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        ask: impl FnOnce(&mut Driver<Connection>, Time),
    ) -> Result<Placed, NodeError> {
        let mut changes = self.gate.changes.subscribe();
        let mut verdict = self.ask(ask, Answer::open)?;
        // Dropped while waiting on a dial, the open reports it went away.
        let mut waiting = OpenWait {
            inner: self.clone(),
            peer,
            channel,
            ticket: None,
        };
        loop {
            waiting.ticket = None;
            verdict = match verdict {
                Open::Cached(generation, conn) => return Ok(Placed::Cached(generation, conn)),
                Open::Dial { ticket, timeout } => return Ok(Placed::Dial(ticket, timeout)),
                Open::Failed => return Err(NodeError::Connect(Box::new(WaitedDialFailed))),
                Open::Closed => return Err(NodeError::Closed),
                Open::Wait(ticket) => {
                    waiting.ticket = Some(ticket);
                    changes.changed().await.map_err(|_| NodeError::Closed)?;
                    self.ask(
                        |driver, now| driver.handle_open_waited(now, peer, channel, ticket),
                        Answer::open,
                    )?
                }
            };
        }
    }

    /// Dials `addr` on `alpn`, as the machine's [`Open::Dial`] ordered under `ticket`, and
    /// caches the connection under `channel`: its generation and the connection. A failed or
    /// dropped dial is reported, so the opens waiting on it go on.
    pub(super) async fn dial_cached(
        self: &Arc<Self>,
        addr: EndpointAddr,
        alpn: &[u8],
        channel: Channel,
        (ticket, timeout): (DialTicket, Duration),
    ) -> Result<(Generation, Connection), NodeError> {
        let peer = node_id_of(&addr.id);
        let mut dial = OpenDial {
            inner: self.clone(),
            peer,
            channel,
            ticket,
            end: Some(DialEnd::Abandoned),
        };
        let conn = match tokio::time::timeout(timeout, self.endpoint.connect(addr, alpn)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                dial.end = Some(DialEnd::Failed);
                return Err(NodeError::Connect(error.into()));
            }
            Err(_) => {
                dial.end = Some(DialEnd::Failed);
                return Err(NodeError::Connect(Box::new(DialTimedOut(timeout))));
            }
        };
        dial.end = None;
        let generation = self
            .ask(
                |driver, now| driver.handle_connected(now, peer, channel, conn.clone()),
                Answer::cached,
            )
            .ok_or(NodeError::Closed)?;
        Ok((generation, conn))
    }

    /// A bidirectional stream to `addr` on the connection cached for `channel` (the
    /// switch's or the substrate's), whichever side dialed it; with none (or a dead one), a
    /// fresh connection is dialed on `alpn`, cached, and served as an accepted one is. With
    /// it, the handle that reports that connection unresponsive.
    pub(super) async fn open_bi_cached(
        self: &Arc<Self>,
        addr: EndpointAddr,
        channel: Channel,
        alpn: &[u8],
    ) -> Result<(Connection, SendStream, RecvStream, ConnectionCut), NodeError> {
        let peer = node_id_of(&addr.id);
        self.open_stream_to(
            addr,
            channel.path(),
            channel,
            alpn,
            |generation, conn| async move {
                let (send, recv) = conn.open_bi().await?;
                let cut = ConnectionCut {
                    inner: Arc::downgrade(self),
                    peer,
                    channel,
                    generation,
                };
                Ok::<_, iroh::endpoint::ConnectionError>((conn, send, recv, cut))
            },
            |inner, generation, conn| inner.serve_bi(peer, channel, generation, conn),
        )
        .await
    }

    /// Serves a cached switch or substrate connection (accepted or dialed): each stream the
    /// peer opens on it is one switch connection (to the switch host's queue) or one
    /// substrate link (to the substrate's accept queue); a stream nobody here takes is
    /// stopped as the machine says. Reports the connection's end.
    pub(super) fn serve_bi(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
        conn: Connection,
    ) {
        let inner = self.clone();
        self.spawn(async move {
            while let Ok((send, recv)) = conn.accept_bi().await {
                // Handed over in a task of its own: a full queue holds up that stream, not
                // the next one, nor the report of the connection's end.
                let (opened, conn) = (inner.clone(), conn.clone());
                inner.spawn(async move {
                    opened.stream_opened(peer, channel, &conn, send, recv).await;
                });
            }
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, channel, generation)
            });
        });
    }

    /// Records in the peer book (when the node keeps one) the address an inbound substrate
    /// connection comes from, for after a restart; the file is written off the runtime.
    fn note_substrate_source(self: &Arc<Self>, conn: &Connection) {
        if !self.substrate_peers.persistent() {
            return;
        }
        let paths = conn.paths();
        let Some(path) = paths.iter().find(|path| path.is_selected()) else {
            return;
        };
        let source = path.remote_addr().clone();
        if self
            .substrate_peers
            .with(|book| book.saw(conn.remote_id(), source))
        {
            self.substrate_peers.persist_soon();
        }
    }

    /// A stream `peer` opened on its switch or substrate connection, handed to what serves it.
    pub(super) async fn stream_opened(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        conn: &Connection,
        send: SendStream,
        mut recv: RecvStream,
    ) {
        match (channel, &self.switch_queue, &self.substrate_queue) {
            (Channel::Switch, Some(queue), _) => {
                // The opener's first bytes announce a switch stream; they are read within the
                // machine's open deadline, and whatever is not the announcement (or nothing in
                // time) is stopped below like any stream nobody takes.
                let deadline = self.gate.lock().driver.stream_open_timeout();
                let mut first = [0u8; QUIC_STREAM_OPENER.len()];
                let read = timeout(deadline, recv.read_exact(&mut first)).await;
                let first = matches!(read, Ok(Ok(()))).then_some(&first[..]);
                let verdict = self.ask(
                    |driver, now| driver.handle_stream_opener(now, peer, channel, first),
                    Answer::stream,
                );
                match verdict {
                    StreamVerdict::Continue => {
                        let stream = QuicStream::new(conn.clone(), send, recv);
                        match queue.send((peer.to_string(), stream)).await {
                            Ok(()) => return,
                            // The host stopped taking switch streams.
                            Err(refused) => recv = (refused.0).1.into_recv(),
                        }
                    }
                    StreamVerdict::Stop(code) => {
                        debug!("a switch stream without its announcement");
                        let _ = recv.stop(code.into());
                        return;
                    }
                }
            }
            (Channel::Substrate, _, Some(queue)) => {
                self.note_substrate_source(conn);
                let local = peer_id_of(&self.endpoint.id());
                let remote = peer_id_of(&conn.remote_id());
                match substrate_link::link(conn, send, recv, &remote, &local) {
                    Ok(link) => {
                        // A stopped substrate drops the link (its halves end themselves).
                        let _ = queue.send((remote, link)).await;
                    }
                    Err(error) => debug!(%error, "substrate link not established"),
                }
                return;
            }
            _ => {}
        }
        // Nothing here takes streams on this channel (a switch that is no host, or one whose
        // host stopped taking them): the machine says how to stop it.
        self.judge(peer, channel)
            .stop(&mut recv, Unreadable::Unread);
    }
}
