//! Summaries of measured samples: the latency percentiles the demo and the benchmarks report.

/// Sorts `samples` and returns the sample at quantile `q` (0.0 to 1.0) by rounded rank, or
/// 0.0 when there are none.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    at(samples, q)
}

/// Sorts `samples` and returns their p50 and p99 (0.0 when there are none).
pub fn p50_p99(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    (at(samples, 0.5), at(samples, 0.99))
}

fn at(sorted: &[f64], q: f64) -> f64 {
    let rank = (sorted.len().saturating_sub(1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    sorted.get(rank).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_rounded_rank() {
        let mut samples: Vec<f64> = (1..=101).rev().map(f64::from).collect();
        assert_eq!(p50_p99(&mut samples), (51.0, 100.0));
        assert_eq!(quantile(&mut samples, 0.0), 1.0);
        assert_eq!(quantile(&mut samples, 1.0), 101.0);
        assert_eq!(p50_p99(&mut [4.0, 2.0]), (4.0, 4.0));
        assert_eq!(p50_p99(&mut []), (0.0, 0.0));
        assert_eq!(quantile(&mut [f64::NAN, 1.0], 0.0), 1.0);
    }
}
