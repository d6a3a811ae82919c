//! Publishing this node's telemetry streams to the collectors that subscribe.

use super::*;

impl Inner {
    pub(super) fn source(&self, name: &str) -> Option<TelemetrySource> {
        self.sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// A collector subscribed to local stream `stream`: dial it on the telemetry ALPN and
    /// publish the header (with its flow), then events, until it unsubscribes or goes away.
    pub(super) fn start_publisher(
        self: &Arc<Self>,
        collector: NodeId,
        stream: String,
        flow_id: [u8; 16],
        publisher: Publisher,
    ) {
        let subscription = (collector, stream, flow_id);
        let Some(source) = self.source(&subscription.1) else {
            // The machine knows only streams registered here; end it there all the same.
            self.drive(|driver, now| driver.handle_publisher_ended(now, &subscription, publisher));
            return;
        };
        let events = source.inner.subscribe(publisher);
        let mut header = source.inner.header.clone();
        header.flow_id = flow_id;
        let inner = self.clone();
        self.spawn(async move {
            let result = match inner.address_of(&collector) {
                Some(addr) => inner.publish_to(addr, header, events).await,
                None => Err(NodeError::InvalidNodeId),
            };
            if let Err(error) = result {
                debug!(%error, "telemetry publisher ended");
            }
            // Its end, stopped or on its own; the machine keeps a subscription started again
            // under a newer publisher meanwhile.
            source.inner.unsubscribe(publisher);
            inner.drive(|driver, now| driver.handle_publisher_ended(now, &subscription, publisher));
        });
    }

    /// Publishes `header` then `events` on a new uni stream to the collector at `to`. The
    /// machine says where the stream goes (the allow-list first, then the connection cached
    /// for the peer's telemetry ALPN, whichever side dialed it); a dead cached connection is
    /// evicted and one fresh connection dialed, cached and served as an accepted one is.
    pub(super) async fn publish_to(
        self: &Arc<Self>,
        to: EndpointAddr,
        header: Header,
        events: tokio::sync::mpsc::Receiver<tether_core::wire::telemetry::TelemetryFrame>,
    ) -> Result<(), NodeError> {
        let peer = node_id_of(&to.id);
        let send = self
            .open_stream_to(
                to,
                Path::Telemetry,
                Channel::Telemetry,
                &self.telemetry_alpn,
                |_, conn| async move { conn.open_uni().await },
                |inner, generation, conn| inner.serve_telemetry(peer, generation, conn),
            )
            .await?;
        telemetry::publish(send, header, events).await
    }
}
