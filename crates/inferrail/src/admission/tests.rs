//! Admission through the router's own decisions: one replica with one
//! slot, so that the fleet is full while a request holds it; what waits,
//! in which order it goes, and what is refused or shed.

use super::*;
use crate::decision::Decision;
use crate::router::{Caller, Router};
use inferrail_route::lifecycle::Event;
use inferrail_tokenize::chat::Endpoint;

/// The digest of the key `sk-a`.
const SK_A: &str = "a4a6d307ad00fa67176e1099fdbc4f4a09bb527a7f24718a5030f2f173d11f7f";

fn router(admission: &str) -> Arc<Router> {
    let yaml = format!(
        "
models:
  - {{name: m, policy: round_robin, tokenizer: 'builtin:sim'}}
replicas:
  - {{id: r1, address: 127.0.0.1:8001, models: [m], max_concurrency: 1}}
admission:
{admission}
"
    );
    Arc::new(Router::new(Config::parse(&yaml).unwrap()).unwrap())
}

const BANDS: &str = "
  bands:
    - {name: interactive}
    - {name: batch, max_wait_ms: 60000}
";

fn asked(band: Option<&str>, tenant: Option<&str>, key: Option<&str>) -> Asked {
    Asked {
        authorization: key.map(|k| format!("Bearer {k}")),
        band: band.map(str::to_owned),
        tenant: tenant.map(str::to_owned),
        objective: None,
    }
}

const BODY: &[u8] = br#"{"model": "m", "prompt": "a few words of prompt"}"#;

async fn decide(r: &Router, id: &str, asked: &Asked) -> Result<Decision, RouteError> {
    r.decide_as(BODY, Endpoint::Completions, id, None, None, &Caller { asked, on_wait: &|_| {} }).await
}

/// Starts a decision that is expected to wait; returns once it waits, with
/// how long it was told it may wait.
async fn waiting(r: &Arc<Router>, id: &str, asked: Asked) -> (tokio::task::JoinHandle<Result<Decision, RouteError>>, Duration) {
    let (told, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let (r2, id2) = (r.clone(), id.to_owned());
    let mut task = tokio::spawn(async move {
        let on_wait = move |d: Duration| {
            let _ = told.send(d);
        };
        r2.decide_as(BODY, Endpoint::Completions, &id2, None, None, &Caller { asked: &asked, on_wait: &on_wait }).await
    });
    tokio::select! {
        Some(d) = heard.recv() => (task, d),
        done = &mut task => panic!("{id} was answered without waiting: {done:?}"),
    }
}

fn end(r: &Router, d: &Decision) {
    r.hear(&d.request_id, Event::Status { code: 200, served_by: None });
    r.hear(&d.request_id, Event::End);
}

#[tokio::test]
async fn a_request_waits_while_the_fleet_is_full_and_goes_when_a_slot_comes_back() {
    let r = router(BANDS);
    let first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (second, told) = waiting(&r, "b", Asked::NONE).await;
    // The default band is the last: batch, which waits up to a minute.
    assert_eq!(told, Duration::from_secs(60));
    end(&r, &first);
    let second = second.await.unwrap().unwrap();
    assert_eq!(second.targets[0].id, "r1");
    // What it waited is told apart from the router's work (inferrail_decision_seconds leaves it out).
    assert_eq!(first.waited, Duration::ZERO);
    assert!(second.waited > Duration::ZERO);
    assert_eq!(second.targets[0].in_flight(), 1);
}

#[tokio::test]
async fn the_more_urgent_band_goes_first() {
    let r = router(BANDS);
    let first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (batch, _) = waiting(&r, "batch", asked(Some("batch"), None, None)).await;
    let (chat, _) = waiting(&r, "chat", asked(Some("interactive"), None, None)).await;
    end(&r, &first);
    // The one slot goes to the interactive request, though the batch one waited longer.
    let chat = tokio::time::timeout(Duration::from_secs(60), chat).await.expect("the batch request took the slot").unwrap().unwrap();
    assert!(!batch.is_finished());
    end(&r, &chat);
    assert_eq!(batch.await.unwrap().unwrap().request_id, "batch");
}

#[tokio::test]
async fn a_wait_that_runs_out_is_shed_with_503_and_retry_after() {
    let r = router(
        "
  bands:
    - {name: only, max_wait_ms: 100}
",
    );
    let _first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (second, told) = waiting(&r, "b", Asked::NONE).await;
    assert_eq!(told, Duration::from_millis(100));
    let e = second.await.unwrap().unwrap_err();
    assert!(matches!(e, RouteError::Shed(Shed::Waited(_))), "{e:?}");
    assert_eq!(e.http().0, 503);
    assert_eq!(e.retry_after(), Some(Duration::from_secs(1)));
    // It left the queue: nothing is ahead of the next.
    let placed = r.admission.place(r.admission.identify(&Asked::NONE).unwrap(), &Asked::NONE, "m").unwrap();
    assert_eq!(r.admission.ahead(0, &placed), 0);
}

#[tokio::test]
async fn a_full_queue_sheds_the_request_that_would_go_last() {
    let r = router(
        "
  max_queued_requests: 1
  bands:
    - {name: interactive}
    - {name: batch}
",
    );
    let _first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (batch, _) = waiting(&r, "b", asked(Some("batch"), None, None)).await;
    // Another batch request would go last: refused at once.
    let e = decide(&r, "c", &asked(Some("batch"), None, None)).await.unwrap_err();
    assert_eq!(e, RouteError::Shed(Shed::QueueFull));
    assert_eq!(e.http().0, 503);
    // An interactive one pushes the batch request out, and waits in its place.
    let (_chat, _) = waiting(&r, "d", asked(Some("interactive"), None, None)).await;
    let e = batch.await.unwrap().unwrap_err();
    assert!(matches!(e, RouteError::Shed(Shed::Waited(_))), "{e:?}");
}

#[tokio::test]
async fn a_request_whose_client_leaves_leaves_the_queue_at_once() {
    let r = router(BANDS);
    let first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (gone, _) = waiting(&r, "gone", Asked::NONE).await;
    let (stays, _) = waiting(&r, "stays", Asked::NONE).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    let placed = r.admission.place(r.admission.identify(&Asked::NONE).unwrap(), &Asked::NONE, "m").unwrap();
    assert_eq!(r.admission.ahead(0, &placed), 1);
    end(&r, &first);
    assert_eq!(stays.await.unwrap().unwrap().request_id, "stays");
}

#[tokio::test]
async fn a_band_that_sheds_on_a_missed_objective_answers_at_once() {
    // The cost model's default prefill cost puts any prompt above a 1 ms objective.
    let r = router(
        "
  bands:
    - {name: strict, ttft_objective_ms: 1, on_miss: shed}
",
    );
    let e = decide(&r, "a", &Asked::NONE).await.unwrap_err();
    let RouteError::Shed(Shed::OverObjective { estimate, objective }) = e else { panic!("{e:?}") };
    assert_eq!(objective, Duration::from_millis(1));
    assert!(estimate > objective);
    assert_eq!(e.http().0, 503);
    assert_eq!(r.leases_held(), 0, "nothing was committed");
}

#[tokio::test]
async fn keys_are_checked_by_digest_and_bound_to_their_bands() {
    let r = router(&format!(
        "
  require_keys: true
  keys:
    - {{sha256: {SK_A}, tenant: team-a, bands: [batch]}}
  bands:
    - {{name: interactive}}
    - {{name: batch}}
"
    ));
    for key in [None, Some("sk-b"), Some(SK_A)] {
        let e = decide(&r, "x", &asked(None, None, key)).await.unwrap_err();
        assert_eq!(e, RouteError::Unauthorized, "{key:?}");
        assert_eq!(e.http(), (401, "AuthenticationError", None));
    }
    let d = decide(&r, "ok", &asked(None, Some("someone-else"), Some("sk-a"))).await.unwrap();
    end(&r, &d);
    let e = decide(&r, "x", &asked(Some("interactive"), None, Some("sk-a"))).await.unwrap_err();
    assert_eq!(e, RouteError::BandNotAllowed("interactive".into()));
    assert_eq!(e.http().0, 403);
    let e = decide(&r, "x", &asked(Some("bulk"), None, Some("sk-a"))).await.unwrap_err();
    assert_eq!(e.http().0, 400);
    // The key's tenant, not the one named.
    let who = r.admission.identify(&asked(None, Some("someone-else"), Some("sk-a"))).unwrap();
    assert_eq!(who.tenant, "team-a");
}

#[tokio::test]
async fn a_tenant_with_keys_cannot_be_named_without_one() {
    let r = router(&format!("  keys: [{{sha256: {SK_A}, tenant: team-a}}]"));
    let e = decide(&r, "x", &asked(None, Some("team-a"), None)).await.unwrap_err();
    assert_eq!(e, RouteError::Unauthorized);
    // Another tenant may be named (keys are optional here), and team-a's key is team-a.
    assert_eq!(r.admission.identify(&asked(None, Some("team-b"), None)).unwrap().tenant, "team-b");
    assert_eq!(r.admission.identify(&asked(None, None, Some("sk-a"))).unwrap().tenant, "team-a");
}

#[tokio::test]
async fn a_reload_that_changes_the_bands_sheds_what_waits_and_one_that_keeps_them_keeps_it() {
    let yaml = |bands: &str| {
        format!(
            "
models:
  - {{name: m, policy: round_robin, tokenizer: 'builtin:sim'}}
replicas:
  - {{id: r1, address: 127.0.0.1:8001, models: [m], max_concurrency: 1}}
admission:
  max_queued_requests: 5
  bands: [{bands}]
"
        )
    };
    let r = Arc::new(Router::new(Config::parse(&yaml("{name: interactive}, {name: batch}")).unwrap()).unwrap());
    let first = decide(&r, "a", &Asked::NONE).await.unwrap();
    let (kept, _) = waiting(&r, "kept", Asked::NONE).await;
    // The same bands, other bounds: it keeps its place.
    let bigger = yaml("{name: interactive}, {name: batch, max_wait_ms: 90000}").replace("max_queued_requests: 5", "max_queued_requests: 9");
    r.reload(Config::parse(&bigger).unwrap()).unwrap();
    end(&r, &first);
    let kept = kept.await.unwrap().unwrap();
    // A band more, placed first: every index moves, so what waits is shed.
    let (shed, _) = waiting(&r, "shed", Asked::NONE).await;
    r.reload(Config::parse(&yaml("{name: urgent}, {name: interactive}, {name: batch}")).unwrap()).unwrap();
    let e = shed.await.unwrap().unwrap_err();
    assert!(matches!(e, RouteError::Shed(Shed::Waited(_))), "{e:?}");
    // The new bands queue as the old did: a request of the last band, the third, waits for the slot.
    let (after, _) = waiting(&r, "after", Asked::NONE).await;
    end(&r, &kept);
    assert_eq!(after.await.unwrap().unwrap().request_id, "after");
}

#[tokio::test]
async fn a_tenant_over_its_token_limit_gets_429_until_its_window_frees() {
    let r = router(
        "
  tenants:
    - name: t
      limits: [{tokens: 10, window_ms: 60000}]
",
    );
    let t = asked(None, Some("t"), None);
    let first = decide(&r, "1", &t).await.unwrap();
    let prompt = first.prompt_tokens.unwrap();
    assert!(prompt > 0 && prompt < 10, "{prompt} prompt tokens");
    end(&r, &first);
    // Admitted while under the limit: the second takes it past by at most one request.
    let second = decide(&r, "2", &t).await.unwrap();
    end(&r, &second);
    let e = decide(&r, "3", &t).await.unwrap_err();
    let RouteError::RateLimited { ref tenant, retry_after } = e else { panic!("{e:?}") };
    assert_eq!(tenant, "t");
    assert!(!retry_after.is_zero() && retry_after <= Duration::from_secs(60), "{retry_after:?}");
    assert_eq!(e.http(), (429, "RateLimitError", None));
    // Another tenant is not limited.
    decide(&r, "4", &asked(None, Some("u"), None)).await.unwrap();
}

#[tokio::test]
async fn a_band_kept_to_part_of_the_replicas_waits_for_them_while_the_rest_serve_the_bands_above() {
    let yaml = "
models:
  - {name: m, policy: round_robin, tokenizer: 'builtin:sim'}
replicas:
  - {id: r1, address: 127.0.0.1:8001, models: [m], max_concurrency: 1}
  - {id: r2, address: 127.0.0.1:8002, models: [m], max_concurrency: 1}
admission:
  bands:
    - {name: interactive}
    - {name: batch, replica_share: 0.5}
";
    let r = Arc::new(Router::new(Config::parse(yaml).unwrap()).unwrap());
    let batch = asked(Some("batch"), None, None);
    let first = decide(&r, "b1", &batch).await.unwrap();
    assert_eq!(first.targets.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(), ["r1"], "no fallback outside its half either");
    // r2 is free, but kept for the band above: the second batch request waits for r1.
    let (second, _) = waiting(&r, "b2", batch.clone()).await;
    let urgent = decide(&r, "i1", &asked(Some("interactive"), None, None)).await.unwrap();
    assert_eq!(urgent.targets[0].id, "r2");
    end(&r, &urgent);
    end(&r, &first);
    assert_eq!(second.await.unwrap().unwrap().targets[0].id, "r1");
    let explained = r.explain(BODY, Endpoint::Completions, None, &batch).await.unwrap();
    assert_eq!(explained.plan.set_aside[1], Some(inferrail_policy::SetAside::KeptForUrgent));
}
