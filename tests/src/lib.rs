//! tether-tests: end-to-end behaviour tests over real connections on this machine (Unix
//! sockets, TCP on 127.0.0.1). Each file in `tests/` is named after the behaviour it proves.

use tokio::net::UnixStream;

pub mod netns;
pub mod procs;

/// A connected pair of Unix sockets, one end for a switch and one for a host.
pub fn socket_pair() -> (UnixStream, UnixStream) {
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    (
        UnixStream::from_std(a).expect("inside a tokio runtime"),
        UnixStream::from_std(b).expect("inside a tokio runtime"),
    )
}
