//! Engine behaviour on tokio's paused clock: exact virtual times, no sleeps.

use super::*;
use crate::offload::OffloadConfig;

fn latency() -> LatencyModel {
    crate::cost::DEFAULT
}

fn engine(num_blocks: usize, max_num_seqs: usize) -> Engine {
    engine_with(num_blocks, max_num_seqs, None)
}

fn engine_with(num_blocks: usize, max_num_seqs: usize, lora: Option<Weights>) -> Engine {
    Engine::start(EngineConfig { lora, ..config(num_blocks, max_num_seqs) })
}

fn config(num_blocks: usize, max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs,
        max_num_batched_tokens: 8192,
        latency: latency(),
        seed: 1,
        generation_ids: inferrail_tokenize::Tokenizer::load("builtin:sim", 0).unwrap().generation_ids(),
        info: EngineInfo {
            model_name: "m".into(),
            block_size: 4,
            num_gpu_blocks: num_blocks,
            max_model_len: 1024,
            created: 0.0,
            kv_transfer: false,
            kv_offloading_size: None,
        },
        kv_events: None,
        lease: std::time::Duration::from_secs(30),
        failure: crate::nixl::FailurePolicy::Fail,
        lora: None,
        offload: None,
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        max_tokens,
        at_limit: FinishReason::Length,
        salt: 0,
        cache_salt: None,
        transfer: Transfer::None,
        lora: None,
        request_id: String::new(),
    }
}

/// Runs a request to the end: (cached tokens, time of first token, time of last, tokens).
async fn run(e: &Engine, prompt: Vec<u32>, max_tokens: usize) -> (usize, Duration, Duration, Vec<u32>) {
    let start = Instant::now();
    let mut sub = e.submit(request(prompt, max_tokens));
    let (mut cached, mut first, mut tokens) = (0, None, Vec::new());
    while let Some(ev) = sub.next().await {
        match ev {
            Event::Scheduled { cached_tokens } => cached = cached_tokens,
            Event::Token { id, finish } => {
                first.get_or_insert(start.elapsed());
                tokens.push(id);
                if finish.is_some() {
                    break;
                }
            }
            other => panic!("an ordinary request heard {other:?}"),
        }
    }
    (cached, first.unwrap_or_default(), start.elapsed(), tokens)
}

use std::time::Duration;

#[tokio::test(start_paused = true)]
async fn ttft_is_the_prefill_cost_and_decode_steps_follow_without_drift() {
    let e = engine(64, 8);
    let prompt: Vec<u32> = (0..10).collect();
    let (cached, ttft, total, tokens) = run(&e, prompt, 50).await;
    assert_eq!(cached, 0);
    assert_eq!(tokens.len(), 50);
    // The metrics carry the planned time exactly; the client sees it late by
    // at most one timer tick (tokio's timers round up to the millisecond).
    let planned_ttft = latency().prefill_secs(10, 0);
    assert!((sample(&e, "vllm:time_to_first_token_seconds_sum") - planned_ttft).abs() < 1e-9);
    assert!(ttft >= secs(planned_ttft) && ttft < secs(planned_ttft) + Duration::from_millis(1), "{ttft:?}");
    // 49 more steps planned back to back: the rounding of each timer is not
    // carried into the next deadline, so the end is late by one tick at most.
    let planned = secs(planned_ttft) + secs(latency().decode_secs(1)) * 49;
    assert!(total >= planned && total < planned + Duration::from_millis(1), "{total:?} vs {planned:?}");
    let e2e = sample(&e, "vllm:e2e_request_latency_seconds_sum");
    assert!((e2e - planned.as_secs_f64()).abs() < 1e-6, "{e2e}");
}

/// One unlabelled-but-for-engine sample of the metrics page.
fn sample(e: &Engine, name: &str) -> f64 {
    let prefix = format!("{name}{{engine=\"0\",model_name=\"m\"}} ");
    e.metrics_page().lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

#[tokio::test(start_paused = true)]
async fn a_repeated_prompt_hits_whole_blocks_but_never_its_last_token() {
    let e = engine(64, 8);
    let prompt: Vec<u32> = (100..112).collect(); // 12 tokens, 3 full blocks of 4
    let (c1, _, _, _) = run(&e, prompt.clone(), 1).await;
    let ttft1 = sample(&e, "vllm:time_to_first_token_seconds_sum");
    let (c2, _, _, _) = run(&e, prompt.clone(), 1).await;
    assert_eq!(c1, 0);
    assert_eq!(c2, 8, "the last block is recomputed: (12 - 1) / 4 = 2 blocks");
    let ttft2 = sample(&e, "vllm:time_to_first_token_seconds_sum") - ttft1;
    assert!((ttft2 - latency().prefill_secs(4, 8)).abs() < 1e-9, "{ttft2}");
    let mut longer = prompt;
    longer.extend([7, 7, 7]);
    let (c3, _, _, _) = run(&e, longer, 1).await;
    assert_eq!(c3, 12);
    let page = e.metrics_page();
    assert!(page.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 20.0"), "{page}");
    assert!(page.contains("vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 39.0"));
}

#[tokio::test(start_paused = true)]
async fn generated_blocks_are_cached_for_the_next_turn() {
    let e = engine(64, 8);
    let prompt: Vec<u32> = (0..6).collect();
    let (_, _, _, out) = run(&e, prompt.clone(), 7).await;
    // The next turn sends the prompt, the reply and more text.
    let mut turn2 = prompt;
    turn2.extend(&out);
    turn2.extend([900, 901, 902]);
    let (cached, _, _, _) = run(&e, turn2, 1).await;
    // 6 + 7 = 13 tokens, of which the last generated one was never computed:
    // 12 computed tokens make 3 full blocks.
    assert_eq!(cached, 12);
}

#[tokio::test(start_paused = true)]
async fn max_num_seqs_bounds_the_running_batch() {
    let e = engine(256, 2);
    let subs: Vec<Submitted> = (0..5u32).map(|i| e.submit(request(vec![i; 8], 100))).collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(e.load(), (2, 3));
    drop(subs);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(e.load(), (0, 0));
    let page = e.metrics_page();
    assert!(page.contains("finished_reason=\"abort\",model_name=\"m\"} 5.0"), "{page}");
    assert!(page.contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0"));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_request_frees_its_blocks_at_once() {
    let e = engine(16, 8);
    let mut sub = e.submit(request((0..40).collect(), 1000));
    // Wait for its first token, then go away mid-stream.
    while !matches!(sub.next().await, Some(Event::Token { .. })) {}
    assert!(e.metrics_page().contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.6875"));
    drop(sub);
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(e.load(), (0, 0));
    assert!(e.metrics_page().contains("vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.0"));
}

#[tokio::test(start_paused = true)]
async fn running_out_of_blocks_preempts_the_newest_and_everyone_still_finishes() {
    // 8 blocks of 4 tokens = 32 slots; two sequences that each grow to 20 tokens.
    let e = engine(8, 8);
    let a = tokio::spawn({
        let e = e.clone();
        async move { run(&e, (0..4).collect(), 16).await }
    });
    let b = tokio::spawn({
        let e = e.clone();
        async move { run(&e, (50..54).collect(), 16).await }
    });
    let (ra, rb) = (a.await, b.await);
    assert_eq!(ra.map(|r| r.3.len()).ok(), Some(16));
    assert_eq!(rb.map(|r| r.3.len()).ok(), Some(16));
    let page = e.metrics_page();
    assert!(!page.contains("vllm:num_preemptions_total{engine=\"0\",model_name=\"m\"} 0.0"), "expected a preemption: {page}");
}

#[tokio::test(start_paused = true)]
async fn reset_forgets_free_cached_blocks() {
    let e = engine(64, 8);
    let prompt: Vec<u32> = (0..9).collect();
    run(&e, prompt.clone(), 1).await;
    assert_eq!(e.reset_prefix_cache().await, Some(2));
    let (cached, _, _, _) = run(&e, prompt, 1).await;
    assert_eq!(cached, 0);
}

#[tokio::test(start_paused = true)]
async fn the_same_prompt_generates_the_same_tokens() {
    let e = engine(64, 8);
    let (_, _, _, a) = run(&e, vec![5, 6, 7], 12).await;
    let (_, _, _, b) = run(&e, vec![5, 6, 7], 12).await;
    assert_eq!(a, b);
}

#[tokio::test(start_paused = true)]
async fn a_prefill_leg_keeps_its_blocks_until_released_and_a_decode_leg_computes_no_prefill() {
    let e = engine(16, 8);
    // The prefill leg: 10 tokens in 4-token blocks, one output token.
    let mut p = e.submit(Request { transfer: Transfer::Keep("k".into()), ..request((0..10).collect(), 1) });
    let mut kept = None;
    while let Some(ev) = p.next().await {
        match ev {
            Event::Kept { block_ids } => kept = Some(block_ids),
            Event::Token { finish: Some(_), .. } => break,
            _ => {}
        }
    }
    let kept = kept.unwrap_or_default();
    assert_eq!(kept.len(), 3);
    assert_eq!(e.pin("k", vec![kept[2]]).await, Ok(()));
    assert_eq!(e.pin("other", vec![]).await, Err(Unread::Unknown));
    assert_eq!(e.pin("k", vec![99]).await, Err(Unread::NotKept));
    assert!(e.reset_prefix_cache().await.is_none(), "kept blocks are in use");
    e.release("k");
    assert!(e.reset_prefix_cache().await.is_some());

    // The decode leg: admitted at once with nothing to compute, it waits for
    // its blocks outside the batch, then its first token takes one decode step.
    let start = Instant::now();
    let mut d = e.submit(Request { transfer: Transfer::Read, ..request((0..10).collect(), 2) });
    assert_eq!(d.next().await, Some(Event::Scheduled { cached_tokens: 10 }));
    assert_eq!(d.next().await, Some(Event::Read { blocks: 3 }));
    tokio::time::sleep(Duration::from_millis(7)).await;
    d.loaded(true);
    assert!(matches!(d.next().await, Some(Event::Token { finish: None, .. })));
    assert_eq!(start.elapsed(), Duration::from_millis(7) + crate::cost::secs(latency().decode_secs(1)));
}

/// Two requests with one prefix admitted in the same step: the second finds
/// the blocks the first was scheduled to compute, as vLLM caches a prompt's
/// full blocks when it allocates them (`KVCacheManager::allocate_slots`).
#[tokio::test(start_paused = true)]
async fn a_request_scheduled_after_another_in_the_same_step_finds_its_prompt_blocks() {
    let e = engine(64, 8);
    let shared: Vec<u32> = (0..16).collect();
    let with = |tail: u32| shared.iter().copied().chain([100 + tail]).collect::<Vec<_>>();
    let (a, b) = (e.submit(request(with(0), 2)), e.submit(request(with(1), 2)));
    let scheduled = |mut sub: Submitted| async move {
        while let Some(ev) = sub.next().await {
            if let Event::Scheduled { cached_tokens } = ev {
                return (cached_tokens, Instant::now());
            }
        }
        (usize::MAX, Instant::now())
    };
    let ((a_cached, a_at), (b_cached, b_at)) = tokio::join!(scheduled(a), scheduled(b));
    assert_eq!(a_at, b_at, "both admitted in one step");
    assert_eq!((a_cached, b_cached), (0, 16), "the second finds the first's four full blocks");
}

fn adapter(id: u64) -> Adapter {
    Adapter { id, name: format!("a{id}").into(), path: format!("/w/a{id}"), parent: "m".into() }
}

/// Times of a submitted request's first and last tokens, from `start`.
async fn times(mut sub: Submitted, start: Instant) -> (Duration, Duration) {
    let mut first = None;
    while let Some(ev) = sub.next().await {
        if let Event::Token { finish, .. } = ev {
            first.get_or_insert(start.elapsed());
            if finish.is_some() {
                break;
            }
        }
    }
    (first.unwrap_or_default(), start.elapsed())
}

/// With one adapter slot, a request for a second adapter waits (deferred)
/// while the first adapter's request runs, and a base-model request behind
/// it is not held up; the first step pays the adapter's read and copy, and
/// the info gauge lists the adapters that have had output.
#[tokio::test(start_paused = true)]
async fn a_second_adapter_waits_for_the_slot_and_the_base_model_does_not() {
    let e = engine_with(64, 8, Some(Weights::new(1, 2, 0.05, 0.005)));
    let start = Instant::now();
    let lora = |prompt: Vec<u32>, id: u64| Request { lora: Some(adapter(id)), ..request(prompt, 5) };
    let a = e.submit(lora((0..8).collect(), 1));
    let b = e.submit(lora((20..28).collect(), 2));
    let c = e.submit(request((40..48).collect(), 5));
    tokio::task::yield_now().await;
    let (a, b, c) = tokio::join!(times(a, start), times(b, start), times(c, start));
    let first_step = latency().step_secs(&[(8, 0), (8, 0)], 0) + 0.055;
    assert!((a.0.as_secs_f64() - first_step).abs() < 2e-3, "a's first token waits for its adapter: {:?}", a.0);
    assert!((c.0.as_secs_f64() - first_step).abs() < 2e-3, "the base-model request runs beside it: {:?}", c.0);
    assert!(b.0 > a.1, "b starts only once a has finished: {:?} vs {:?}", b.0, a.1);
    let page = e.metrics_page();
    let info: Vec<&str> = page.lines().filter(|l| l.starts_with("vllm:lora_requests_info{")).collect();
    let lists: Vec<&str> = info.iter().filter_map(|l| l.split("running_lora_adapters=\"").nth(1)?.split('"').next()).collect();
    assert_eq!(lists, ["a1", "", "a2"], "{page}");
    assert!(info.iter().all(|l| l.starts_with("vllm:lora_requests_info{max_lora=\"1\",")), "{info:?}");
}

#[tokio::test(start_paused = true)]
async fn deferred_requests_are_counted_by_reason_while_they_wait() {
    let e = engine_with(64, 8, Some(Weights::new(1, 1, 0.0, 0.0)));
    let lora = |prompt: Vec<u32>, id: u64| Request { lora: Some(adapter(id)), ..request(prompt, 50) };
    let a = e.submit(lora((0..8).collect(), 1));
    let b = e.submit(lora((20..28).collect(), 2));
    // Two steps in: a runs, b has been passed over.
    tokio::time::sleep(secs(latency().prefill_secs(8, 0) + latency().decode_secs(1) * 1.5)).await;
    let by_reason = |reason: &str| {
        let prefix = format!("vllm:num_requests_waiting_by_reason{{engine=\"0\",model_name=\"m\",reason=\"{reason}\"}} ");
        e.metrics_page().lines().find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
    };
    assert_eq!((by_reason("deferred"), by_reason("capacity")), (Some(1.0), Some(0.0)));
    assert_eq!(sample(&e, "vllm:num_requests_waiting"), 1.0);
    drop((a, b));
}

fn offloading(num_blocks: usize, host_blocks: usize) -> Engine {
    offloading_at(num_blocks, host_blocks, 0.001)
}

/// With copies of `block_secs` a block.
fn offloading_at(num_blocks: usize, host_blocks: usize, block_secs: f64) -> Engine {
    let offload = OffloadConfig { blocks: host_blocks, block_secs, block_bytes: 64, self_describing: false };
    Engine::start(EngineConfig { offload: Some(offload), ..config(num_blocks, 8) })
}

/// A labelled sample of the metrics page.
fn labelled(e: &Engine, name: &str, label: &str) -> f64 {
    let prefix = format!("{name}{{engine=\"0\",model_name=\"m\",{label}}} ");
    e.metrics_page().lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

#[tokio::test(start_paused = true)]
async fn a_prompt_evicted_from_the_gpu_is_loaded_back_from_the_host_tier() {
    // Four GPU blocks of 4 tokens: the second prompt evicts the first.
    let e = offloading(4, 64);
    let a: Vec<u32> = (0..12).collect();
    let b: Vec<u32> = (100..116).collect();
    assert_eq!(run(&e, a.clone(), 1).await.0, 0);
    assert_eq!(run(&e, b, 1).await.0, 0);
    // Both prompts' full blocks were stored (the copies end during the next run).
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(sample(&e, "vllm:kv_offload_store_bytes_total"), 7.0 * 64.0);
    let mut longer = a;
    longer.extend([7, 7]);
    let before = sample(&e, "vllm:time_to_first_token_seconds_sum");
    let (cached, _, _, _) = run(&e, longer, 1).await;
    assert_eq!(cached, 12, "none on the GPU, all three blocks from the host");
    assert_eq!(labelled(&e, "vllm:prompt_tokens_cached_by_source_total", "source=\"host\""), 12.0);
    assert_eq!(labelled(&e, "vllm:prompt_tokens_cached_by_source_total", "source=\"device\""), 0.0);
    assert_eq!(sample(&e, "vllm:external_prefix_cache_hits_total"), 12.0);
    assert_eq!(sample(&e, "vllm:external_prefix_cache_queries_total"), 12.0 + 16.0 + 14.0);
    assert_eq!(sample(&e, "vllm:kv_offload_load_bytes_total"), 3.0 * 64.0);
    // It waited for its load (3 ms) outside the batch, then computed 2 tokens after 12.
    let ttft = sample(&e, "vllm:time_to_first_token_seconds_sum") - before;
    let computed = latency().prefill_secs(2, 12);
    assert!(ttft >= 0.003 + computed - 1e-9 && ttft < 0.003 + computed + 0.001, "{ttft}");
}

#[tokio::test(start_paused = true)]
async fn the_host_lookup_reaches_the_last_full_block_the_gpu_lookup_stops_short_of() {
    let e = offloading(64, 64);
    let prompt: Vec<u32> = (0..16).collect();
    run(&e, prompt.clone(), 1).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    // The GPU lookup stops a token short (3 blocks); the host has the fourth,
    // so the engine reports the whole prompt cached, and computes its last token.
    let (cached, _, _, _) = run(&e, prompt, 1).await;
    assert_eq!(cached, 16);
    assert_eq!(labelled(&e, "vllm:prompt_tokens_cached_by_source_total", "source=\"device\""), 12.0);
    assert_eq!(labelled(&e, "vllm:prompt_tokens_cached_by_source_total", "source=\"host\""), 4.0);
}

#[tokio::test(start_paused = true)]
async fn a_hit_on_blocks_still_being_stored_waits_for_the_store() {
    // Copies of 100 ms a block: the second prompt evicts the first from the
    // GPU long before the first one's store ends. The third request waits
    // for that store, then for its own load, rather than compute.
    let e = offloading_at(4, 64, 0.1);
    let a: Vec<u32> = (0..12).collect();
    run(&e, a.clone(), 1).await;
    let (cached, _, _, _) = run(&e, (100..116).collect(), 1).await;
    assert_eq!(cached, 0);
    assert_eq!(sample(&e, "vllm:kv_offload_store_bytes_total"), 0.0, "no store is done yet");
    let mut longer = a;
    longer.push(9);
    let (cached, ttft, _, _) = run(&e, longer, 1).await;
    assert_eq!(cached, 12);
    assert!(ttft > Duration::from_millis(300 + 250), "the store's 300 ms (some passed) and the load's 300: {ttft:?}");
}

#[tokio::test(start_paused = true)]
async fn a_full_host_tier_evicts_the_least_recent_and_a_failed_store_is_counted() {
    // Room for one prompt's 4 blocks: the second prompt's store evicts the first.
    let e = offloading(64, 4);
    run(&e, (0..16).collect(), 1).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    run(&e, (100..116).collect(), 1).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(sample(&e, "vllm:kv_offload_store_bytes_total"), 8.0 * 64.0);
    // Two prompts at once: the first one's offer evicts the second prompt's
    // blocks; the other finds no room while those are being stored.
    let mut one = e.submit(request((200..216).collect(), 3));
    let mut two = e.submit(request((300..316).collect(), 3));
    for s in [&mut one, &mut two] {
        while !matches!(s.next().await, Some(Event::Token { finish: Some(_), .. })) {}
    }
    assert!(sample(&e, "vllm:kv_offload_allocation_failure_total") >= 1.0);
}
