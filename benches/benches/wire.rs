//! Wire codec benchmarks (filled in below).
fn main() {}
