//! What the router tells about itself: [`traces`] exports a span per
//! decision, [`decision_log`] writes sampled decisions and their outcomes,
//! [`gauges`] sets the per-replica gauges the metrics page shows.

pub mod decision_log;
pub mod gauges;
pub mod traces;
