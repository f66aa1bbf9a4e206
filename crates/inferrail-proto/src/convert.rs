//! The one place protobuf meets the domain: `inferrail-load` types to and from
//! `inferrail.load.v1` messages.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use inferrail_load::{CacheInfo, Engine, EngineLoad, LoraReport, Scrape, ScrapeError};

use crate::load::v1 as pb;

/// A message that does not describe a load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// The engine is unspecified or unknown.
    #[error("unknown engine {0}")]
    UnknownEngine(i32),
    /// A report carries neither a load nor a failure.
    #[error("the report has no outcome")]
    NoOutcome,
    /// A number does not fit the domain type.
    #[error("{0} out of range")]
    OutOfRange(&'static str),
}

impl From<Engine> for pb::Engine {
    fn from(e: Engine) -> Self {
        match e {
            Engine::Vllm => pb::Engine::Vllm,
            Engine::Sglang => pb::Engine::Sglang,
        }
    }
}

impl From<&EngineLoad> for pb::EngineLoad {
    fn from(l: &EngineLoad) -> Self {
        pb::EngineLoad {
            engine: pb::Engine::from(l.engine).into(),
            running: l.running,
            waiting: l.waiting,
            deferred: l.deferred,
            kv_usage: l.kv_usage,
            prefix_queries: l.prefix_queries,
            prefix_hits: l.prefix_hits,
            cache: l.cache.map(|c| pb::CacheInfo { block_size: c.block_size as u64, blocks: c.blocks as u64 }),
            lora: l.lora.as_ref().map(|a| pb::LoraInfo { max_loras: a.max_loras, running: a.running.clone(), waiting: a.waiting.clone() }),
        }
    }
}

impl TryFrom<&pb::EngineLoad> for EngineLoad {
    type Error = ConvertError;
    fn try_from(m: &pb::EngineLoad) -> Result<Self, ConvertError> {
        let engine = match pb::Engine::try_from(m.engine) {
            Ok(pb::Engine::Vllm) => Engine::Vllm,
            Ok(pb::Engine::Sglang) => Engine::Sglang,
            _ => return Err(ConvertError::UnknownEngine(m.engine)),
        };
        if !(0.0..=1.0).contains(&m.kv_usage) {
            return Err(ConvertError::OutOfRange("kv_usage"));
        }
        let cache = match &m.cache {
            None => None,
            Some(c) => Some(CacheInfo {
                block_size: usize::try_from(c.block_size).map_err(|_| ConvertError::OutOfRange("block_size"))?,
                blocks: usize::try_from(c.blocks).map_err(|_| ConvertError::OutOfRange("blocks"))?,
            }),
        };
        Ok(EngineLoad {
            engine,
            running: m.running,
            waiting: m.waiting,
            deferred: m.deferred,
            kv_usage: m.kv_usage,
            prefix_queries: m.prefix_queries,
            prefix_hits: m.prefix_hits,
            cache,
            lora: m
                .lora
                .as_ref()
                .map(|a| Arc::new(LoraReport { max_loras: a.max_loras, running: a.running.clone(), waiting: a.waiting.clone() })),
        })
    }
}

impl From<&ScrapeError> for pb::ScrapeFailure {
    fn from(e: &ScrapeError) -> Self {
        let reason = match e {
            ScrapeError::Timeout(_) => pb::scrape_failure::Reason::Timeout,
            ScrapeError::TooLarge(_) => pb::scrape_failure::Reason::TooLarge,
            ScrapeError::Http(_) => pb::scrape_failure::Reason::Http,
            ScrapeError::Unreadable(_) => pb::scrape_failure::Reason::Unreadable,
        };
        pb::ScrapeFailure { reason: reason.into(), detail: e.to_string() }
    }
}

/// The report of `scrape`, sent at `now`.
pub fn report(scrape: &Scrape, now: Instant) -> pb::LoadReport {
    let (age, outcome) = match &scrape.outcome {
        Ok(s) => (s.age(now), pb::load_report::Outcome::Load(pb::EngineLoad::from(&s.load))),
        Err(e) => (Duration::ZERO, pb::load_report::Outcome::Failure(pb::ScrapeFailure::from(e))),
    };
    pb::LoadReport {
        replica: scrape.id.to_string(),
        address: scrape.addr.to_string(),
        scraped_unix_ms: unix_ms(scrape.wall),
        age_at_send_us: u64::try_from(age.as_micros()).unwrap_or(u64::MAX),
        outcome: Some(outcome),
    }
}

/// What a received report says: a load, or the failure it carries.
pub fn outcome(report: &pb::LoadReport) -> Result<Result<EngineLoad, pb::ScrapeFailure>, ConvertError> {
    match &report.outcome {
        Some(pb::load_report::Outcome::Load(l)) => Ok(Ok(EngineLoad::try_from(l)?)),
        Some(pb::load_report::Outcome::Failure(f)) => Ok(Err(f.clone())),
        None => Err(ConvertError::NoOutcome),
    }
}

/// Milliseconds since the Unix epoch (negative before it).
pub fn unix_ms(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

/// When a report received at `received` was scraped, on the receiver's own
/// clock: its age when the sidecar sent it, counted back from its receipt.
/// No wall clocks are compared, so a sidecar whose clock is off by seconds
/// still reports fresh loads as fresh (the time in flight, well under a
/// millisecond next to the router, is not counted).
pub fn received_at(report: &pb::LoadReport, received: Instant) -> Instant {
    received.checked_sub(Duration::from_micros(report.age_at_send_us)).unwrap_or(received)
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use inferrail_load::{PageError, Snapshot};

    use super::*;

    fn load() -> EngineLoad {
        EngineLoad {
            engine: Engine::Vllm,
            running: 3,
            waiting: 1,
            deferred: 1,
            kv_usage: 0.25,
            prefix_queries: Some(100),
            prefix_hits: None,
            cache: Some(CacheInfo { block_size: 16, blocks: 4096 }),
            lora: Some(Arc::new(LoraReport { max_loras: 2, running: vec!["sql".into()], waiting: vec!["sql".into(), "chat".into()] })),
        }
    }

    #[test]
    fn a_load_survives_the_round_trip() {
        let l = load();
        assert_eq!(EngineLoad::try_from(&pb::EngineLoad::from(&l)), Ok(l.clone()));
        let sg = EngineLoad { engine: Engine::Sglang, cache: None, prefix_queries: None, lora: None, ..l };
        assert_eq!(EngineLoad::try_from(&pb::EngineLoad::from(&sg)), Ok(sg));
    }

    #[test]
    fn nonsense_is_rejected() {
        let mut m = pb::EngineLoad::from(&load());
        m.engine = 0;
        assert_eq!(EngineLoad::try_from(&m), Err(ConvertError::UnknownEngine(0)));
        let mut m = pb::EngineLoad::from(&load());
        m.kv_usage = f64::NAN;
        assert_eq!(EngineLoad::try_from(&m), Err(ConvertError::OutOfRange("kv_usage")));
        assert_eq!(outcome(&pb::LoadReport::default()), Err(ConvertError::NoOutcome));
    }

    #[test]
    fn reports_carry_age_and_failures() {
        let t0 = Instant::now();
        let addr: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let ok = Scrape {
            id: Arc::from("a"),
            addr,
            wall: UNIX_EPOCH + Duration::from_millis(1_700_000_000_123),
            outcome: Ok(Snapshot { at: t0, load: load() }),
        };
        let r = report(&ok, t0 + Duration::from_millis(7));
        assert_eq!((r.replica.as_str(), r.address.as_str()), ("a", "127.0.0.1:8000"));
        assert_eq!((r.scraped_unix_ms, r.age_at_send_us), (1_700_000_000_123, 7000));
        assert_eq!(outcome(&r), Ok(Ok(load())));
        let failed = Scrape { outcome: Err(ScrapeError::Unreadable(PageError::UnknownEngine)), ..ok };
        let Ok(Err(f)) = outcome(&report(&failed, t0)) else { panic!("not a failure") };
        assert_eq!(f.reason(), pb::scrape_failure::Reason::Unreadable);
    }

    #[test]
    fn a_report_is_dated_by_its_age_not_by_wall_clocks() {
        let now = Instant::now();
        let r = pb::LoadReport { age_at_send_us: 50_000, scraped_unix_ms: 1, ..pb::LoadReport::default() };
        assert_eq!(received_at(&r, now), now - Duration::from_millis(50));
    }
}
