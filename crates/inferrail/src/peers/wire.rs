//! The messages routers exchange, from and to the router's own terms: a
//! committed decision as its peers hold it, and a lifecycle event as told
//! to the decider or to the mirrors. Plain functions, no I/O.

use std::time::Duration;

use inferrail_proto::peer::v1::heard::Event as WireEvent;
use inferrail_proto::peer::v1::peer_message::Kind;
use inferrail_proto::peer::v1::{Decided, Heard, Status as WireStatus, Usage as WireUsage};
use inferrail_route::Core;
use inferrail_route::fleet::Lease;
use inferrail_route::lifecycle::{Event, Usage};

/// A request this router decided, as its peers are told it: what its lease
/// holds now (a request past its first byte has no prefill queued), and the
/// conversation it names.
pub fn decided(core: &Core, request: &str, lease: &Lease, session: Option<&str>) -> Kind {
    let block_size = core.block_size(&lease.replica);
    let hold = lease.hold();
    let (output, blocks) = match &hold.prediction {
        Some(p) => (p.output_tokens(), p.blocks(block_size).unwrap_or_default().iter().flat_map(|h| h.to_le_bytes()).collect()),
        None => (0, Vec::new()),
    };
    Kind::Decided(Decided {
        request: request.to_string(),
        model: core.model(lease.model).name.clone(),
        replica: lease.replica.id.clone(),
        prompt_tokens: lease.prompt_tokens,
        tokenized: hold.prediction.is_some(),
        output_tokens: output as u64,
        block_size: block_size as u32,
        blocks,
        prefill_us: hold.prefill.as_micros() as u64,
        kv_tokens: hold.kv_tokens,
        session: session.map(str::to_owned),
    })
}

/// An event of request `request` that happened `ago`, as a peer is told it.
pub fn heard(request: &str, event: Event, to_decider: bool, ago: Duration) -> Option<Kind> {
    let event = match event {
        Event::Status { code, served_by } => WireEvent::Status(WireStatus { code: u32::from(code), served_by }),
        Event::FirstByte => WireEvent::FirstByte(true),
        Event::Usage(u) => WireEvent::Usage(WireUsage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens,
        }),
        Event::End => WireEvent::End(true),
        Event::Gone => WireEvent::Gone(true),
        // Each router keeps its own time.
        Event::Tick => return None,
    };
    Some(Kind::Heard(Heard { request: request.to_string(), to_decider, event: Some(event), ago_us: ago.as_micros() as u64 }))
}

/// The lifecycle event a peer told; `None` for a status that is not an
/// HTTP status (counted: it is never taken for an answer).
pub fn event(e: WireEvent) -> Option<Event> {
    Some(match e {
        WireEvent::Status(s) => match u16::try_from(s.code).ok().filter(|c| (100..=999).contains(c)) {
            Some(code) => Event::Status { code, served_by: s.served_by },
            None => {
                metrics::counter!("inferrail_bad_events_total", "source" => "peer", "reason" => "bad_status").increment(1);
                return None;
            }
        },
        WireEvent::FirstByte(_) => Event::FirstByte,
        WireEvent::Usage(u) => {
            Event::Usage(Usage { prompt_tokens: u.prompt_tokens, cached_tokens: u.cached_tokens, completion_tokens: u.completion_tokens })
        }
        WireEvent::End(_) => Event::End,
        WireEvent::Gone(_) => Event::Gone,
    })
}
