//! The sender against tiny in-test servers with known timing.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::sleep;

use super::*;
use inferrail_workload::{Api, Request, Step};

/// How a test server answers.
#[derive(Clone, Copy)]
struct Plan {
    /// Status line's code.
    status: u16,
    /// Wait before the first content chunk (after the headers).
    first: Duration,
    /// Wait between content chunks.
    every: Duration,
    /// Content chunks.
    chunks: usize,
    /// Serve one request at a time, each taking `first` before any byte.
    serial: bool,
}

/// What a test server saw.
#[derive(Default)]
struct Seen {
    /// Requests read in full.
    arrived: usize,
    /// Of those, the ones a serial server has not started answering.
    waiting: usize,
    /// The most that were waiting at once.
    most_waiting: usize,
    /// The bodies, in the order they arrived.
    bodies: Vec<serde_json::Value>,
}

/// Starts a server; returns its address and what it saw.
async fn server(plan: Plan) -> (SocketAddr, Arc<Mutex<Seen>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("address");
    let arrivals = Arc::new(Mutex::new(Seen::default()));
    let (seen, one_at_a_time) = (arrivals.clone(), Arc::new(tokio::sync::Mutex::new(())));
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let (seen, one_at_a_time) = (seen.clone(), one_at_a_time.clone());
            tokio::spawn(async move { answer(socket, plan, &seen, &one_at_a_time).await });
        }
    });
    (addr, arrivals)
}

async fn answer(mut socket: TcpStream, plan: Plan, seen: &Mutex<Seen>, one_at_a_time: &tokio::sync::Mutex<()>) {
    socket.set_nodelay(true).expect("nodelay");
    // Read the head and the body it announces.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let Ok(n) = socket.read(&mut chunk).await else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                .unwrap_or(0);
            if buf.len() >= end + 4 + length {
                break;
            }
        }
    }
    {
        let mut s = seen.lock().expect("lock");
        let text = String::from_utf8_lossy(&buf).to_string();
        s.bodies.push(text.split_once("\r\n\r\n").and_then(|(_, b)| serde_json::from_str(b).ok()).unwrap_or_default());
        s.arrived += 1;
        s.waiting += 1;
        s.most_waiting = s.most_waiting.max(s.waiting);
    }
    let head = format!(
        "HTTP/1.1 {} X\r\ncontent-type: text/event-stream\r\n{REPLICA_HEADER}: r1\r\n{PREDICTED_HEADER}: 7\r\nconnection: close\r\n\r\n",
        plan.status
    );
    let content = |i: usize| format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": format!("w{i} ")}}]}));
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": plan.chunks, "prompt_tokens_details": {"cached_tokens": 6}}});
    let tail = format!("data: {usage}\n\ndata: [DONE]\n\n");
    if plan.status != 200 {
        socket.write_all(format!("{head}overloaded").as_bytes()).await.ok();
    } else if plan.serial {
        let _turn = one_at_a_time.lock().await;
        seen.lock().expect("lock").waiting -= 1;
        sleep(plan.first).await;
        let body: String = (0..plan.chunks).map(content).collect();
        socket.write_all(format!("{head}{body}{tail}").as_bytes()).await.ok();
    } else {
        socket.write_all(head.as_bytes()).await.ok();
        sleep(plan.first).await;
        for i in 0..plan.chunks {
            if i > 0 {
                sleep(plan.every).await;
            }
            socket.write_all(content(i).as_bytes()).await.ok();
        }
        socket.write_all(tail.as_bytes()).await.ok();
    }
    socket.shutdown().await.ok();
}

fn requests(n: usize, every: Duration) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            at: every * i as u32,
            api: Api::Chat,
            body: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}),
            session: Some(format!("s{i}")),
            prompt_tokens: 0,
            shared_prefix_tokens: 3,
            step: None,
        })
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_itl_and_tpot_match_a_server_with_known_timing() {
    let plan = Plan { status: 200, first: Duration::from_millis(100), every: Duration::from_millis(20), chunks: 10, serial: false };
    let (addr, _) = server(plan).await;
    let http = reqwest::Client::new();
    let out = send_all(&http, &format!("http://{addr}"), &requests(3, Duration::from_millis(30)), false).await.expect("runs");
    // The server cannot answer faster than its plan, so the plan bounds each
    // measure from below; how they relate bounds them from above. No bound
    // depends on how busy the machine is.
    for o in &out {
        assert!(o.ok(), "{:?}", o.error);
        let (ttft, e2e) = (ms(o.ttft.expect("ttft")), ms(o.e2e.expect("e2e")));
        assert!(ttft >= 100.0, "ttft {ttft}: the first chunk comes 100 ms after the headers");
        assert!(e2e >= 100.0 + 9.0 * 20.0, "e2e {e2e}");
        assert_eq!(o.itl.len(), 9, "one gap between each two of the ten chunks");
        let gaps: f64 = o.itl.iter().copied().map(ms).sum();
        assert!(gaps <= e2e - ttft + 1e-6, "the gaps {gaps} lie between the first chunk and the end");
        let tpot = ms(o.tpot().expect("tpot"));
        assert!((tpot - (e2e - ttft) / 9.0).abs() < 1e-6, "tpot {tpot} is (e2e - ttft) over the nine tokens after the first");
        assert_eq!((o.output_tokens, o.prompt_tokens, o.cached_tokens), (10, Some(10), Some(6)));
        assert_eq!((o.replica.as_deref(), o.predicted_cached_tokens, o.status), (Some("r1"), Some(7), Some(200)));
        assert_eq!(o.shared_prefix_tokens, 3);
    }
    assert_eq!(out.iter().map(|o| o.at).collect::<Vec<_>>(), [0, 30, 60].map(Duration::from_millis));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_falls_behind_shows_as_latency_not_as_late_sends() {
    // One request at a time, 200 ms each, while one is scheduled every 50 ms:
    // request i finishes near 200 (i + 1) ms, 200 + 150 i ms after its schedule.
    let plan = Plan { status: 200, first: Duration::from_millis(200), every: Duration::ZERO, chunks: 3, serial: true };
    let (addr, seen) = server(plan).await;
    let http = reqwest::Client::new();
    let out = send_all(&http, &format!("http://{addr}"), &requests(10, Duration::from_millis(50)), false).await.expect("runs");
    assert!(out.iter().all(Outcome::ok));
    let ttft: Vec<f64> = out.iter().map(|o| ms(o.ttft.expect("ttft"))).collect();
    assert!(ttft[0] >= 200.0, "{ttft:?}");
    assert!(ttft[9] >= 1200.0, "the last request waited behind nine others: {ttft:?}");
    assert!(ttft[9] > ttft[0] + 1000.0, "{ttft:?}");
    assert!(ttft[5..].iter().all(|&t| t > 800.0), "{ttft:?}");
    // Sends kept to their schedule, not to the answers: requests queued up at
    // the server while it served one (a sender that waited for each answer
    // would never have more than one there).
    let seen = seen.lock().expect("lock");
    assert_eq!(seen.arrived, 10);
    assert!(seen.most_waiting >= 5, "at most {} requests waited at the server at once", seen.most_waiting);
}

#[tokio::test]
async fn failures_are_recorded_with_their_status() {
    let plan = Plan { status: 503, first: Duration::ZERO, every: Duration::ZERO, chunks: 0, serial: false };
    let (addr, _) = server(plan).await;
    let out = send_all(&reqwest::Client::new(), &format!("http://{addr}"), &requests(2, Duration::ZERO), false).await.expect("runs");
    assert!(out.iter().all(|o| o.status == Some(503) && o.error.as_deref().is_some_and(|e| e.contains("overloaded"))), "{out:?}");
}

/// Two agents: `a` with three steps 50 ms apart after each answer, `b` with one.
fn agents() -> Vec<Request> {
    let step = |agent: usize, k: usize, content: &str| Request {
        at: Duration::from_millis(20 * agent as u64),
        api: Api::Chat,
        body: json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3 + k}),
        session: None,
        prompt_tokens: 0,
        shared_prefix_tokens: 0,
        step: Some(Step { agent, think: Duration::from_millis(50) * u32::from(k > 0) }),
    };
    vec![step(0, 0, "task a"), step(1, 0, "task b"), step(0, 1, "tool a1"), step(0, 2, "tool a2")]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_resends_its_history_with_the_streamed_replies_after_each_answer() {
    let plan = Plan { status: 200, first: Duration::from_millis(30), every: Duration::ZERO, chunks: 3, serial: false };
    let (addr, seen) = server(plan).await;
    let out = send_all(&reqwest::Client::new(), &format!("http://{addr}"), &agents(), false).await.expect("runs");
    assert!(out.iter().all(Outcome::ok), "{out:?}");
    let seen = seen.lock().expect("lock");
    let of = |first: &str| seen.bodies.iter().filter(|b| b["messages"][0]["content"] == first).cloned().collect::<Vec<_>>();
    let (a, b) = (of("task a"), of("task b"));
    assert_eq!((a.len(), b.len(), seen.arrived), (3, 1, 4));
    let reply = json!({"role": "assistant", "content": "w0 w1 w2 "});
    let user = |c: &str| json!({"role": "user", "content": c});
    assert_eq!(
        a[2]["messages"],
        json!([user("task a"), reply, user("tool a1"), reply, user("tool a2")]),
        "the whole history, replies as streamed"
    );
    assert_eq!(a[2]["max_tokens"], 5, "each step keeps its own fields");
    assert_eq!(a[1]["stream"], true);
    // Outcomes in the workload's order; every step of an agent at its arrival.
    assert_eq!(out.iter().map(|o| o.at).collect::<Vec<_>>(), [0, 20, 0, 0].map(Duration::from_millis));
    assert_eq!(out[0].reply, "w0 w1 w2 ");
    // Each later step leaves after the one before ended and its think time,
    // and shares that step's prompt and reply as usage counted them.
    for (before, next) in [(0, 2), (2, 3)] {
        let ended = out[before].started + out[before].e2e.expect("e2e");
        assert!(out[next].started >= ended + Duration::from_millis(50), "{:?} then {:?}", out[before], out[next]);
        assert!(out[next].ttft.expect("ttft") >= Duration::from_millis(30), "timed from its own send");
        assert_eq!(out[next].shared_prefix_tokens, 10 + 3);
    }
}

#[tokio::test]
async fn an_agent_stops_at_its_first_failed_step() {
    let plan = Plan { status: 503, first: Duration::ZERO, every: Duration::ZERO, chunks: 0, serial: false };
    let (addr, seen) = server(plan).await;
    let out = send_all(&reqwest::Client::new(), &format!("http://{addr}"), &agents(), false).await.expect("runs");
    assert_eq!(seen.lock().expect("lock").arrived, 2, "each agent's first step only");
    assert_eq!(out[0].status, Some(503));
    for o in &out[2..] {
        assert_eq!((o.status, o.error.as_deref()), (None, Some("an earlier step of its agent failed")));
    }
}
