//! Accepting connections: the handshake bound, then the machine admits and dispatches each by ALPN.

use super::*;

impl Inner {
    pub(super) async fn accept_loop(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            // The source whose share it counts against: its IP address when it came direct (a
            // relayed one counts against the bound alone).
            let source = match incoming.remote_addr() {
                iroh::endpoint::IncomingAddr::Ip(addr) => Some(addr.ip()),
                _ => None,
            };
            if !self.handshakes.lock().begin_from(source) {
                // Refused before anything is spent on it: no task, no TLS.
                incoming.refuse();
                continue;
            }
            let inner = self.clone();
            self.spawn(async move {
                let handshake = async {
                    let accepting = incoming.accept().ok()?;
                    let deadline =
                        Duration::from_millis(tether_core::limits::QUIC_HANDSHAKE_TIMEOUT_MS);
                    tokio::time::timeout(deadline, accepting).await.ok()?.ok()
                };
                let conn = handshake.await;
                inner.handshakes.lock().end_from(source);
                if let Some(conn) = conn {
                    inner.accepted(conn);
                }
            });
        }
    }

    /// An accepted connection: the machine admits it and says where it goes by ALPN (its
    /// [`Action::Dispatch`], which [`Inner::dispatch`] carries out).
    pub(super) fn accepted(self: &Arc<Self>, conn: Connection) {
        let peer = node_id_of(&conn.remote_id());
        let alpn = conn.alpn().to_vec();
        self.drive(|driver, now| driver.handle_accepted(now, peer, &alpn, conn));
    }

    /// Carries out the machine's [`Action::Dispatch`] of an accepted connection: closes it
    /// with the code the machine names, or serves it where it was cached.
    pub(super) fn dispatch(self: &Arc<Self>, peer: NodeId, conn: Connection, dispatch: Dispatch) {
        if let Some((code, reason)) = dispatch.close() {
            conn.close(code.into(), reason);
        }
        match dispatch {
            Dispatch::Refused(_) => warn!(peer = %peer, "unauthorized peer refused"),
            Dispatch::Actor(generation) => self.read_actor_connection(peer, generation, conn),
            Dispatch::Telemetry(generation) => self.serve_telemetry(peer, generation, conn),
            Dispatch::Protocol(index, generation) => {
                let Some(adapter) = self.adapters.get(usize::from(index)).cloned() else {
                    return;
                };
                self.serve_protocol(adapter, index, generation, peer, conn);
            }
            Dispatch::Switch(generation) => {
                self.serve_bi(peer, Channel::Switch, generation, conn);
            }
            Dispatch::Substrate(generation) => {
                self.serve_bi(peer, Channel::Substrate, generation, conn);
            }
            Dispatch::NoAdapter => {
                debug!(alpn = %String::from_utf8_lossy(conn.alpn()), "no adapter for this ALPN");
            }
            Dispatch::Full => {
                warn!(peer = %peer, "inbound connections at their bound: refused");
            }
        }
    }

    /// Collects the uni streams of a telemetry connection cached under `generation` (either
    /// side may publish on it); reports its end.
    pub(super) fn serve_telemetry(
        self: &Arc<Self>,
        peer: NodeId,
        generation: Generation,
        conn: Connection,
    ) {
        let (inner, sink) = (self.clone(), self.telemetry_sinks.clone());
        self.spawn(async move {
            let (spawner, judge) = (inner.clone(), inner.judge(peer, Channel::Telemetry));
            telemetry::collect(conn, peer, sink, judge, move |stream| spawner.spawn(stream)).await;
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, Channel::Telemetry, generation)
            });
        });
    }

    /// Serves the streams of a cached protocol connection; reports its end.
    pub(super) fn serve_protocol(
        self: &Arc<Self>,
        adapter: Arc<protocol::Adapter>,
        index: u16,
        generation: Generation,
        peer: NodeId,
        conn: Connection,
    ) {
        let (inner, judge) = (self.clone(), self.judge(peer, Channel::Protocol(index)));
        self.spawn(async move {
            let spawner = inner.clone();
            adapter
                .serve(conn, peer, judge, move |task| spawner.spawn(task))
                .await;
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, Channel::Protocol(index), generation)
            });
        });
    }
}
