//! The switch section of the conformance scripts carries capdag's own switch↔master
//! conversations (`tests/data/capdag/handshake_trace*.json`, recorded from capdag 1.524.58's
//! `RelaySwitch` and a capdag master) as checked-in cases: the request each trace carries,
//! frame for frame, played through a switch with that master attached. This test derives each
//! case from its trace (from the trace's JSON alone: the master's manifest and limits from
//! its last RELAY_NOTIFY, the ops from the frames of the trace's `request` step) and finds it
//! in `scripts/switch.json`, where core and the model must both pass it
//! (`conformance_scripts.rs`). The handshake itself, POLICY and HEARTBEAT are not ops of the
//! script format; `core/tests/capdag_trace.rs` replays those byte for byte.

use std::path::Path;

use serde_json::{json, Value};

const MASTER: &str = "capdag";
/// The identity cap: the script's handshake adds it to every manifest.
const IDENTITY: &str = "cap:effect=none";

fn read(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("JSON")
}

/// The case a trace's `request` step makes: its world and its ops.
fn case_of(trace: &Value) -> Value {
    let frames = trace["frames"].as_array().expect("frames");
    let notify = frames
        .iter()
        .rfind(|f| f["frame_type_name"] == "RELAY_NOTIFY")
        .expect("the master's RELAY_NOTIFY");
    let meta = &notify["fields"]["meta"];
    let manifest: Value =
        serde_json::from_str(meta["manifest"]["$utf8"].as_str().expect("UTF-8 manifest"))
            .expect("a JSON manifest");
    let mut caps = Vec::new();
    for cartridge in manifest["installed_cartridges"]
        .as_array()
        .expect("cartridges")
    {
        for group in cartridge["cap_groups"].as_array().expect("cap groups") {
            for cap in group["caps"].as_array().expect("caps") {
                let urn = cap["urn"].as_str().expect("urn");
                if urn != IDENTITY {
                    caps.push(urn.to_owned());
                }
            }
        }
    }
    let mut ops = Vec::new();
    for frame in frames.iter().filter(|f| f["step"] == "request") {
        let name = frame["frame_type_name"].as_str().expect("type name");
        let fields = &frame["fields"];
        let from_master = frame["dir"] == "master->switch";
        if name == "REQ" {
            ops.push(json!({"op": "request", "rid": 1, "cap": fields["cap"], "preferred": null}));
            continue;
        }
        let (op, from) = if from_master {
            ("respond", MASTER)
        } else {
            ("continue", "engine")
        };
        ops.push(json!({
            "op": op,
            "from": from,
            "rid": 1,
            "frame": name.to_lowercase(),
            "stream": fields["stream_id"],
        }));
    }
    json!({
        "ring": 64,
        "masters": [{
            "id": MASTER,
            "caps": caps,
            "initial_credit": meta["initial_credit"],
            "identity": "echo",
        }],
        "ops": ops,
    })
}

#[test]
fn the_switch_script_carries_each_capdag_trace_as_a_case() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = read(&root.join("formal-replay/scripts/switch.json"));
    let cases = script["cases"].as_array().expect("cases");
    for name in ["handshake_trace.json", "handshake_trace_deferred.json"] {
        let trace = read(&root.join("tests/data/capdag").join(name));
        let wanted = case_of(&trace);
        assert_eq!(
            wanted["ops"].as_array().map(Vec::len),
            Some(9),
            "{name}: REQ, the argument stream and END, the answer's stream and END"
        );
        let found = cases.iter().any(|case| {
            case["ring"] == wanted["ring"]
                && case["masters"] == wanted["masters"]
                && case["ops"] == wanted["ops"]
        });
        assert!(
            found,
            "{name}: no case in scripts/switch.json plays it; add\n{wanted}\nand refill"
        );
    }
}
