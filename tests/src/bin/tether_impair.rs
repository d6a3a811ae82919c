//! `tether-impair`: delays, jitters and reorders the packets the kernel queues to it (an
//! nftables `queue` rule, NFQUEUE), for the namespace tests on kernels without `sch_netem`.
//!
//! Each packet is held for `--delay` ± `--jitter` milliseconds (uniform) and then accepted
//! back to the kernel, which sends it on; with jitter larger than the gap between packets,
//! later packets overtake earlier ones (reordering). `--reorder P` sends P% of the packets
//! on at once, ahead of those held (netem's reorder). Loss and duplication are the kernel's
//! own (nftables `numgen` + `drop`, `dup`; see `tether_tests::netns`).
//!
//! Usage: `tether-impair --queue N --delay MS [--jitter MS] [--reorder PERCENT] [--seed S]`.
//! Runs until killed; prints `ready` once bound, so a caller knows the queue is served.

#[cfg(not(target_os = "linux"))]
fn main() {
    eprintln!("tether-impair: NFQUEUE is Linux's");
    std::process::exit(1);
}

#[cfg(target_os = "linux")]
use std::cmp::Reverse;
#[cfg(target_os = "linux")]
use std::collections::BinaryHeap;
#[cfg(target_os = "linux")]
use std::time::{Duration, Instant};

#[cfg(target_os = "linux")]
use nfq::{Queue, Verdict};

/// Packets held at once; past it a packet is accepted unheld (the run's figures stay
/// honest: nothing is lost here that the rules did not drop).
const HELD_MAX: usize = 65_536;

struct Options {
    queue: u16,
    delay: u64,
    jitter: u64,
    reorder: u64,
    seed: u64,
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        queue: 0,
        delay: 0,
        jitter: 0,
        reorder: 0,
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let number = |value: &str| value.parse::<u64>().map_err(|_| format!("{flag}: {value}"));
        match flag.as_str() {
            "--queue" => {
                options.queue = value.parse().map_err(|_| format!("--queue: {value}"))?;
            }
            "--delay" => options.delay = number(&value)?,
            "--jitter" => options.jitter = number(&value)?,
            "--reorder" => options.reorder = number(&value)?.min(100),
            "--seed" => options.seed = number(&value)?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(options)
}

/// xorshift64*: the hold times need no more than a fast, seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

#[cfg(target_os = "linux")]
fn main() {
    let options = match options() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("tether-impair: {error}");
            std::process::exit(2);
        }
    };
    let mut queue = Queue::open().unwrap_or_else(|error| {
        eprintln!("tether-impair: cannot open a netfilter queue socket: {error}");
        std::process::exit(1)
    });
    if let Err(error) = queue.bind(options.queue) {
        eprintln!(
            "tether-impair: cannot bind queue {}: {error}",
            options.queue
        );
        std::process::exit(1);
    }
    queue.set_nonblocking(true);
    println!("ready");
    let mut rng = Rng(options.seed.max(1));
    let start = Instant::now();
    // Held packets by release time, then arrival (a BinaryHeap of Reverse is a min-heap).
    let mut held = BinaryHeap::new();
    let mut messages = std::collections::HashMap::new();
    let mut arrivals: u64 = 0;
    loop {
        let mut idle = true;
        loop {
            match queue.recv() {
                Ok(mut message) => {
                    idle = false;
                    message.set_verdict(Verdict::Accept);
                    let now = start.elapsed();
                    let skip = rng.below(100) < options.reorder || held.len() >= HELD_MAX;
                    if skip {
                        let _ = queue.verdict(message);
                        continue;
                    }
                    let low = options.delay.saturating_sub(options.jitter);
                    let hold = low + rng.below(2 * options.jitter + 1);
                    let hold = hold.min(options.delay + options.jitter);
                    let due = now + Duration::from_millis(hold);
                    arrivals += 1;
                    held.push(Reverse((due, arrivals)));
                    messages.insert(arrivals, message);
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) => {
                    eprintln!("tether-impair: recv: {error}");
                    std::process::exit(1);
                }
            }
        }
        let now = start.elapsed();
        while let Some(Reverse((due, id))) = held.peek().copied() {
            if due > now {
                break;
            }
            held.pop();
            if let Some(message) = messages.remove(&id) {
                let _ = queue.verdict(message);
            }
            idle = false;
        }
        if idle {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
