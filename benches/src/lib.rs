//! tether-benches: criterion benchmarks, each reported beside a baseline measured in the same
//! run (`cargo bench -p tether-benches`).
