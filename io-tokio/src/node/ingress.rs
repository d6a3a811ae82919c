//! The actor plane's ingress: reading an actor connection's streams, decoding records, and routing
//! each to its actor, the driver or a drop.

use super::*;

impl Inner {
    /// Reads the streams of an actor connection cached under `generation`; reports its end.
    pub(super) fn read_actor_connection(
        self: &Arc<Self>,
        peer: NodeId,
        generation: Generation,
        conn: Connection,
    ) {
        debug!(peer = %peer, generation = generation.get(), "connection cached");
        let inner = self.clone();
        self.spawn(
            async move {
                while let Ok(recv) = conn.accept_uni().await {
                    let reader = inner.clone();
                    inner.spawn(async move { reader.read_stream(peer, recv).await });
                }
                inner.drive(|driver, now| {
                    driver.handle_connection_closed(now, peer, Channel::Actor, generation)
                });
            }
            .instrument(tracing::debug_span!("reader", peer = %peer)),
        );
    }

    /// A cached connection (or none) and the machine's generation: the reader follows.
    pub(super) fn adopt(
        self: &Arc<Self>,
        peer: NodeId,
        conn: Connection,
        generation: Option<Generation>,
    ) {
        if let Some(generation) = generation {
            self.read_actor_connection(peer, generation, conn);
        }
    }

    /// Decodes actor records from one stream and routes each; a malformed stream is reported
    /// to the machine, which says whether to stop it (the connection stays).
    pub(super) async fn read_stream(self: Arc<Self>, peer: NodeId, mut recv: RecvStream) {
        let mut memo = RouteMemo::new();
        let mut routes = RoutesView::new();
        let mut decoder =
            StreamDecoder::new(ActorDecoder::with_payload_bytes_max(self.payload_bytes_max));
        let mut blocks = ReadBlocks::default();
        loop {
            match recv.read_chunk(NODE_READ_CHUNK_BYTES).await {
                // Copied: iroh's chunks are views of its receive buffers, which a payload the
                // app keeps would pin whole.
                Ok(Some(chunk)) => decoder.push_bytes(blocks.copy(&chunk)),
                Ok(None) | Err(_) => return,
            }
            // The tables as of this chunk at the latest (the bridge may change them meanwhile);
            // the memo holds only while they are the same.
            let (routes, changed) = routes.now(&self);
            if changed {
                memo.clear();
            }
            let routes = &*routes;
            let (mut received, mut delivered) = (0u64, 0u64);
            let fault = loop {
                match decoder.pop() {
                    Ok(Some(record)) => {
                        received += 1;
                        delivered += u64::from(self.deliver(peer, routes, &mut memo, record));
                    }
                    Ok(None) => break None,
                    Err(error) => break Some(error),
                }
            };
            self.counters
                .received
                .fetch_add(received, Ordering::Relaxed);
            self.counters
                .delivered
                .fetch_add(delivered, Ordering::Relaxed);
            if let Some(error) = fault {
                let fatal = error.error.is_fatal();
                let verdict = self.ask(
                    |driver, now| driver.handle_stream_fault(now, peer, Channel::Actor, fatal),
                    Answer::stream,
                );
                if let StreamVerdict::Stop(code) = verdict {
                    let _ = recv.stop(code.into());
                    return;
                }
            }
        }
    }

    /// A snapshot of the routing tables.
    pub(super) fn routes_now(&self) -> Arc<Routes<ActorAddr>> {
        self.routes_view().1
    }

    /// A snapshot of the routing tables, with the version it is at least as new as.
    fn routes_view(&self) -> (u64, Arc<Routes<ActorAddr>>) {
        let version = self.routes_version.load(Ordering::Acquire);
        (version, self.routes_locked())
    }

    fn routes_locked(&self) -> Arc<Routes<ActorAddr>> {
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Routes one record (core's `Routes`) and hands it to the bridge; true when delivered.
    /// A drop is counted by the machine before the next record is handled;
    /// `frames_received` and `frames_delivered` are added once per chunk.
    ///
    /// Inlined into the reader's loop for a record to an actor (the record is not moved
    /// again); driver records and drops go out of line.
    #[inline]
    pub(super) fn deliver(
        self: &Arc<Self>,
        peer: NodeId,
        routes: &Routes<ActorAddr>,
        memo: &mut RouteMemo<ActorAddr>,
        record: ActorRecord,
    ) -> bool {
        let dest = match routes.inbound_memo(memo, &ActorAddr(*record.dest()), record.tag_bytes()) {
            Inbound::Protocol(actor) | Inbound::Actor(actor) => actor,
            Inbound::Driver => return self.driver_record(peer, memo, record),
            Inbound::Drop(reason) => return self.inbound_dropped(reason),
        };
        // The memo holds this record's tag, checked once per run.
        let tag = memo.tag().unwrap_or_default();
        let ok = self
            .bridge
            .as_ref()
            .is_some_and(|bridge| bridge.deliver_raw(dest, tag, record.into_payload()).is_ok());
        if !ok {
            self.inbound_dropped(DropReason::DeliveryFailed);
        }
        ok
    }

    /// A record for the driver: its signature checked here, before the node's lock is taken,
    /// then handed to the machine. Never delivered to an actor (false).
    #[inline(never)]
    fn driver_record(
        self: &Arc<Self>,
        peer: NodeId,
        memo: &RouteMemo<ActorAddr>,
        record: ActorRecord,
    ) -> bool {
        let tag = memo.tag().unwrap_or_default();
        let payload = record.into_payload();
        let checked = DriverRecord::check(tag, &payload);
        self.drive(|driver, now| driver.handle_checked_record(now, peer, checked));
        false
    }

    /// A record not delivered: the machine counts the drop (false).
    #[cold]
    #[inline(never)]
    fn inbound_dropped(self: &Arc<Self>, reason: DropReason) -> bool {
        self.drive(|driver, now| driver.handle_inbound_drop(now, reason));
        false
    }
}

/// Where an actor stream's reader copies its chunks: end to end in one block of
/// [`NODE_READ_BLOCK_BYTES`], each chunk handed to the decoder as its own `Bytes`, so records
/// are views of it (one reference count each, cheaper than splits of a `BytesMut`) and a chunk
/// costs no allocation while the block has room or every record read from it is gone.
#[derive(Default)]
pub(super) struct ReadBlocks {
    block: BytesMut,
}

impl ReadBlocks {
    /// `chunk`, copied.
    pub(super) fn copy(&mut self, chunk: &[u8]) -> Bytes {
        if !self.block.try_reclaim(chunk.len()) {
            self.block = BytesMut::with_capacity(chunk.len().max(NODE_READ_BLOCK_BYTES));
        }
        self.block.extend_from_slice(chunk);
        self.block.split().freeze()
    }
}

/// A reader's or writer's hold on the routing tables between chunks or batches: the version it
/// saw and a weak handle, upgraded for each chunk or batch and let go after it (taking the
/// tables' lock and a strong count per chunk cost more; holding them strong between chunks
/// would make every `host` copy the tables). Taken again when `routes_version` moves or the
/// tables were replaced.
pub(super) struct RoutesView {
    version: u64,
    routes: std::sync::Weak<Routes<ActorAddr>>,
}

impl RoutesView {
    pub(super) fn new() -> Self {
        Self {
            version: u64::MAX,
            routes: std::sync::Weak::new(),
        }
    }

    /// The tables as of now at the latest, and whether they may have changed since the last
    /// call (a route memo is valid only while they have not).
    #[inline]
    pub(super) fn now(&mut self, inner: &Inner) -> (Arc<Routes<ActorAddr>>, bool) {
        if inner.routes_version.load(Ordering::Acquire) == self.version {
            if let Some(routes) = self.routes.upgrade() {
                return (routes, false);
            }
        }
        let view = inner.routes_view();
        self.version = view.0;
        self.routes = Arc::downgrade(&view.1);
        (view.1, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks go end to end into one block and come back byte for byte; the block is used
    /// again once nothing read from it is held, a view the app keeps moves the next chunks to
    /// a new block (and keeps its bytes), and a chunk larger than a block gets its own.
    #[test]
    fn read_blocks_copy_chunks_end_to_end_and_reuse_a_block_nothing_holds() {
        let mut blocks = ReadBlocks::default();
        let chunk = |n: u8, len: usize| vec![n; len];
        let first = blocks.copy(&chunk(1, 1200));
        let second = blocks.copy(&chunk(2, 1200));
        assert_eq!(
            (&first[..], &second[..]),
            (&chunk(1, 1200)[..], &chunk(2, 1200)[..])
        );
        assert_eq!(
            first.as_ptr() as usize + 1200,
            second.as_ptr() as usize,
            "end to end"
        );
        let start = first.as_ptr();
        drop((first, second));
        // Fill the block: the next chunk finds it unheld and starts it again.
        let fill: Vec<Bytes> = (0..NODE_READ_BLOCK_BYTES / 1200 - 2)
            .map(|n| blocks.copy(&chunk(n as u8, 1200)))
            .collect();
        drop(fill);
        let again = blocks.copy(&chunk(3, 1200));
        assert_eq!(again.as_ptr(), start, "the block is used again");
        // A view still held: the block is not reused once full, and the view's bytes stay.
        let kept = again.slice(100..164);
        drop(again);
        let fill: Vec<Bytes> = (0..NODE_READ_BLOCK_BYTES / 1200)
            .map(|n| blocks.copy(&chunk(n as u8, 1200)))
            .collect();
        let old_block = start as usize..start as usize + NODE_READ_BLOCK_BYTES;
        let outside = fill
            .iter()
            .filter(|each| !old_block.contains(&(each.as_ptr() as usize)))
            .count();
        assert_eq!(
            outside, 1,
            "the chunk past the held block's end takes a new block"
        );
        assert_eq!(&kept[..], &[3; 64][..]);
        // Larger than a block: a block of its own size.
        let large = blocks.copy(&chunk(9, 3 * NODE_READ_BLOCK_BYTES));
        assert_eq!(&large[..], &chunk(9, 3 * NODE_READ_BLOCK_BYTES)[..]);
    }
}
