//! tether-core: every wire format and protocol decision of tether, with no I/O.
//!
//! This crate is a pure function of its inputs, the time passed in and a seed passed in. It has
//! no tokio, no iroh, no sockets, no threads, no clock reads, no OS randomness and no disk
//! (enforced by `clippy.toml`). Shells (`tether`, `tether-sim`) move bytes and time in and out.
//!
//! # Wire codecs
//!
//! [`wire`] holds the four formats tether speaks, each with an incremental decoder built on
//! [`wire::StreamDecoder`]: push bytes in any split with [`wire::StreamDecoder::push`], pop
//! complete items with [`wire::StreamDecoder::pop`] until it returns `Ok(None)`, and call
//! [`wire::StreamDecoder::finish`] at end of stream to learn whether a truncated tail is left.
//!
//! Every decoder in this crate:
//! - never panics on any input;
//! - never allocates past a named limit from [`limits`];
//! - is strict: trailing bytes, reserved bits, non-minimal encodings and unknown fields are
//!   typed errors;
//! - is zero-copy: payloads are [`bytes::Bytes`] slices of the buffer the bytes arrived in.
//!
//! Every encoder checks the same limits its decoder enforces and returns a typed error instead
//! of writing bytes its peer would reject.
//!
//! # Cap URNs
//!
//! [`cap`] parses the tagged, media and cap URNs that name what a peer can do, and decides
//! which registered caps can handle a request and in what order ([`cap::is_dispatchable`],
//! [`cap::rank`]). Like the decoders it never panics on any input and bounds its work by named
//! limits.

#![forbid(unsafe_code)]

/// Takes each kind of answer out of a machine's `Answer` (`None` for another kind): one
/// method per kind, named in the list, for the shells and harnesses that poll it.
macro_rules! answer_picks {
    ($ty:ty $(, $g:ident)?; $($(#[$doc:meta])* $name:ident: $($variant:ident)|+ => $out:ty;)*) => {
        impl$(<$g>)? $ty {
            $(
                $(#[$doc])*
                pub fn $name(self) -> Option<$out> {
                    match self {
                        $(Self::$variant(answer))|+ => Some(answer),
                        #[allow(unreachable_patterns)]
                        _ => None,
                    }
                }
            )*
        }
    };
}

pub mod cap;
pub mod channel;
pub mod driver;
pub mod limits;
pub mod request;
pub mod retry;
pub mod ring;
pub mod stats;
pub mod substrate;
pub mod switch;
pub mod time;
pub mod wire;
