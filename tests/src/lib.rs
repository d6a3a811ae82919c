//! tether-tests: end-to-end behaviour tests over real iroh endpoints on 127.0.0.1.
//!
//! Nothing is here yet: the tests arrive with the iroh transport driver.
