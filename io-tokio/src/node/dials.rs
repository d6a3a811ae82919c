//! Reaching peers: the address book, background dials the machine orders, and join attempts.

use super::*;

impl Inner {
    /// Records `addr` as how to reach its peer, with its relays as hints.
    pub(super) fn remember(self: &Arc<Self>, addr: &EndpointAddr) {
        let peer = node_id_of(&addr.id);
        let relays = relay_strings(addr);
        self.drive(|driver, now| driver.handle_relays_seen(now, peer, relays));
        self.gate.lock().addrs.record(peer, addr.clone());
    }

    /// `addr`, or with no relay of its own, with the relays last seen for its peer
    /// (docs/spec/driver.md §4.3: joins record relay hints and normalize seed addresses with them).
    pub(super) fn normalized(&self, addr: EndpointAddr) -> EndpointAddr {
        let given = relay_strings(&addr);
        let relays = self
            .gate
            .lock()
            .driver
            .relays_for(&node_id_of(&addr.id), &given);
        if relays == given {
            return addr;
        }
        relays
            .iter()
            .filter_map(|url| url.parse::<RelayUrl>().ok())
            .fold(addr, EndpointAddr::with_relay_url)
    }

    /// How to reach `peer`: the address last seen, normalized, or its key alone.
    pub(super) fn address_of(&self, peer: &NodeId) -> Option<EndpointAddr> {
        let known = self.gate.lock().addrs.get(peer).cloned();
        match known {
            Some(addr) => Some(self.normalized(addr)),
            None => PublicKey::from_bytes(peer.as_bytes())
                .ok()
                .map(EndpointAddr::new),
        }
    }

    /// One dial attempt the machine ordered; the result goes back to it.
    pub(super) async fn dial(self: Arc<Self>, peer: NodeId, attempt: u32, timeout: Duration) {
        let Some(addr) = self.address_of(&peer) else {
            let failed = Err(DialFailure::NoAddress);
            self.drive(|driver, now| driver.handle_dialed(now, peer, failed));
            return;
        };
        debug!(peer = %peer, attempt, "dialing");
        let connect = self.endpoint.connect(addr, &self.actor_alpn);
        let result = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(error)) => {
                debug!(peer = %peer, attempt, %error, "dial failed");
                Err(DialFailure::Connect)
            }
            Err(_) => {
                debug!(peer = %peer, attempt, "dial timed out");
                Err(DialFailure::TimedOut)
            }
        };
        let conn = result.as_ref().ok().cloned();
        let generation = self.ask(
            |driver, now| driver.handle_dialed(now, peer, result),
            Answer::cached,
        );
        if let Some(conn) = conn {
            self.adopt(peer, conn, generation);
        }
    }

    /// One join attempt the machine ordered: connect, write a `JoinRequest` to the seed's
    /// mailbox; each step goes back to the machine.
    pub(super) async fn join_attempt(
        self: Arc<Self>,
        peer: NodeId,
        attempt: u32,
        timeout: Duration,
    ) {
        let Some(seed) = self.address_of(&peer) else {
            self.drive(|driver, now| driver.handle_join_failed(now, peer, "invalid node id"));
            return;
        };
        debug!(seed = %peer, attempt, "join attempt");
        let connect = self.endpoint.connect(seed, &self.actor_alpn);
        let conn = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                let error = error.to_string();
                self.drive(|driver, now| driver.handle_join_failed(now, peer, error));
                return;
            }
            Err(_) => {
                self.drive(|driver, now| driver.handle_join_failed(now, peer, "attempt timed out"));
                return;
            }
        };
        self.drive(|driver, now| driver.handle_join_connected(now, peer));
        match self.write_join_request(&conn, peer).await {
            Ok(()) => {
                let generation = self.ask(
                    |driver, now| driver.handle_join_sent(now, peer, conn.clone()),
                    Answer::cached,
                );
                self.adopt(peer, conn, generation);
            }
            Err(error) => self.drive(|driver, now| driver.handle_join_failed(now, peer, error)),
        }
    }

    /// Writes a `JoinRequest` record (payload: this node's id) to the seed's mailbox.
    pub(super) async fn write_join_request(
        &self,
        conn: &Connection,
        seed: NodeId,
    ) -> Result<(), String> {
        let record = tether_core::driver::join_request(seed, self.local);
        let mut buf = BytesMut::new();
        record
            .encode(self.payload_bytes_max, &mut buf)
            .map_err(|e| e.to_string())?;
        let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
        send.write_all(&buf).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        Ok(())
    }
}
