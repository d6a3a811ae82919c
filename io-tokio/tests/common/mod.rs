//! Helpers shared by the integration tests.

/// Yields until `condition` holds (driven by network events and the driver's pumps, never by
/// a timer); panics if it never does.
pub(crate) async fn until(mut condition: impl FnMut() -> bool) {
    for _ in 0..50_000_000u64 {
        if condition() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition never held");
}
