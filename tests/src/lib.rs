//! tether-tests: end-to-end behaviour tests over real connections on this machine (Unix
//! sockets, TCP on 127.0.0.1). Each file in `tests/` is named after the behaviour it proves.
