//! `tether switch` and `tether host`: tether's request switch and host pointed at anything that
//! speaks bifaci version 6 over Unix sockets, capdag's own masters and switch included.
//!
//! - `tether switch --master unix:PATH [--master unix:PATH]... call CAP [--input TEXT]` attaches
//!   each master (listening on its path), makes one request with TEXT as its one input chunk,
//!   prints the answer's text and exits 0; an ERR answer prints its code and message and exits
//!   1; a master that cannot be reached or attached exits 2 with a sentence saying why.
//! - `tether host --listen unix:PATH [--echo CAP]... [--upper CAP]...` serves the built-in
//!   handlers (echo the input; uppercase it) to every switch that connects to PATH, until
//!   killed.
//!
//! Payloads travel as capdag writes them: each CHUNK one CBOR byte (or text) string.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tether::switch::host::{Host, HostRequest};
use tether::switch::{payload_content, payload_item, NetworkPolicy, Switch, SwitchError};
use tether_core::cap::CapUrn;
use tether_core::switch::error_code;
use tether_core::wire::bifaci::{meta_text, Frame, FrameType};

/// Why a `tether switch` or `tether host` run failed, in a sentence.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BifaciError {
    /// An endpoint that is not `unix:PATH`.
    #[error("`{0}` is not unix:PATH (only Unix sockets are supported here)")]
    NotUnix(String),
    /// The cap does not parse.
    #[error("`{cap}` is not a cap URN: {error}")]
    BadCap {
        /// The text given.
        cap: String,
        /// Why.
        error: tether_core::cap::ParseError,
    },
    /// Nothing listens on the path, or it refused.
    #[error("could not reach a master at {path}: {error}")]
    Unreachable {
        /// The socket.
        path: String,
        /// Why.
        error: String,
    },
    /// The other side is not a bifaci version 6 master, or failed its checks.
    #[error(
        "the master at {path} did not attach: {error} (is it a bifaci version 6 master, as capdag 1.524.58 writes?)"
    )]
    Attach {
        /// The socket.
        path: String,
        /// Why.
        error: SwitchError,
    },
    /// The request could not be made.
    #[error("the request was refused: {0}")]
    Request(SwitchError),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The listening socket could not be made.
    #[error("could not listen on {path}: {error}")]
    Listen {
        /// The socket.
        path: String,
        /// Why.
        error: std::io::Error,
    },
}

/// `unix:PATH` as a path.
pub(crate) fn unix_path(endpoint: &str) -> Result<PathBuf, BifaciError> {
    endpoint
        .strip_prefix("unix:")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| BifaciError::NotUnix(endpoint.to_owned()))
}

/// What `tether switch ... call` found: the answer's text, or the ERR's code and message.
pub(crate) enum Answer {
    /// END: the CHUNKs' text.
    Body(Vec<u8>),
    /// ERR.
    Failed {
        /// Its code.
        code: String,
        /// Its message.
        message: String,
    },
}

/// Attaches every master, makes one request for `cap` with `input`, and reads its answer.
pub(crate) async fn call(
    masters: &[String],
    policy: NetworkPolicy,
    cap: &str,
    input: Option<&str>,
    deadline: Duration,
) -> Result<Answer, BifaciError> {
    let parsed = CapUrn::parse(cap).map_err(|error| BifaciError::BadCap {
        cap: cap.to_owned(),
        error,
    })?;
    let switch = Switch::builder().policy(policy).start();
    for (index, endpoint) in masters.iter().enumerate() {
        let path = unix_path(endpoint)?;
        let stream = tokio::net::UnixStream::connect(&path)
            .await
            .map_err(|error| BifaciError::Unreachable {
                path: path.display().to_string(),
                error: error.to_string(),
            })?;
        let attached = tokio::time::timeout(
            deadline,
            switch.add_master(&format!("master-{index}"), stream),
        )
        .await
        .map_err(|_| BifaciError::Timeout(deadline))?;
        attached.map_err(|error| BifaciError::Attach {
            path: path.display().to_string(),
            error,
        })?;
    }
    let answer = tokio::time::timeout(deadline, request(&switch, cap, &parsed, input))
        .await
        .map_err(|_| BifaciError::Timeout(deadline))?;
    switch.close().await;
    answer
}

async fn request(
    switch: &Switch,
    cap: &str,
    parsed: &CapUrn,
    input: Option<&str>,
) -> Result<Answer, BifaciError> {
    let mut call = switch.request(cap).await.map_err(BifaciError::Request)?;
    let media = parsed.input().to_string();
    let chunks = input.map(|input| payload_item(input.as_bytes()));
    call.send_input("input", &media, chunks)
        .await
        .map_err(BifaciError::Request)?;
    let mut body = Vec::new();
    while let Some(frame) = call.next().await {
        match frame.frame_type {
            FrameType::Chunk => body.extend_from_slice(&chunk_text(&frame)),
            FrameType::End => return Ok(Answer::Body(body)),
            FrameType::Err => return Ok(failed(&frame)),
            _ => {}
        }
    }
    Err(BifaciError::Request(SwitchError::Closed))
}

/// A CHUNK's bytes: the content of its CBOR string, or its payload as it is.
fn chunk_text(frame: &Frame) -> Vec<u8> {
    let payload = frame.payload.clone().unwrap_or_default();
    payload_content(&payload).unwrap_or(&payload).to_vec()
}

fn failed(frame: &Frame) -> Answer {
    let text = |key| {
        frame
            .meta
            .as_ref()
            .and_then(|meta| meta_text(meta, key))
            .unwrap_or_default()
            .to_owned()
    };
    Answer::Failed {
        code: error_code(frame).unwrap_or_default(),
        message: text("message"),
    }
}

/// The input's text, from its CHUNKs to its END.
async fn input_of(request: &mut HostRequest) -> Vec<u8> {
    let mut text = Vec::new();
    while let Some(frame) = request.next_input().await {
        match frame.frame_type {
            FrameType::Chunk => text.extend_from_slice(&chunk_text(&frame)),
            FrameType::End | FrameType::Err => break,
            _ => {}
        }
    }
    text
}

/// Answers `request` with `f` of its input, as one CBOR byte string.
async fn answer(mut request: HostRequest, f: fn(Vec<u8>) -> Vec<u8>) {
    let text = f(input_of(&mut request).await);
    let _ = request
        .respond("result", &media_out(request.cap()), [payload_item(&text)])
        .await;
    let _ = request.end().await;
}

/// The output media of `cap` (`media:` when it does not parse).
fn media_out(cap: &str) -> String {
    CapUrn::parse(cap).map_or_else(|_| "media:".to_owned(), |cap| cap.output().to_string())
}

/// Serves `echo` and `upper` caps to every switch that connects to `path`, until killed.
/// `ready` is called once it listens.
pub(crate) async fn host(
    path: &Path,
    echo: &[String],
    upper: &[String],
    ready: impl FnOnce(),
) -> Result<(), BifaciError> {
    let listen_error = |error| BifaciError::Listen {
        path: path.display().to_string(),
        error,
    };
    // A socket left by an earlier run is replaced; anything else at the path is not touched.
    if std::fs::symlink_metadata(path).is_ok_and(|meta| {
        use std::os::unix::fs::FileTypeExt;
        meta.file_type().is_socket()
    }) {
        std::fs::remove_file(path).map_err(listen_error)?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(listen_error)?;
    ready();
    loop {
        let (stream, _) = listener.accept().await.map_err(listen_error)?;
        let mut host = Host::new("tether-host");
        for cap in echo {
            host = host.handler(cap, |request| answer(request, |text| text));
        }
        for cap in upper {
            host = host.handler(cap, |request| {
                answer(request, |text| text.to_ascii_uppercase())
            });
        }
        tokio::spawn(async move {
            if let Err(error) = host.serve(stream).await {
                eprintln!(
                    "tether host: a switch's connection ended: {error} (is it a bifaci version 6 switch, as capdag 1.524.58 writes?)"
                );
            }
        });
    }
}
