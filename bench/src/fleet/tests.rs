//! The `fleet` command's flags: policy parameters reach the simulated
//! router's configuration, and bad ones are refused.

use inferrail_fleet::sim;
use inferrail_policy::PolicyKind;

#[test]
fn policy_params_reach_the_routers_config_and_bad_ones_are_refused() -> anyhow::Result<()> {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        fleet: super::FleetArgs,
    }
    let args = |over: &str| <Cli as clap::Parser>::try_parse_from(["fleet", "--kv-blocks", "64", "--policy-params", over]).map(|c| c.fleet);
    let s = super::setup(&args(r#"{"cost_model": {"share_weight": 0.5}}"#)?, 3)?;
    let params = sim::config(&s, PolicyKind::CostModel).params(0).map_err(|e| anyhow::anyhow!(e.join("; ")))?;
    assert_eq!(params.cost_model.share_weight, 0.5);
    assert_eq!(params.prefill, inferrail_fleet::timescale::params(1.0).prefill, "the time scale's kept");
    assert!(super::setup(&args(r#"{"cost_model": {"kappa": 2}}"#)?, 3).is_err(), "kappa above 1");
    assert!(super::setup(&args(r#"{"cost_model": {"share_wieght": 0}}"#)?, 3).is_err(), "an unknown key");
    Ok(())
}
