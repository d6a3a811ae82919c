//! tether against the published capdag (PyPI `capdag==1.524.58`), with real processes and
//! Unix sockets on this machine:
//!
//! 1. capdag masters (`tests/capdag/master.py`: capdag's `RelaySlave` in front of its
//!    `InProcessCartridgeHost`) attached to tether's `Switch`: requests routed by cap, a
//!    streamed answer, a peer call from one capdag handler to another through tether's switch,
//!    CANCEL, CLOSE_STREAM, a master killed mid-request (`MASTER_DIED`, nothing left) and its
//!    reattachment;
//! 2. tether's `Host` attached to capdag's `RelaySwitch` (`tests/capdag/switch.py`): identity
//!    passes, capdag routes to it, the POLICY reaches the handlers, a cancel ends the request.
//!
//! The interpreter is `TETHER_CAPDAG_PYTHON` (`.ci/run` sets it to the virtual environment it
//! installs capdag into), else a `python3` that imports capdag. Where neither exists the tests
//! say so loudly and pass: they cannot run without capdag.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use tether::switch::host::Host;
use tether::switch::{payload_content, payload_item, NetworkPolicy, Switch};
use tether_core::request::CancelReason;
use tether_core::switch::error_code;
use tether_core::wire::bifaci::{Frame, FrameType};

const MEDIA: &str = "media:enc=utf-8;text";
const UPPER: &str = r#"cap:in="media:enc=utf-8;text";op=uppercase;out="media:enc=utf-8;text""#;
const COUNT: &str = r#"cap:in="media:enc=utf-8;text";op=count;out="media:enc=utf-8;text""#;
const SHOUT: &str = r#"cap:in="media:enc=utf-8;text";op=shout;out="media:enc=utf-8;text""#;
const SLEEP: &str = r#"cap:in="media:enc=utf-8;text";op=sleep;out="media:enc=utf-8;text""#;
const TAGGED_REQUEST: &str =
    r#"cap:in="media:enc=utf-8;text";op=tagged;out="media:enc=utf-8;text";x=v"#;

/// The interpreter capdag is installed in, if any.
fn capdag_python() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TETHER_CAPDAG_PYTHON") {
        return Some(PathBuf::from(path));
    }
    let works = Command::new("python3")
        .args(["-c", "import capdag, cbor2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    works.then(|| PathBuf::from("python3"))
}

fn skip_without_capdag() -> Option<PathBuf> {
    let python = capdag_python();
    if python.is_none() {
        eprintln!(
            "\n*** SKIPPED: capdag is not installed (set TETHER_CAPDAG_PYTHON to a Python >= 3.11 \
             with `pip install capdag==1.524.58`, as .ci/run does) ***\n"
        );
    }
    python
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("capdag")
        .join(name)
}

/// A scratch directory for sockets, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tether-capdag-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A capdag master process listening on `path`, killed on drop.
struct Master(Child);

impl Master {
    fn start(python: &Path, path: &Path) -> Self {
        let mut child = Command::new(python)
            .arg(script("master.py"))
            .arg("--listen")
            .arg(path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("master.py starts");
        // It says `ready PATH` once it listens.
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("master.py writes its ready line");
        assert!(line.starts_with("ready "), "master.py said {line:?}");
        Self(child)
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The text an answer's CHUNK payloads carry (each one CBOR string, as capdag writes them).
fn text_of(payloads: &[Bytes]) -> String {
    payloads
        .iter()
        .map(|payload| {
            let content = payload_content(payload).expect("a CBOR string per CHUNK");
            String::from_utf8(content.to_vec()).expect("UTF-8")
        })
        .collect()
}

/// Makes a request with `input` (one CBOR byte string) and reads the answer to its END or
/// ERR: the CHUNK payloads, or the ERR's code.
async fn call(switch: &Switch, cap: &str, input: &str) -> Result<Vec<Bytes>, String> {
    let call = start_call(switch, cap, input).await?;
    read_answer(call).await
}

/// Makes a request with `input` (one CBOR byte string) and ends its input. A host may answer
/// before it has the input (an ERR for a request it declines): then the request is no longer
/// live for the input, and its answer says the rest.
async fn start_call(
    switch: &Switch,
    cap: &str,
    input: &str,
) -> Result<tether::switch::Call, String> {
    let call = switch.request(cap).await.map_err(|e| e.to_string())?;
    call.send_input("input", MEDIA, [payload_item(input.as_bytes())])
        .await
        .map_err(|e| e.to_string())?;
    Ok(call)
}

/// Reads the answer of `call` to its END or ERR: the CHUNK payloads, or the ERR's code.
async fn read_answer(mut call: tether::switch::Call) -> Result<Vec<Bytes>, String> {
    let mut payloads = Vec::new();
    while let Some(frame) = call.next().await {
        match frame.frame_type {
            FrameType::Chunk => payloads.push(frame.payload.unwrap_or_default()),
            FrameType::End => return Ok(payloads),
            FrameType::Err => return Err(error_code(&frame).unwrap_or_default()),
            _ => {}
        }
    }
    Err("closed".into())
}

/// Reads frames of `call` until the first CHUNK.
async fn first_chunk(call: &mut tether::switch::Call) -> Frame {
    loop {
        let frame = call.next().await.expect("the answer goes on");
        if frame.frame_type == FrameType::Chunk {
            return frame;
        }
    }
}

/// Reads `call` to its end: the ERR's code (`None` for END).
async fn ending(call: &mut tether::switch::Call) -> Option<String> {
    while let Some(frame) = call.next().await {
        match frame.frame_type {
            FrameType::End => return None,
            FrameType::Err => return Some(error_code(&frame).unwrap_or_default()),
            _ => {}
        }
    }
    Some("closed".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capdag_masters_attach_to_tethers_switch_and_serve_streams_peer_calls_cancels_and_deaths() {
    let Some(python) = skip_without_capdag() else {
        return;
    };
    let scratch = Scratch::new("masters");
    let path = scratch.0.join("a.sock");
    let mut master = Master::start(&python, &path);
    let switch = Switch::builder().policy(NetworkPolicy::NoTelemetry).start();
    // capdag's master speaks first; tether's switch answers with POLICY and checks identity.
    switch
        .connect_unix("capdag", &path)
        .await
        .expect("capdag's master attaches and passes the identity check");
    let caps = switch.capabilities().await;
    for cap in [UPPER, COUNT, SHOUT, SLEEP] {
        let canonical = tether_core::cap::CapUrn::parse(cap)
            .expect("capdag's URN parses")
            .to_string();
        assert!(caps.contains(&canonical), "{canonical} in {caps:?}");
    }

    // Routed by cap, answered.
    let answer = call(&switch, UPPER, "hello, tether")
        .await
        .expect("answered");
    assert_eq!(text_of(&answer), "HELLO, TETHER");

    // A streamed answer of 30 CHUNKs, within the window of 32.
    let lines = call(&switch, COUNT, "30").await.expect("answered");
    assert_eq!(lines.len(), 30);
    let expected: String = (0..30).map(|i| format!("line {i}\n")).collect();
    assert_eq!(text_of(&lines), expected);
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(
        stats.switch.overrun_held, 0,
        "within the window nothing waits"
    );

    // A streamed answer of 2,000 CHUNKs, far past the window: capdag's in-process host writes
    // all of it without waiting for credit. The switch holds what is past the window (1,968
    // CHUNKs, STREAM_END, END) until the caller reads, and the caller gets every line in order.
    let big = start_call(&switch, COUNT, "2000").await.expect("routed");
    loop {
        let stats = switch.protocol_stats().await.expect("stats");
        if stats.switch.overrun_held >= 1_970 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let lines = read_answer(big).await.expect("answered");
    assert_eq!(lines.len(), 2_000);
    let expected: String = (0..2_000).map(|i| format!("line {i}\n")).collect();
    assert_eq!(text_of(&lines), expected);
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.switch.overrun_held, 1_970);
    assert!(stats.switch.violations.is_empty(), "{:?}", stats.switch);
    assert!(stats.requests.is_empty(), "nothing left of it");

    // A peer call: capdag's shout handler calls uppercase through tether's switch.
    let shout = call(&switch, SHOUT, "hey").await.expect("answered");
    assert_eq!(text_of(&shout), "HEY!");

    // Where the matchers differ (docs/spec/switch.md §4.6): tether routes a request for `x=v`
    // to the master's `x=*` cap, capdag's host declines it, and its ERR ends the request.
    assert_eq!(
        call(&switch, TAGGED_REQUEST, "x").await,
        Err("NO_HANDLER".to_owned())
    );
    let stats = switch.protocol_stats().await.expect("running");
    assert_eq!(stats.requests.len(), 0, "nothing left: {stats:?}");

    // CANCEL: the request ends at once for the engine and at the master.
    let mut slow = switch.request(SLEEP).await.expect("routed");
    slow.send_stream("input", MEDIA, [payload_item(b"30")])
        .await
        .expect("sent");
    slow.finish().await.expect("sent");
    let started = first_chunk(&mut slow).await;
    assert_eq!(text_of(&[started.payload.unwrap_or_default()]), "started");
    assert!(
        switch
            .cancel_request(slow.id(), CancelReason::operator("enough"))
            .await
    );
    assert_eq!(ending(&mut slow).await.as_deref(), Some("CANCELLED"));

    // CLOSE_STREAM: sent while the input is open; capdag's host lets the request end on its
    // own once the input ends.
    let mut fed = switch.request(SLEEP).await.expect("routed");
    fed.send_stream("input", MEDIA, [payload_item(b"0")])
        .await
        .expect("sent");
    assert!(switch.stop_request_feeds(fed.id()).await);
    fed.finish().await.expect("sent");
    assert_eq!(ending(&mut fed).await, None);

    let stats = switch.protocol_stats().await.expect("running");
    assert_eq!(stats.requests.len(), 0, "nothing left: {stats:?}");

    // A master killed mid-request: the request ends MASTER_DIED, nothing is left.
    let mut doomed = switch.request(SLEEP).await.expect("routed");
    doomed
        .send_stream("input", MEDIA, [payload_item(b"30")])
        .await
        .expect("sent");
    doomed.finish().await.expect("sent");
    first_chunk(&mut doomed).await;
    master.kill();
    assert_eq!(ending(&mut doomed).await.as_deref(), Some("MASTER_DIED"));
    let stats = switch.protocol_stats().await.expect("running");
    assert_eq!(stats.requests.len(), 0, "nothing left: {stats:?}");
    assert!(matches!(
        call(&switch, UPPER, "x").await,
        Err(error) if error.contains("no handler")
    ));

    // Reattached (a new process on the same path, into the same slot), it serves again.
    let _master = Master::start(&python, &path);
    switch
        .connect_unix("capdag", &path)
        .await
        .expect("the master reattaches");
    let answer = call(&switch, UPPER, "again").await.expect("answered");
    assert_eq!(text_of(&answer), "AGAIN");
    switch.close().await;
}

const ECHO: &str = r#"cap:in="media:enc=utf-8;text";op=echo;out="media:enc=utf-8;text""#;
const POLICY: &str = r#"cap:in="media:enc=utf-8;text";op=policy;out="media:enc=utf-8;text""#;
const HOLD: &str = r#"cap:in="media:enc=utf-8;text";op=hold;out="media:enc=utf-8;text""#;

/// Every input CHUNK's payload, in order, to the input's END.
async fn inputs(request: &mut tether::switch::host::HostRequest) -> Vec<Bytes> {
    let mut payloads = Vec::new();
    while let Some(frame) = request.next_input().await {
        match frame.frame_type {
            FrameType::Chunk => payloads.push(frame.payload.unwrap_or_default()),
            FrameType::End | FrameType::Err => break,
            _ => {}
        }
    }
    payloads
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tethers_host_serves_capdags_switch() {
    let Some(python) = skip_without_capdag() else {
        return;
    };
    let scratch = Scratch::new("host");
    let path = scratch.0.join("host.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    let host = Host::new("tether-host")
        .handler(ECHO, |mut request| async move {
            let payloads = inputs(&mut request).await;
            let _ = request.respond("result", MEDIA, payloads).await;
            let _ = request.end().await;
        })
        .handler(UPPER, |mut request| async move {
            let text = text_of(&inputs(&mut request).await).to_uppercase();
            let _ = request
                .respond("result", MEDIA, [payload_item(text.as_bytes())])
                .await;
            let _ = request.end().await;
        })
        .handler(POLICY, |mut request| async move {
            inputs(&mut request).await;
            let policy = request.policy().to_string();
            let _ = request
                .respond("result", MEDIA, [payload_item(policy.as_bytes())])
                .await;
            let _ = request.end().await;
        })
        .handler(HOLD, |mut request| async move {
            inputs(&mut request).await;
            let _ = request
                .respond("result", MEDIA, [payload_item(b"held")])
                .await;
            // Holds the request open until the switch cancels it.
            while !request.is_cancelled() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    let serving = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("capdag's switch connects");
        host.serve(stream).await
    });
    let steps = serde_json::json!([
        {"call": ECHO, "input": "hello"},
        {"call": UPPER, "input": "hello, capdag"},
        {"call": POLICY, "input": "?"},
        {"set_policy": "offline"},
        {"call": POLICY, "input": "?"},
        {"cancel_after_first_chunk": HOLD, "input": "x"},
        {"call": UPPER, "input": "after"},
    ]);
    let steps_path = scratch.0.join("steps.json");
    std::fs::write(&steps_path, steps.to_string()).expect("write the steps");
    let mut master_arg = std::ffi::OsString::from("unix:");
    master_arg.push(&path);
    let output = tokio::process::Command::new(&python)
        .arg(script("switch.py"))
        .arg("--master")
        .arg(master_arg)
        .arg("--policy")
        .arg("no_telemetry")
        .arg(&steps_path)
        .output()
        .await
        .expect("switch.py runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "switch.py failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let results: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    let body = |step: usize| {
        results[step]["body"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    let ok = |step: usize| results[step]["ok"] == serde_json::Value::Bool(true);
    assert!(ok(0), "{}", results[0]);
    assert_eq!(body(0), "hello");
    assert!(ok(1), "{}", results[1]);
    assert_eq!(body(1), "HELLO, CAPDAG");
    assert_eq!(body(2), "no_telemetry", "the POLICY reached the handler");
    assert_eq!(body(4), "offline", "the new POLICY reached the handler");
    assert_eq!(results[5]["err_code"], "CANCELLED", "{}", results[5]);
    assert!(ok(6), "{}", results[6]);
    assert_eq!(body(6), "AFTER");
    let done = results.last().expect("a final line");
    assert_eq!(done["done"], true, "{done}");
    // capdag's switch hung up: the host's serve ends cleanly.
    let served = tokio::time::timeout(Duration::from_secs(30), serving)
        .await
        .expect("the host ends with its connection")
        .expect("the task ran");
    assert!(served.is_ok(), "{served:?}");
}

const LOWER: &str = r#"cap:in="media:enc=utf-8;text";op=lowercase;out="media:enc=utf-8;text""#;

/// A tether host answering `cap` with its input's text transformed by `f`.
fn text_host(name: &str, cap: &str, f: fn(&str) -> String) -> Host {
    Host::new(name).handler(cap, move |mut request| async move {
        let text = f(&text_of(&inputs(&mut request).await));
        let _ = request
            .respond("result", MEDIA, [payload_item(text.as_bytes())])
            .await;
        let _ = request.end().await;
    })
}

/// One tether switch with three kinds of master side by side: a capdag master over a Unix
/// socket, a tether host over a Unix socket, and a tether host over iroh (127.0.0.1). Each
/// request reaches the master that serves its cap, a capdag handler's peer call is routed
/// through the same switch, and the capdag master's death leaves the tether hosts serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_switch_routes_to_capdag_masters_and_tether_hosts_over_unix_and_iroh() {
    let Some(python) = skip_without_capdag() else {
        return;
    };
    let scratch = Scratch::new("mixed");
    let path = scratch.0.join("capdag.sock");
    let mut capdag = Master::start(&python, &path);
    let switch = Switch::builder().start();
    switch
        .connect_unix("capdag", &path)
        .await
        .expect("capdag's master attaches");

    let (near, far) = tether_tests::socket_pair();
    tokio::spawn(text_host("unix-host", ECHO, str::to_owned).serve(far));
    switch
        .add_master("tether-unix", near)
        .await
        .expect("tether's host over a Unix socket attaches");

    let hosting = tether::node::Node::builder()
        .switch_host()
        .bind()
        .await
        .expect("bind the hosting node");
    let mut streams = hosting.switch_connections().expect("a switch host");
    tokio::spawn(async move {
        while let Some((_, stream)) = streams.recv().await {
            tokio::spawn(text_host("iroh-host", LOWER, str::to_lowercase).serve(stream));
        }
    });
    let engine = tether::node::Node::builder()
        .bind()
        .await
        .expect("bind the engine's node");
    switch
        .connect_iroh("tether-iroh", &engine, hosting.endpoint_addr())
        .await
        .expect("tether's host over iroh attaches");

    let answer = |cap: &'static str, input: &'static str| {
        let switch = &switch;
        async move { text_of(&call(switch, cap, input).await.expect("answered")) }
    };
    assert_eq!(answer(UPPER, "Mixed").await, "MIXED");
    assert_eq!(answer(ECHO, "Mixed").await, "Mixed");
    assert_eq!(answer(LOWER, "Mixed").await, "mixed");
    assert_eq!(answer(SHOUT, "Mixed").await, "MIXED!");

    capdag.kill();
    // The capdag master's death is seen before its caps go: wait on its reported state.
    while switch.protocol_stats().await.expect("running").masters[0].attached {
        tokio::task::yield_now().await;
    }
    assert_eq!(answer(ECHO, "still").await, "still");
    assert_eq!(answer(LOWER, "STILL").await, "still");
    let stats = switch.protocol_stats().await.expect("running");
    assert_eq!(stats.requests.len(), 0, "nothing left: {stats:?}");
    switch.close().await;
    engine.close().await;
    hosting.close().await;
}

/// The `tether` program under test.
fn tether() -> tokio::process::Command {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_tether-under-test"))
}

/// `tether switch ... call`: its exit code, stdout and stderr.
async fn tether_call(master: &Path, cap: &str, input: &str) -> (i32, String, String) {
    let mut endpoint = std::ffi::OsString::from("unix:");
    endpoint.push(master);
    let output = tether()
        .args(["switch", "--timeout", "20", "--master"])
        .arg(endpoint)
        .args(["call", cap, "--input", input])
        .output()
        .await
        .expect("tether runs");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The command line pointed at capdag: `tether switch ... call` against a capdag master (an
/// answer, a declined request, nothing listening, something that is no master), and
/// `tether host` serving capdag's switch and tether's own `switch call`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_talks_to_capdag_both_ways() {
    let Some(python) = skip_without_capdag() else {
        return;
    };
    let scratch = Scratch::new("cli");
    let master_path = scratch.0.join("master.sock");
    let _master = Master::start(&python, &master_path);
    assert_eq!(
        tether_call(&master_path, UPPER, "hello").await,
        (0, "HELLO\n".to_owned(), String::new())
    );
    let (code, _, stderr) = tether_call(&master_path, TAGGED_REQUEST, "x").await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("NO_HANDLER"), "{stderr}");
    let (code, _, stderr) = tether_call(&scratch.0.join("nothing.sock"), UPPER, "x").await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("could not reach a master"), "{stderr}");
    // Something that answers with bytes that are no bifaci frames.
    let junk_path = scratch.0.join("junk.sock");
    let junk = tokio::net::UnixListener::bind(&junk_path).expect("bind");
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut stream, _)) = junk.accept().await {
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    let (code, _, stderr) = tether_call(&junk_path, UPPER, "x").await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("did not attach"), "{stderr}");

    // `tether host`, for capdag's switch and for `tether switch`.
    let host_path = scratch.0.join("host.sock");
    let mut endpoint = std::ffi::OsString::from("unix:");
    endpoint.push(&host_path);
    let mut host = tether()
        .arg("host")
        .arg("--listen")
        .arg(&endpoint)
        .args(["--echo", ECHO, "--upper", UPPER])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("tether host starts");
    let mut ready = String::new();
    {
        use tokio::io::AsyncBufReadExt;
        let stdout = host.stdout.take().expect("piped");
        tokio::io::BufReader::new(stdout)
            .read_line(&mut ready)
            .await
            .expect("its ready line");
    }
    assert!(ready.starts_with("listening on unix:"), "{ready}");
    assert_eq!(
        tether_call(&host_path, UPPER, "from tether").await,
        (0, "FROM TETHER\n".to_owned(), String::new())
    );
    let steps = serde_json::json!([
        {"call": ECHO, "input": "from capdag"},
        {"call": UPPER, "input": "from capdag"},
    ]);
    let steps_path = scratch.0.join("cli-steps.json");
    std::fs::write(&steps_path, steps.to_string()).expect("write the steps");
    let output = tokio::process::Command::new(&python)
        .arg(script("switch.py"))
        .arg("--master")
        .arg(&endpoint)
        .arg(&steps_path)
        .output()
        .await
        .expect("switch.py runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let results: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(results[0]["body"], "from capdag", "{}", results[0]);
    assert_eq!(results[1]["body"], "FROM CAPDAG", "{}", results[1]);
    let _ = host.kill().await;
}
