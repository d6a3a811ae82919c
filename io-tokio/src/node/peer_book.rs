//! The peer book: where each substrate peer can be reached, kept in a file across restarts
//! ([`super::NodeBuilder::peer_book`]).
//!
//! A node that restarts finds its substrate peers' durable state in its store, and the
//! substrate dials every recovered peer it has an address for the moment that state is loaded
//! (core's peer machine decides: `Peer::handle_loaded`). Without the book a restarted node
//! knows no address until the application names its peers again, and a peer whose link
//! went to the dead process waits for QUIC's idle timeout to notice (iroh's stateless-reset
//! key is new with every endpoint, so the new process cannot reset the old connection): a
//! fresh link from the restarted node replaces the stale one at once.
//!
//! The book holds the addresses the application gave ([`super::Node::add_substrate_peer`],
//! dialled now and after a restart) and the addresses inbound substrate links came from, for
//! peers the application never named (dialled after a restart only, so that a node still
//! answers the peers that dial it the way it did before). It is a cache of hints, bounded in
//! entries, addresses and bytes; a file that is not one this module wrote is refused with a
//! typed error naming the line, never half-read.
//!
//! The file is text, one peer per line: the endpoint id, then its addresses (`ip:port`, or a
//! relay URL), separated by spaces; `#` starts a comment line. It is replaced atomically
//! (written beside, synced, renamed, the directory synced).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Mutex, PoisonError};

use iroh::{EndpointAddr, PublicKey, RelayUrl, TransportAddr};
use tether_core::substrate::PeerId;

use super::substrate_link::peer_id_of;

use tether_core::limits::{
    PEER_BOOK_ADDRS_PER_PEER_MAX, PEER_BOOK_BYTES_MAX, PEER_BOOK_SEEN_PEERS_MAX,
    PEER_BOOK_WRITE_INTERVAL_MS,
};

const HEADER: &str = "# tether peer book v1: <endpoint id> <ip:port | relay url>...\n";

/// A peer book file that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("peer book {path}: {kind}")]
pub struct PeerBookError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub kind: PeerBookErrorKind,
}

/// What is wrong with a peer book file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerBookErrorKind {
    /// It could not be read or written.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// It is larger than [`PEER_BOOK_BYTES_MAX`].
    #[error("{bytes} bytes, more than the {PEER_BOOK_BYTES_MAX} a book may hold")]
    TooLarge {
        /// Its size.
        bytes: u64,
    },
    /// It is not UTF-8 text.
    #[error("not UTF-8 text")]
    NotText,
    /// A line does not start with an endpoint id.
    #[error("line {line}: not an endpoint id")]
    BadId {
        /// The line, from 1.
        line: usize,
    },
    /// A line has a word that is neither `ip:port` nor a relay URL.
    #[error("line {line}: not an address")]
    BadAddress {
        /// The line, from 1.
        line: usize,
    },
    /// A line has more than [`PEER_BOOK_ADDRS_PER_PEER_MAX`] addresses.
    #[error("line {line}: more than {PEER_BOOK_ADDRS_PER_PEER_MAX} addresses")]
    TooManyAddresses {
        /// The line, from 1.
        line: usize,
    },
    /// A peer has a second line.
    #[error("line {line}: a second entry for one peer")]
    Duplicate {
        /// The line, from 1.
        line: usize,
    },
}

/// Parses a book's text: every entry, or the first thing wrong.
pub(super) fn parse(text: &str) -> Result<Vec<EndpointAddr>, PeerBookErrorKind> {
    let mut entries: Vec<EndpointAddr> = Vec::new();
    let mut ids = std::collections::BTreeSet::new();
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let content = raw.trim();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let mut words = content.split(' ');
        let id = words
            .next()
            .and_then(|word| PublicKey::from_str(word).ok())
            .ok_or(PeerBookErrorKind::BadId { line })?;
        if !ids.insert(id) {
            return Err(PeerBookErrorKind::Duplicate { line });
        }
        let mut addrs = Vec::new();
        for word in words {
            if addrs.len() == PEER_BOOK_ADDRS_PER_PEER_MAX {
                return Err(PeerBookErrorKind::TooManyAddresses { line });
            }
            addrs.push(parse_addr(word).ok_or(PeerBookErrorKind::BadAddress { line })?);
        }
        entries.push(EndpointAddr::from_parts(id, addrs));
    }
    Ok(entries)
}

fn parse_addr(word: &str) -> Option<TransportAddr> {
    if word.contains("://") {
        RelayUrl::from_str(word).ok().map(TransportAddr::Relay)
    } else {
        SocketAddr::from_str(word).ok().map(TransportAddr::Ip)
    }
}

/// One entry's line (without its newline); addresses past the cap and any that text cannot
/// carry are left out.
fn entry_line(addr: &EndpointAddr) -> String {
    let mut line = addr.id.to_string();
    for transport in addr.addrs.iter().take(PEER_BOOK_ADDRS_PER_PEER_MAX) {
        match transport {
            TransportAddr::Ip(socket) => {
                let _ = write!(line, " {socket}");
            }
            TransportAddr::Relay(url) => {
                let _ = write!(line, " {url}");
            }
            _ => {}
        }
    }
    line
}

/// Where each substrate peer can be reached (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Book {
    /// What the substrate dials: the application's addresses, and after a restart the file's.
    dial: BTreeMap<PeerId, EndpointAddr>,
    /// Where inbound links came from, for peers not in `dial`: kept for after a restart.
    seen: BTreeMap<PeerId, EndpointAddr>,
    /// Bumped on every change, so that a writer never replaces newer text with older.
    version: u64,
}

impl Book {
    /// A book of `entries` (a file's), all dialled.
    pub(super) fn with(entries: Vec<EndpointAddr>) -> Self {
        let mut book = Self::default();
        for addr in entries {
            book.dial.insert(peer_id_of(&addr.id), addr);
        }
        book
    }

    /// The address to dial `peer` at.
    pub(super) fn addr_of(&self, peer: &PeerId) -> Option<EndpointAddr> {
        self.dial.get(peer).cloned()
    }

    /// The application gave `addr`: dialled from now on. Whether the book changed.
    pub(super) fn add(&mut self, addr: EndpointAddr) -> bool {
        let peer = peer_id_of(&addr.id);
        self.seen.remove(&peer);
        if self.dial.get(&peer) == Some(&addr) {
            return false;
        }
        self.dial.insert(peer, addr);
        self.version += 1;
        true
    }

    /// An inbound link came from `transport`: kept for a peer the application did not name,
    /// within [`PEER_BOOK_SEEN_PEERS_MAX`] peers and [`PEER_BOOK_ADDRS_PER_PEER_MAX`]
    /// addresses (a full entry drops its lowest address for the new one). Whether the book
    /// changed.
    pub(super) fn saw(&mut self, id: PublicKey, transport: TransportAddr) -> bool {
        let peer = peer_id_of(&id);
        if self.dial.contains_key(&peer) {
            return false;
        }
        let known = self.seen.len();
        match self.seen.get_mut(&peer) {
            Some(entry) if entry.addrs.contains(&transport) => false,
            Some(entry) => {
                while entry.addrs.len() >= PEER_BOOK_ADDRS_PER_PEER_MAX {
                    let oldest = entry.addrs.iter().next().cloned();
                    if let Some(oldest) = oldest {
                        entry.addrs.remove(&oldest);
                    }
                }
                entry.addrs.insert(transport);
                self.version += 1;
                true
            }
            None if known >= PEER_BOOK_SEEN_PEERS_MAX => false,
            None => {
                self.seen
                    .insert(peer, EndpointAddr::from_parts(id, [transport]));
                self.version += 1;
                true
            }
        }
    }

    /// The file's text at this version: the application's entries, then the seen ones,
    /// stopping at the last whole entry within [`PEER_BOOK_BYTES_MAX`].
    pub(super) fn encode(&self) -> (u64, String) {
        let mut text = String::from(HEADER);
        for addr in self.dial.values().chain(self.seen.values()) {
            let line = entry_line(addr);
            if text.len() + line.len() + 1 > PEER_BOOK_BYTES_MAX {
                break;
            }
            text.push_str(&line);
            text.push('\n');
        }
        (self.version, text)
    }
}

/// A peer book and its file.
#[derive(Debug, Default)]
pub(super) struct SharedBook {
    book: Mutex<Book>,
    file: Option<PathBuf>,
    /// The version last written; held while writing, so writes are in order.
    written: Mutex<u64>,
    /// Whether a coalescing writer ([`SharedBook::persist_soon`]) is scheduled or running.
    writer: std::sync::atomic::AtomicBool,
    /// Coalescing writers started.
    writers_started: std::sync::atomic::AtomicU64,
}

impl SharedBook {
    /// The book in `path` (empty when there is no file yet), written back there on change.
    pub(super) fn open(path: PathBuf) -> Result<Self, PeerBookError> {
        let fail = |kind| PeerBookError {
            path: path.clone(),
            kind,
        };
        let entries = match std::fs::File::open(&path) {
            Ok(file) => {
                use std::io::Read;
                let mut bytes = Vec::new();
                let limit = PEER_BOOK_BYTES_MAX as u64 + 1;
                file.take(limit)
                    .read_to_end(&mut bytes)
                    .map_err(|error| fail(error.into()))?;
                if bytes.len() > PEER_BOOK_BYTES_MAX {
                    let bytes = std::fs::metadata(&path).map_or(limit, |meta| meta.len());
                    return Err(fail(PeerBookErrorKind::TooLarge { bytes }));
                }
                let text =
                    String::from_utf8(bytes).map_err(|_| fail(PeerBookErrorKind::NotText))?;
                parse(&text).map_err(fail)?
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(error) => return Err(fail(error.into())),
        };
        Ok(Self {
            book: Mutex::new(Book::with(entries)),
            file: Some(path),
            written: Mutex::new(0),
            writer: std::sync::atomic::AtomicBool::new(false),
            writers_started: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Runs `f` on the book.
    pub(super) fn with<T>(&self, f: impl FnOnce(&mut Book) -> T) -> T {
        f(&mut self.book.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Whether there is a file to write.
    pub(super) fn persistent(&self) -> bool {
        self.file.is_some()
    }

    /// Writes the book soon, off the runtime: one writer at a time, at most one write per
    /// [`PEER_BOOK_WRITE_INTERVAL_MS`], each of the newest version (changes meanwhile are
    /// written together). For what inbound links show, which a peer drives.
    pub(super) fn persist_soon(self: &std::sync::Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.file.is_none() || self.writer.swap(true, Ordering::AcqRel) {
            return;
        }
        self.writers_started.fetch_add(1, Ordering::Relaxed);
        let book = self.clone();
        tokio::task::spawn_blocking(move || loop {
            let failed = book.persist().err();
            std::thread::sleep(std::time::Duration::from_millis(
                PEER_BOOK_WRITE_INTERVAL_MS,
            ));
            book.writer.store(false, Ordering::Release);
            if let Some(error) = failed {
                // The next change tries again; this writer does not retry forever.
                tracing::warn!(%error, "peer book not written");
                return;
            }
            // A change that came while this writer slept is written by this writer, unless
            // a new one took over.
            let (version, written) = (
                book.with(|book| book.version),
                *book.written.lock().unwrap_or_else(PoisonError::into_inner),
            );
            if version == written || book.writer.swap(true, Ordering::AcqRel) {
                return;
            }
        });
    }

    /// Writes the book to its file if it changed since the last write (blocking: the file
    /// is small, and changes come with new peers, not with traffic).
    pub(super) fn persist(&self) -> Result<(), PeerBookError> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let mut written = self.written.lock().unwrap_or_else(PoisonError::into_inner);
        let (version, text) = self.with(|book| book.encode());
        if version == *written {
            return Ok(());
        }
        replace(path, text.as_bytes()).map_err(|error| PeerBookError {
            path: path.clone(),
            kind: error.into(),
        })?;
        *written = version;
        Ok(())
    }
}

/// Replaces `path` with `bytes` atomically: a crash leaves the old file or the new one.
fn replace(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut scratch = path.as_os_str().to_owned();
    scratch.push(".new");
    let scratch = PathBuf::from(scratch);
    let mut file = std::fs::File::create(&scratch)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&scratch, path)?;
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(n: u8) -> PublicKey {
        iroh::SecretKey::from_bytes(&[n; 32]).public()
    }

    #[test]
    fn a_book_round_trips_through_its_text() {
        let relay: RelayUrl = "http://198.19.0.1:3340/".parse().expect("a URL");
        let mut book = Book::default();
        assert!(book.add(
            EndpointAddr::new(key(1))
                .with_ip_addr("198.18.1.2:7000".parse().expect("addr"))
                .with_relay_url(relay.clone())
        ));
        assert!(book.saw(key(2), TransportAddr::Ip("[::1]:9".parse().expect("addr"))));
        let (_, text) = book.encode();
        let entries = parse(&text).expect("its own text");
        assert_eq!(entries.len(), 2);
        let again = Book::with(entries);
        assert_eq!(
            again.addr_of(&peer_id_of(&key(1))),
            book.addr_of(&peer_id_of(&key(1)))
        );
        // What was seen is dialled after a restart.
        assert!(again.addr_of(&peer_id_of(&key(2))).is_some());
        assert!(book.addr_of(&peer_id_of(&key(2))).is_none());
    }

    #[test]
    fn a_file_this_module_did_not_write_is_refused_naming_its_line() {
        let good = key(1).to_string();
        for (text, expected) in [
            (
                format!("{good}\nnot-a-key 1.2.3.4:5\n"),
                "line 2: not an endpoint id",
            ),
            (format!("{good} 1.2.3.4\n"), "line 1: not an address"),
            (format!("{good}\n{good}\n"), "line 2: a second entry"),
            (
                format!("{good}{}\n", " 1.2.3.4:5".repeat(9)),
                "line 1: more than 8 addresses",
            ),
        ] {
            let error = parse(&text).expect_err("refused");
            assert!(error.to_string().starts_with(expected), "{error}");
        }
    }

    #[test]
    fn an_oversized_or_binary_file_is_refused_and_a_missing_one_is_empty() {
        let dir = std::env::temp_dir().join(format!("tether-book-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("peers");
        let _ = std::fs::remove_file(&path);
        let book = SharedBook::open(path.clone()).expect("no file yet");
        assert!(book.with(|book| book.dial.is_empty()));
        std::fs::write(&path, vec![b'#'; PEER_BOOK_BYTES_MAX + 1]).expect("write");
        let error = SharedBook::open(path.clone()).expect_err("too large");
        assert!(matches!(error.kind, PeerBookErrorKind::TooLarge { .. }));
        std::fs::write(&path, [0xff, 0xfe]).expect("write");
        let error = SharedBook::open(path.clone()).expect_err("not text");
        assert!(matches!(error.kind, PeerBookErrorKind::NotText));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_book_is_written_on_change_and_read_back_after_a_restart() {
        let dir = std::env::temp_dir().join(format!("tether-book-rw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("peers");
        let _ = std::fs::remove_file(&path);
        let book = SharedBook::open(path.clone()).expect("open");
        book.with(|book| {
            book.add(EndpointAddr::new(key(3)).with_ip_addr("127.0.0.1:1".parse().expect("addr")))
        });
        book.persist().expect("written");
        let reopened = SharedBook::open(path).expect("reopen");
        assert_eq!(
            reopened.with(|book| book.addr_of(&peer_id_of(&key(3)))),
            book.with(|book| book.addr_of(&peer_id_of(&key(3))))
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    /// A peer reconnecting from ever-new addresses: every change lands in the book, and one
    /// writer takes them all (not a blocking task, and a file write, per connection).
    #[tokio::test]
    async fn writes_for_what_inbound_links_show_are_coalesced() {
        let dir = std::env::temp_dir().join(format!("tether-book-flood-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("peers");
        let _ = std::fs::remove_file(&path);
        let book = std::sync::Arc::new(SharedBook::open(path.clone()).expect("open"));
        for port in 0..200u16 {
            let source = TransportAddr::Ip(SocketAddr::from(([127, 0, 0, 1], port)));
            assert!(book.with(|book| book.saw(key(1), source)));
            book.persist_soon();
        }
        assert_eq!(
            book.writers_started
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        let entry = book.with(|book| book.seen.get(&peer_id_of(&key(1))).cloned());
        assert_eq!(
            entry.expect("seen").addrs.len(),
            PEER_BOOK_ADDRS_PER_PEER_MAX
        );
        drop(book);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn seen_peers_and_their_addresses_are_bounded() {
        let mut book = Book::default();
        for port in 0..(PEER_BOOK_ADDRS_PER_PEER_MAX as u16 + 5) {
            book.saw(
                key(1),
                TransportAddr::Ip(SocketAddr::from(([127, 0, 0, 1], port))),
            );
        }
        let entry = book.seen.get(&peer_id_of(&key(1))).expect("seen");
        assert_eq!(entry.addrs.len(), PEER_BOOK_ADDRS_PER_PEER_MAX);
        for n in 0..=u8::MAX {
            book.saw(
                key(n),
                TransportAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 1))),
            );
        }
        assert!(book.seen.len() <= PEER_BOOK_SEEN_PEERS_MAX);
        // A peer the application names leaves the seen set for the dialled one.
        assert!(book.add(EndpointAddr::new(key(1))));
        assert!(!book.seen.contains_key(&peer_id_of(&key(1))));
        assert!(!book.saw(
            key(1),
            TransportAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 2)))
        ));
    }

    proptest! {
        /// The parser is total: any text is entries or a typed error, never a panic; and
        /// what encode writes parses back to the same entries.
        #[test]
        fn parse_is_total_and_encode_round_trips(
            text in ".{0,400}",
            ports in proptest::collection::vec((1u8..=40, any::<u16>()), 0..30),
        ) {
            let _ = parse(&text);
            let mut book = Book::default();
            for (n, port) in ports {
                book.saw(key(n), TransportAddr::Ip(SocketAddr::from(([10, 0, 0, n], port))));
            }
            let (_, text) = book.encode();
            let entries = parse(&text).expect("its own text");
            let again = Book::with(entries);
            prop_assert_eq!(again.dial.len(), book.seen.len());
            for (peer, addr) in &book.seen {
                prop_assert_eq!(again.dial.get(peer), Some(addr));
            }
        }
    }
}
