//! The world's egress: frames sent, batches pumped and written, streams stopped, dials and joins completed.

use super::*;

impl World {
    pub(super) fn send(&mut self, n: usize, peer: NodeId, swim: bool) -> Result<(), String> {
        let sim = &mut self.sims[n];
        if sim.closed {
            return Ok(());
        }
        let frame = Frame {
            seq: sim.next_seq,
            swim,
        };
        sim.next_seq += 1;
        sim.sent += 1;
        let now = Time::from_millis(self.now);
        if !sim.writers.contains_key(&peer) {
            match sim.driver.ask_send(now, peer) {
                SendVerdict::Enqueue => {
                    sim.writers.insert(
                        peer,
                        Writer {
                            active_at: self.now,
                            ..Writer::default()
                        },
                    );
                }
                SendVerdict::Dropped(_) => {
                    sim.dropped += 1;
                    return self.actions(n);
                }
            }
        }
        let writer = sim.writers.get_mut(&peer).expect("present");
        if writer.queue.len() >= QUEUE_MAX {
            sim.driver.handle_egress_full(now, 1);
            sim.dropped += 1;
        } else {
            writer.queue.push_back(frame);
        }
        self.actions(n)
    }

    pub(super) fn pump(&mut self, n: usize, peer: NodeId) -> Result<(), String> {
        let now = self.time();
        let sim = &mut self.sims[n];
        let Some(writer) = sim.writers.get_mut(&peer) else {
            return Ok(());
        };
        if writer.queue.is_empty() {
            if !writer.idle_reported {
                writer.idle_reported = true;
                sim.driver.handle_writer_idle(now, peer);
            }
            return self.actions(n);
        }
        let take = writer.queue.len().min(BATCH_MAX);
        let frames: Vec<Frame> = writer.queue.drain(..take).collect();
        writer.active_at = self.now;
        writer.idle_reported = false;
        let swim = frames.iter().any(|f| f.swim);
        writer.last_swim = swim;
        let open = writer.stream;
        match sim.driver.ask_batch(
            now,
            peer,
            frames.len() as u64,
            swim,
            open.map(|(generation, _)| generation),
        ) {
            Some(Batch {
                generation,
                conn,
                open_stream,
            }) => {
                // One stream per connection: kept while its connection is the one the batch
                // goes on, else a new one there; never back to an older connection.
                if open_stream == (open == Some((generation, conn))) {
                    return Err(format!(
                        "node {n}: batch to {} on generation {} over conn {conn} with stream \
                         {open:?} opened a stream: {open_stream}",
                        peer.0[0],
                        generation.get()
                    ));
                }
                if open.is_some_and(|(was, _)| was > generation) {
                    return Err(format!(
                        "node {n}: writer of {} went back from {open:?} to generation {}",
                        peer.0[0],
                        generation.get()
                    ));
                }
                if open_stream {
                    sim.streams_opened += 1;
                } else {
                    sim.streams_kept += 1;
                }
                writer.stream = Some((generation, conn));
                self.writes.push(Write {
                    node: n,
                    peer,
                    generation,
                    conn,
                    frames,
                });
            }
            None => sim.dropped += frames.len() as u64,
        }
        self.actions(n)
    }

    /// The peer stops the stream of node `n`'s writer to `peer` while the writer has nothing
    /// in flight: the writer drops the stream, and the machine fails its generation as a
    /// failed write's (the last batch's SWIM frame reported unsent).
    pub(super) fn stop_stream(&mut self, n: usize, peer: NodeId) -> Result<(), String> {
        // The shell watches for a stop only while its writer has nothing to write.
        if self.writes.iter().any(|w| w.node == n && w.peer == peer)
            || self.sims[n]
                .writers
                .get(&peer)
                .is_some_and(|writer| !writer.queue.is_empty())
        {
            return Ok(());
        }
        let now = self.time();
        let sim = &mut self.sims[n];
        let Some(writer) = sim.writers.get_mut(&peer) else {
            return Ok(());
        };
        let Some((generation, _)) = writer.stream.take() else {
            return Ok(());
        };
        sim.stream_stops += 1;
        let swim = writer.last_swim;
        self.fail_generation(n, peer, generation, swim, |driver| {
            driver.handle_stream_stopped(now, peer, generation);
        })
    }

    pub(super) fn complete_write(&mut self, pick: usize) -> Result<(), String> {
        if self.writes.is_empty() {
            return Ok(());
        }
        // Writes of one writer complete in order (one stream): the first of a random writer.
        let chosen = &self.writes[pick % self.writes.len()];
        let (node, peer) = (chosen.node, chosen.peer);
        let index = self
            .writes
            .iter()
            .position(|w| w.node == node && w.peer == peer)
            .expect("present");
        let write = self.writes.remove(index);
        let alive = self.conns.get(&write.conn).is_some_and(|c| c.alive);
        if alive {
            let to = index_of(&peer).ok_or("a write to a peer outside the world")?;
            let ends = self.conns[&write.conn].ends;
            if !ends.contains(&to) || !ends.contains(&node) {
                return Err(format!(
                    "node {node} wrote to {to} on a connection of {ends:?}"
                ));
            }
            let got = self.sims[to].delivered.entry(node).or_default();
            for frame in &write.frames {
                if got.last().is_some_and(|last| *last >= frame.seq) {
                    return Err(format!(
                        "{node}→{to}: frame {} delivered after {:?}",
                        frame.seq,
                        got.last()
                    ));
                }
                got.push(frame.seq);
            }
            return Ok(());
        }
        let now = self.time();
        let swim = write.frames.iter().any(|f| f.swim);
        let sim = &mut self.sims[node];
        // The writer drops the stream the write failed on (as the shell's does).
        if let Some(writer) = sim.writers.get_mut(&peer) {
            if writer.stream == Some((write.generation, write.conn)) {
                writer.stream = None;
            }
        }
        sim.dropped += write.frames.len() as u64;
        let frames = write.frames.len() as u64;
        self.fail_generation(node, peer, write.generation, swim, |driver| {
            driver.handle_write_failed(now, peer, write.generation, frames, swim);
        })
    }

    /// Node `n` reports that `generation` of its connection to `peer` failed (`fail`: a write
    /// or a stopped stream; `swim` when the lost batch carried a SWIM frame). Laws: evicted
    /// exactly when current, else counted stale with the entry unchanged; a SWIM loss is
    /// reported (unless the node closed).
    pub(super) fn fail_generation(
        &mut self,
        n: usize,
        peer: NodeId,
        generation: crate::driver::Generation,
        swim: bool,
        fail: impl FnOnce(&mut Driver<u64>),
    ) -> Result<(), String> {
        let driver = &mut self.sims[n].driver;
        let current = driver.connection(&peer, Channel::Actor).map(|(g, _)| g);
        let before = driver.counters();
        self.expect_send_failed = swim.then_some((n, peer));
        fail(driver);
        let after = driver.connection(&peer, Channel::Actor).map(|(g, _)| g);
        let counters = driver.counters();
        if current == Some(generation) {
            if after.is_some() || counters.evictions != before.evictions + 1 {
                return Err(format!("node {n}: current generation not evicted"));
            }
        } else if after != current || counters.stale_failures != before.stale_failures + 1 {
            return Err(format!(
                "node {n}: a stale failure of {generation:?} changed the entry {current:?} → \
                 {after:?}"
            ));
        }
        self.actions(n)?;
        if let Some((m, p)) = self.expect_send_failed.take() {
            if !self.sims[m].closed {
                return Err(format!("node {m}: SWIM loss to {} unreported", p.0[0]));
            }
        }
        Ok(())
    }

    pub(super) fn complete_dial(&mut self, pick: usize, succeed: bool) -> Result<(), String> {
        if self.dials.is_empty() {
            return Ok(());
        }
        let (n, peer, _) = self.dials.remove(pick % self.dials.len());
        let conn = if succeed && !self.sims[n].closed {
            self.connect(n, peer)?
        } else {
            None
        };
        let now = self.time();
        let result = conn.ok_or(DialFailure::TimedOut);
        let generation = self.sims[n].driver.ask_dialed(now, peer, result);
        if let Some(conn) = conn {
            self.cached_by(n, conn, peer, Channel::Actor, generation);
        }
        self.actions(n)
    }

    pub(super) fn complete_join(&mut self, pick: usize, succeed: bool) -> Result<(), String> {
        if self.joins.is_empty() {
            return Ok(());
        }
        let (n, peer, _) = self.joins.remove(pick % self.joins.len());
        let now = self.time();
        let conn = if succeed && !self.sims[n].closed {
            self.connect(n, peer)?
        } else {
            None
        };
        match conn {
            Some(conn) => {
                self.sims[n].driver.handle_join_connected(now, peer);
                let generation = self.sims[n].driver.ask_join_sent(now, peer, conn);
                self.cached_by(n, conn, peer, Channel::Actor, generation);
            }
            None => self.sims[n]
                .driver
                .handle_join_failed(now, peer, "no answer"),
        }
        self.actions(n)
    }
}
