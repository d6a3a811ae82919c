//! The request switch (issue "The request switch core"), each beside a baseline in the same
//! run:
//!
//! - a routing decision among 1,000 registered caps (10 masters × 100 caps), against a linear
//!   scan comparing the request's text with each cap's (the floor of any matcher that looks at
//!   every cap); a request naming its output goes through the switch's output-key index, one
//!   for any output (`media:`) ranks all 1,000;
//! - one REQ → END through the machine (route, register, forward, terminate, answer), against
//!   the request table's register + terminate alone.

use std::hint::black_box;

use criterion::{criterion_main, Criterion, Throughput};
use tether_core::cap::CapUrn;
use tether_core::request::{
    Credits, RequestKey, RequestTable, RequestTableConfig, TerminationKind,
};
use tether_core::switch::ask::Ask;
use tether_core::switch::harness::{response, Harness};
use tether_core::switch::SwitchConfig;
use tether_core::time::Time;
use tether_core::wire::bifaci::{Frame, FrameType, MessageId};

const MASTERS: usize = 10;
const CAPS_PER_MASTER: usize = 100;

fn cap_text(master: usize, index: usize) -> String {
    format!("cap:in=media:text;out=media:format-{index};op=convert-{master}")
}

fn loaded() -> (Harness, Vec<String>) {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let mut all = Vec::new();
    for master in 0..MASTERS {
        let caps: Vec<String> = (0..CAPS_PER_MASTER).map(|i| cap_text(master, i)).collect();
        let refs: Vec<&str> = caps.iter().map(String::as_str).collect();
        h.connect(&format!("m{master}"), &refs);
        all.extend(caps);
    }
    (h, all)
}

fn route(c: &mut Criterion) {
    let mut group = c.benchmark_group("switch/route_1000_caps");
    group.throughput(Throughput::Elements(1));
    let (h, all) = loaded();
    // The last master's last cap: every candidate is looked at before it.
    let wanted = cap_text(MASTERS - 1, CAPS_PER_MASTER - 1);
    let request = CapUrn::parse(&wanted).expect("parses");
    assert!(h.switch.route_for(&request, None).is_some());
    group.bench_function("switch", |b| {
        b.iter(|| black_box(h.switch.route_for(black_box(&request), None)))
    });
    // A request for any output (`out=media:`) cannot use the output index: every cap is ranked.
    let any_output = CapUrn::parse("cap:in=media:text;op=convert-9").expect("parses");
    group.bench_function("switch_any_output_full_scan", |b| {
        b.iter(|| black_box(h.switch.route_for(black_box(&any_output), None)))
    });
    group.bench_function("baseline_text_scan", |b| {
        b.iter(|| black_box(all.iter().position(|cap| cap == black_box(&wanted))))
    });
    group.finish();
}

fn req_end(c: &mut Criterion) {
    let mut group = c.benchmark_group("switch/req_to_end");
    group.throughput(Throughput::Elements(1));
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let conn = h.connect("m", &["cap:in=media:text;out=media:upper"]);
    let now = h.now;
    let mut rid = 0u64;
    group.bench_function("switch", |b| {
        b.iter(|| {
            rid += 1;
            let mut req = Frame::new(FrameType::Req, MessageId::Uint(rid));
            req.cap = Some("cap:in=media:text;out=media:upper".to_owned());
            let key = h.switch.ask_engine_request(now, req, None).expect("routed");
            while let Some(t) = h.switch.poll_transmit() {
                black_box(t);
            }
            h.switch
                .handle_master_frame(now, conn, response(key, FrameType::End, 0));
            while let Some(t) = h.switch.poll_transmit() {
                black_box(t);
            }
            while let Some(e) = h.switch.poll_event() {
                black_box(e);
            }
        })
    });
    let mut table: RequestTable<u64> = RequestTable::new(RequestTableConfig::default());
    group.bench_function("baseline_table_alone", |b| {
        b.iter(|| {
            rid += 1;
            let key = RequestKey {
                xid: MessageId::Uint(rid),
                rid: MessageId::Uint(rid),
            };
            table
                .register(key, rid, Credits::new(32), Time::ZERO)
                .expect("fresh");
            black_box(table.terminate(key, TerminationKind::End, Time::ZERO));
        })
    });
    group.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    route(&mut c);
    req_end(&mut c);
}

criterion_main!(benches);
